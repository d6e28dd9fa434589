"""Figures of the toy-model simulation (:mod:`cel_utils.theory.simulation`): coefficient traces and the alpha sweep."""
from __future__ import annotations

import pandas as pd

from cel_utils.theory.simulation import FEATURES, HEADS, SimResult


def plot_traces(result: SimResult, seed: int, axes=None):
    """The nine coefficients c_hj of one traced seed over training, one panel per feature."""
    import matplotlib.pyplot as plt
    import seaborn as sns

    cfg = result.config
    if axes is None:
        _, axes = plt.subplots(1, len(FEATURES), figsize=(12, 3.4), sharey=True)
    palette = sns.color_palette("colorblind", HEADS)
    for j, (ax, name) in enumerate(zip(axes, FEATURES)):
        for h in range(HEADS):
            style = "-" if h == result.winners[seed, j] else "--"
            curve = result.trace[seed, :, h, j]
            ax.plot(result.trace_steps, curve, style, color=palette[h], label=f"head {h}")
        ax.axhline(cfg.target[j], color="grey", lw=0.8, ls=":")
        # Linear only well below alpha^4, so that the losers' alpha^4 scale shows on the log part.
        ax.set_yscale("symlog", linthresh=cfg.alpha**4 / 100)
        ax.set_title(f"feature {name} (target {cfg.target[j]:g})")
        ax.set_xlabel("step")
    axes[0].set_ylabel(r"$c_{hj}$ (symlog)")
    axes[0].legend(frameon=False)
    return axes


def plot_sweep(sweep: pd.DataFrame, axes=None):
    """Localization against alpha: runner-up size, localized fraction, and the effects of deletion."""
    import matplotlib.pyplot as plt

    if axes is None:
        _, axes = plt.subplots(1, 3, figsize=(13, 3.6))
    ax = axes[0]
    ax.loglog(sweep["alpha"], sweep["median loser ratio"], "o-", label="median runner-up / winner")
    ref = sweep["median loser ratio"].iloc[0] * (sweep["alpha"] / sweep["alpha"].iloc[0]) ** 4
    ax.loglog(sweep["alpha"], ref, "k:", label=r"$\propto \alpha^4$")
    ax.set_xlabel(r"$\alpha$")
    ax.legend(frameon=False)
    ax = axes[1]
    ax.semilogx(sweep["alpha"], 1 - sweep["localized"], "o-", label="not localized")
    ax.semilogx(sweep["alpha"], sweep["P(E)"], "s-", label="P(E)")
    ax.axhline(4 / 9, color="grey", ls=":", label="4/9")
    ax.set_xlabel(r"$\alpha$")
    ax.set_ylabel("fraction of seeds")
    ax.legend(frameon=False)
    ax = axes[2]
    ax.semilogx(sweep["alpha"], sweep["dR_A on E / t^2"], "o-", label=r"$\Delta R_A / t^2$ on E")
    ax.semilogx(sweep["alpha"], sweep["dR_B on E / t^2"] / 3, "s-", label=r"$\Delta R_B / 3t^2$ on E")
    ax.axhline(-1, color="grey", ls=":")
    ax.axhline(1, color="grey", ls=":")
    ax.set_xlabel(r"$\alpha$")
    ax.legend(frameon=False)
    return axes


def sweep_figure(sweep: pd.DataFrame):
    """:func:`plot_sweep`'s three panels as an interactive figure (hover gives each alpha's values); returns an
    :class:`~cel_utils.book.interactive.OfflineFigure`, which the book shows without fetching plotly.js."""
    import plotly.graph_objects as go
    from plotly.subplots import make_subplots

    from cel_utils.book.interactive import OfflineFigure

    alpha = sweep["alpha"]
    reference = sweep["median loser ratio"].iloc[0] * (alpha / alpha.iloc[0]) ** 4
    panels = [
        ("runner-up / winner (median)", [("median runner-up / winner", sweep["median loser ratio"], "circle"),
                                         ("∝ α⁴ (reference)", reference, None)]),
        ("fraction of seeds", [("not localized", 1 - sweep["localized"], "circle"), ("P(E)", sweep["P(E)"], "square")]),
        ("effect of deleting U's winner, on E", [("ΔR_A / t²", sweep["dR_A on E / t^2"], "circle"),
                                                 ("ΔR_B / 3t²", sweep["dR_B on E / t^2"] / 3, "square")]),
    ]
    figure = make_subplots(rows=1, cols=3, subplot_titles=[title for title, _ in panels], horizontal_spacing=0.08)
    for col, (_, curves) in enumerate(panels, start=1):
        for name, values, symbol in curves:
            figure.add_trace(go.Scatter(
                x=alpha, y=values, name=name, legendgroup=str(col),
                mode="lines+markers" if symbol else "lines", marker={"symbol": symbol or "circle"},
                line={"dash": "dot"} if symbol is None else {},
                hovertemplate=f"{name}<br>α = %{{x:g}}<br>%{{y:.3g}}<extra></extra>"), row=1, col=col)
        figure.update_xaxes(type="log", title_text="α (initial scale)", row=1, col=col)
    figure.update_yaxes(type="log", row=1, col=1)
    for col, levels in ((2, [(4 / 9, "4/9")]), (3, [(-1, "limit −1"), (1, "limit +1")])):
        for level, label in levels:
            figure.add_hline(y=level, line={"color": "grey", "dash": "dot", "width": 1}, annotation_text=label,
                             annotation_position="top left", row=1, col=col)
    figure.update_layout(title={"text": "Localization against the initial scale α"}, height=440,
                         legend={"orientation": "h", "y": -0.25}, margin={"t": 80, "b": 40},
                         hovermode="closest")
    return OfflineFigure(figure)
