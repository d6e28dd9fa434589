"""Numbers the book's prose quotes, computed at build time (a Sphinx extension listed in ``_config.yml``).

A page writes ``{{ paper_best_gain }}`` or ``{{ preset_table }}`` (MyST substitutions) instead of typing a number, so
that the prose follows the data: the paper's Table 1 (``data/paper_table1.csv``) and the run presets
(:data:`cel_utils.config.PRESETS`, which change as the project tunes them).
"""
from __future__ import annotations

from pathlib import Path

from cel_utils.book.text import md_table
from cel_utils.config import PRESET_TASKS, RunConfig

PAPER_TABLE = Path("data") / "paper_table1.csv"
PRESETS_SHOWN = ("paper", "cpu", "quick", "smoke")  # auto resolves to paper or cpu; none is RunConfig's defaults


def _span(values: list[int]) -> str:
    """``'5'`` when all equal, else ``'2 to 5'``."""
    low, high = min(values), max(values)
    return str(low) if low == high else f"{low} to {high}"


def preset_configs(preset: str) -> list[RunConfig]:
    """The resolved configuration of each of the preset's default tasks."""
    return [RunConfig.from_dict({"task": task, "preset": preset}) for task in PRESET_TASKS[preset]]


def _size(value) -> str:
    return "Table 3" if value is None else f"{value:,}"


def random_sets_text(c: RunConfig) -> str:
    """How many random sets the null scores, and on how many holdout items when not all."""
    return str(c.n_random_sets) if c.null_items is None or not c.n_random_sets else f"{c.n_random_sets} on {c.null_items}"


def preset_table() -> str:
    """One row per (preset, default task): the sizes and the search and reliability settings it runs with."""
    rows = []
    for preset in PRESETS_SHOWN:
        for c in preset_configs(preset):
            stage1 = c.stage1 if c.stage1 == "exact" else f"{c.stage1} ({c.screen}, m = {c.screen_keep})"
            rows.append([f"`{preset}`", c.task, _size(c.n_discovery), _size(c.n_holdout), str(c.p), str(c.k), stage1,
                         random_sets_text(c), str(c.n_resamples)])
    return md_table(["preset", "task", "discovery", "holdout", "p", "k", "stage 1", "random sets", "resamples"], rows)


def preset_facts() -> dict[str, str]:
    facts = {"preset_table": preset_table()}
    for preset in PRESETS_SHOWN:
        configs = preset_configs(preset)
        facts[f"{preset}_random_sets"] = _span([c.n_random_sets for c in configs])
        facts[f"{preset}_resamples"] = _span([c.n_resamples for c in configs])
        facts[f"{preset}_p"] = _span([c.p for c in configs])
        facts[f"{preset}_k"] = _span([c.k for c in configs])
        sets = max(c.n_random_sets for c in configs)  # the null's smallest p-value, where it runs
        facts[f"{preset}_null_sets"], facts[f"{preset}_null_min_p"] = str(sets), f"{1 / (sets + 1):.2g}"
    return facts


def paper_facts(table: Path) -> dict[str, str]:
    """The paper's Table 1 as quoted in prose: its largest and smallest gains."""
    from cel_utils.book.paper_comparison import paper_rer
    from cel_utils.book.results_page import read_paper_table

    rows = read_paper_table(table)
    best = max(rows, key=lambda r: float(r["gain_points"]))
    worst = min(rows, key=lambda r: float(r["gain_points"]))
    full = float(best["full_accuracy"])
    return {
        "paper_cells": str(len(rows)),
        "paper_positive_cells": str(sum(float(r["gain_points"]) > 0 for r in rows)),
        "paper_best_model": best["model"], "paper_best_task": best["task"],
        "paper_best_full": f"{full:.2f}", "paper_best_ablated": f"{float(best['ablated_accuracy']):.2f}",
        "paper_best_gain": f"{float(best['gain_points']):.2f}", "paper_best_errors": f"{100 - full:.2f}",
        "paper_best_rer": f"{paper_rer(best)[0]:.2f}",
        "paper_smallest_gain": f"{float(worst['gain_points']):.2f}", "paper_smallest_model": worst["model"],
        "paper_smallest_task": worst["task"],
    }


# (help, harm) pairs the beyond page uses to show what the exact McNemar test can and cannot tell apart.
MCNEMAR_EXAMPLES = ((13, 0), (40, 27), (5, 0))


def statistics_facts() -> dict[str, str]:
    """p-values of the McNemar examples, the bootstrap's resample count, the heat map's clipping and the calibration's
    folds, as the code has them."""
    from scipy.stats import binomtest

    from cel_utils.stats.significance import N_BOOTSTRAP

    from cel_utils.book.interactive import CLIP_QUANTILE
    from cel_utils.stats.calibration import N_FOLDS

    facts = {"bootstrap_resamples": f"{N_BOOTSTRAP:,}", "heatmap_clip_pct": f"{100 * CLIP_QUANTILE:g}",
             "calibration_folds": str(N_FOLDS)}
    for helped, harmed in MCNEMAR_EXAMPLES:
        facts[f"mcnemar_{helped}_{harmed}"] = f"{binomtest(helped, helped + harmed, 0.5).pvalue:.2g}"
    return facts


def book_facts(root: Path) -> dict[str, str]:
    """Every substitution the pages may use."""
    return {**paper_facts(Path(root) / PAPER_TABLE), **preset_facts(), **statistics_facts()}


def _add_facts(app, config) -> None:
    # The pages' own substitutions (if _config.yml ever sets some) win over the computed ones.
    config.myst_substitutions = {**book_facts(Path(app.srcdir)), **(config.myst_substitutions or {})}


def setup(app) -> dict:
    app.connect("config-inited", _add_facts)
    return {"parallel_read_safe": True, "parallel_write_safe": True}
