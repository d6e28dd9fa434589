"""Plots of one run, drawn from its JSON artifact (so any stored run can be re-plotted without the model)."""
from __future__ import annotations

import numpy as np

from cel_utils.heads import parse_head


def stage1_gains(artifact: dict) -> np.ndarray:
    """Discovery gain in points of every single head, as a [layers, heads] array (NaN where not scored)."""
    geometry = artifact["model"]["geometry"]
    gains = np.full((geometry["n_layers"], geometry["n_heads"]), np.nan)
    for score in artifact["stage1"]:
        if len(score["heads"]) == 1:
            head = parse_head(score["heads"][0])
            gains[head.layer, head.head] = score["gain_points"]
    return gains


def stage1_heatmap(artifact: dict, ax=None):
    """Heat map of stage-1 gains (layers x heads), diverging and centred at zero.

    Pooled heads carry their pool rank (1 = best); the frozen set is outlined in black. Returns the figure.
    """
    import matplotlib.pyplot as plt
    import seaborn as sns
    from matplotlib.patches import Rectangle

    gains = stage1_gains(artifact)
    n_layers, n_heads = gains.shape
    if ax is None:
        _, ax = plt.subplots(figsize=(max(4.0, 0.6 * n_heads + 2.2), max(2.6, 0.3 * n_layers + 1.4)))
    finite = np.abs(gains[np.isfinite(gains)])
    limit = float(finite.max()) if finite.size and finite.max() > 0 else 1.0
    sns.heatmap(gains, ax=ax, cmap="vlag", center=0.0, vmin=-limit, vmax=limit, linewidths=0.4, linecolor="white",
                cbar_kws={"label": "discovery gain (points)"}, xticklabels=range(n_heads), yticklabels=range(n_layers))
    for rank, name in enumerate(artifact["pool"], start=1):
        head = parse_head(name)
        ax.text(head.head + 0.5, head.layer + 0.5, str(rank), ha="center", va="center", fontsize=8, fontweight="bold")
    for name in artifact["frozen"]["heads"]:
        head = parse_head(name)
        ax.add_patch(Rectangle((head.head, head.layer), 1, 1, fill=False, edgecolor="black", linewidth=2.0))
    ax.set_xlabel("query head")
    ax.set_ylabel("layer")
    ax.tick_params(axis="y", labelrotation=0)
    ax.set_title(f"{artifact['model']['name']} on {artifact['task']['name']}: one head ablated at a time\n"
                 f"numbers = pool rank (top {len(artifact['pool'])}), black box = frozen set {artifact['frozen']['label']}",
                 fontsize=9)
    ax.figure.tight_layout()
    return ax.figure
