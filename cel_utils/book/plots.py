"""Plots of one run, drawn from its JSON artifact (so any stored run can be re-plotted without the model)."""
from __future__ import annotations

import numpy as np

from cel_utils.book.text import ordinal
from cel_utils.models.heads import parse_head
from cel_utils.pipeline.schema import RunArtifact


def stage1_gains(artifact: RunArtifact) -> np.ndarray:
    """Discovery gain in points of every single head, as a [layers, heads] array (NaN where not scored)."""
    geometry = artifact["model"]["geometry"]
    gains = np.full((geometry["n_layers"], geometry["n_heads"]), np.nan)
    for score in artifact["stage1"]:
        if len(score["heads"]) == 1:
            head = parse_head(score["heads"][0])
            gains[head.layer, head.head] = score["gain_points"]
    return gains


def _reliability(artifact: RunArtifact, key: str) -> dict | None:
    return (artifact["reliability"] or {}).get(key)


def null_histogram(artifact: RunArtifact, ax=None):
    """Holdout gains of random head sets of the frozen set's size, with the frozen set's gain marked."""
    import matplotlib.pyplot as plt
    import seaborn as sns

    null = _reliability(artifact, "null")
    if ax is None:
        _, ax = plt.subplots(figsize=(6.0, 3.0))
    if not null:
        ax.text(0.5, 0.5, "no random-set null in this run (n_random_sets = 0)", ha="center", va="center")
        ax.set_axis_off()
        return ax.figure
    step = 100.0 / null.get("n_items", artifact["holdout"]["n_items"])  # gains are multiples of one item
    gains = np.asarray(null["gains_points"])
    sns.histplot(gains, ax=ax, binwidth=step, binrange=(min(gains.min(), null["selected_gain_points"]) - step / 2,
                                                        max(gains.max(), null["selected_gain_points"]) + step / 2),
                 color="0.65", edgecolor="white")
    ax.axvline(null["selected_gain_points"], color="crimson", linewidth=2,
               label=f"frozen {artifact['frozen']['label']}: {null['selected_gain_points']:+.1f}")
    ax.axvline(0.0, color="black", linewidth=0.8, linestyle=":")
    ax.set_xlabel("holdout gain (points)" if "n_items" not in null else
                  f"gain on {null['n_items']} holdout items, a seeded random subset (points)")
    ax.set_ylabel("random sets")
    ax.legend(fontsize=8, loc="upper left")
    ax.set_title(f"holdout gains of {null['n_sets']} random sets of {null['size']} head(s)\nfrozen set at the "
                 f"{ordinal(null['percentile'])} percentile (empirical p = {null['p_value']:.3g})", fontsize=9)
    ax.figure.tight_layout()
    return ax.figure


def stability_figure(artifact: RunArtifact, top: int = 12):
    """Left: how often each head is selected across resampled discovery sets (frozen heads in red).
    Right: the holdout gains of those selections, against the frozen set's and the random sets' gains."""
    import matplotlib.pyplot as plt
    import seaborn as sns

    stab = _reliability(artifact, "stability")
    fig, (left, right) = plt.subplots(1, 2, figsize=(9.5, 3.4), gridspec_kw={"width_ratios": [1, 1.3]})
    if not stab:
        for ax in (left, right):
            ax.set_axis_off()
        left.text(0.5, 0.5, "no stability analysis in this run (n_resamples = 0)", ha="center", va="center")
        return fig
    heads = list(stab["head_frequency"].items())[:top]
    frozen = set(artifact["frozen"]["heads"])
    colors = ["crimson" if name in frozen else "0.6" for name, _ in heads]
    left.barh([name for name, _ in heads][::-1], [100 * share for _, share in heads][::-1], color=colors[::-1])
    left.set_xlim(0, 100)
    left.set_xlabel("selected in (% of resamples)")
    left.set_title(f"{stab['n_resamples']} {stab['method']} resamples: frozen set re-selected in "
                   f"{100 * stab['frozen_set_frequency']:.0f}%\nmean pairwise Jaccard {stab['mean_jaccard']:.2f}",
                   fontsize=9)

    gains = {"resampled selections": stab["holdout_gains_points"]}
    null = _reliability(artifact, "null")
    if null:
        gains["random sets" if "n_items" not in null else f"random sets\n({null['n_items']} random items)"] = null["gains_points"]
    import pandas as pd

    frame = pd.DataFrame([(group, g) for group, values in gains.items() for g in values], columns=["", "holdout gain (points)"])
    sns.stripplot(frame, x="holdout gain (points)", y="", ax=right, jitter=0.25, alpha=0.7, size=4, color="0.3")
    right.axvline(artifact["holdout"]["gain_points"], color="crimson", linewidth=2,
                  label=f"frozen {artifact['frozen']['label']}")
    right.axvline(0.0, color="black", linewidth=0.8, linestyle=":")
    right.legend(fontsize=8, loc="lower right")
    right.set_title("holdout gains", fontsize=9)
    fig.tight_layout()
    return fig


def attribution_scatter(payload: dict):
    """Attribution patching's estimate of every head against exact screening: the effect on the task margin
    (left) and the accuracy gain that the search ranks by (right). Heads of the exact pool are in red."""
    import matplotlib.pyplot as plt

    sc = payload.get("screening")
    fig, (left, right) = plt.subplots(1, 2, figsize=(9.5, 3.6))
    if not sc:
        for ax in (left, right):
            ax.set_axis_off()
        left.text(0.5, 0.5, f"attribution patching {payload.get('attribution_skipped') or 'not run'}", ha="center",
                  va="center", wrap=True)
        return fig
    estimate = np.asarray(sc["estimate"]).ravel()
    margin = np.asarray(sc["exact_margin_effect"]).ravel()
    gain = np.asarray(sc["exact_gain_points"]).ravel()
    n_heads = payload["model"]["geometry"]["n_heads"]
    pool = np.zeros_like(gain, dtype=bool)
    for name in sc["exact_pool"]:
        head = parse_head(name)
        pool[head.layer * n_heads + head.head] = True
    for ax, exact, label, rho in ((left, margin, "exact effect on the mean margin", sc["spearman_margin"]),
                                  (right, gain, "exact accuracy gain (points)", sc["spearman_gain"])):
        ax.scatter(estimate[~pool], exact[~pool], s=12, color="0.45", alpha=0.7, label="heads")
        ax.scatter(estimate[pool], exact[pool], s=18, color="crimson", label=f"exact pool (top {sc['p']})")
        ax.axhline(0, color="black", linewidth=0.6, linestyle=":")
        ax.axvline(0, color="black", linewidth=0.6, linestyle=":")
        ax.set_xlabel("attribution estimate of the margin effect")
        ax.set_ylabel(label)
        ax.set_title("Spearman n/a (one side constant)" if np.isnan(rho) else f"Spearman {rho:.2f}", fontsize=9)
    lo, hi = min(estimate.min(), margin.min()), max(estimate.max(), margin.max())
    left.plot([lo, hi], [lo, hi], color="steelblue", linewidth=0.8, label="estimate = exact")
    left.legend(fontsize=7, loc="upper left")
    fig.suptitle(f"{payload['model']['name']} on {payload['task']['name']}: one head ablated at a time, "
                 f"{payload['n_discovery']} discovery items", fontsize=9)
    fig.tight_layout()
    return fig
