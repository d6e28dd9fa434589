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
