"""The book's results page across runs: our Table 1, every run in detail, is each gain real, the strategies, and the
paper's own Table 1; written by ``python -m cel_utils aggregate`` from the JSON artifacts."""
from __future__ import annotations

import csv
import html
import os
from datetime import datetime, timezone
from pathlib import Path

import pandas as pd

from cel_utils.book.run_page import power_of, run_stem, significance, tied_at_top, verdict_of
from cel_utils.book.paper_comparison import PAPER_COMPUTED_MARK, PAPER_MODELS, hour_note, paper_cell, paper_rer, side_by_side
from cel_utils.book.strategies_page import strategies_section
from cel_utils.book.transfer_page import transfer_section
from cel_utils.book.text import ci_text, md_table, ordinal, p_is, provenance_text, rer_text, transition_text
from cel_utils.config import BOOK_SEED, TASK_FAMILIES, task_family, task_sort_key
from cel_utils.paths import atomic_write
from cel_utils.pipeline.artifacts import load_artifacts
from cel_utils.pipeline.transfer import load_transfers
from cel_utils.tasks.scoring import relative_error_reduction

PAPER_TITLE = "Can Capability Enhancement Be Localized to Specific Attention Heads?"
TASK_ORDER = TASK_FAMILIES  # the book's task order


def summarize(artifacts: list[dict], runs_dir: Path | None = None) -> pd.DataFrame:
    """One row per artifact with every column the results page shows."""
    rows = []
    for art in artifacts:
        h, stem = art["holdout"], run_stem(art)
        page = runs_dir is not None and (Path(runs_dir) / f"{stem}.ipynb").exists()
        rows.append({
            "task": art["task"]["name"], "model": art["model"]["name"], "seed": art["config"]["seed"],
            "metric": art["task"]["metric"], "n_discovery": art["data"].get("n_discovery"), "n_holdout": h["n_items"],
            "p": art["config"]["p"], "k": art["config"]["k"],
            "full": h["full_accuracy"], "ablated": h["ablated_accuracy"],
            "gain_points": 100 * (h["ablated_accuracy"] - h["full_accuracy"]),
            "holdout": transition_text(h["full_accuracy"], h["ablated_accuracy"]),
            "rel_error_reduction": rer_text(relative_error_reduction(100 * h["full_accuracy"], 100 * h["ablated_accuracy"])),
            "heads": h["heads_label"], "data": provenance_text(art["data"]),
            "engine": art["config"].get("engine", "?"), "stem": stem, "page": bool(page),
            **_reliability_columns(art),
        })
    columns = ["task", "model", "seed", "metric", "n_discovery", "n_holdout", "p", "k", "full", "ablated", "gain_points",
               "holdout", "rel_error_reduction", "heads", "data", "engine", "stem", "page", "ci_low", "ci_high", "ci", "p_value",
               "null_text", "curse_text", "stability_text", "verdict", "stage1", "power_text", "calibration_text"]
    table = pd.DataFrame(rows, columns=columns)
    if table.empty:
        return table
    order = sorted(range(len(table)), key=lambda i: (task_sort_key(table.task[i]), table.model[i], table.seed[i]))
    return table.iloc[order].reset_index(drop=True)


def _reliability_columns(art: dict) -> dict:
    """Text cells for the results page from a run's significance, null, winner's curse and stability."""
    sig, rel = significance(art), art.get("reliability") or {}
    null, curse, stab = rel.get("null"), rel.get("winners_curse"), rel.get("stability")
    tied, power, verdict, cal = tied_at_top(art)[0], power_of(art), verdict_of(art), rel.get("calibration")
    method = art.get("stage1_method") or {"method": "exact"}
    return {
        "verdict": verdict["text"] if verdict else "n/a",
        "stage1": "exact" if method["method"] == "exact" else f"{method['screen']}, m = {method['keep']}",
        "power_text": ("n/a" if power is None else "none detectable" if power["min_detectable_gain_points"] is None
                       else f"{power['min_detectable_gain_points']:.1f} points"),
        "calibration_text": calibration_text(cal),
        "ci": ci_text(sig), "p_value": sig["p_value"] if sig else float("nan"),
        "ci_low": sig["ci_low"] if sig else None, "ci_high": sig["ci_high"] if sig else None,
        "null_text": (f"{ordinal(null['percentile'])} pct of {null['n_sets']}"
                      + (f" on {null['n_items']} items" if "n_items" in null else "") + f" ({p_is(null['p_value'])}"
                      + (f", the smallest {null['n_sets']} sets allow" if null["p_value"] <= 1 / (null["n_sets"] + 1) + 1e-12
                         else "") + ")"
                      if null else "not run"),
        "curse_text": (f"{curse['discovery_gain_points']:+.1f} -> {curse['holdout_gain_points']:+.1f}" if curse else "n/a")
        + (f", {tied} sets tied" if tied > 1 else ""),
        "stability_text": (f"{100 * stab['frozen_set_frequency']:.0f}% of {stab['n_resamples']}, Jaccard "
                           f"{stab['mean_jaccard']:.2f}, holdout gains {stab['holdout_gain_quantiles']['min']:+.1f} .. "
                           f"{stab['holdout_gain_quantiles']['max']:+.1f}" if stab else "not run"),
    }


def calibration_text(cal: dict | None) -> str:
    """The calibration baseline's cell: its holdout gain and the ablation against it, or why there is nothing to beat."""
    if not cal:
        return "n/a"
    if cal.get("n_groups") == 1:
        return "none: no offsets helped on held-out discovery folds"
    if cal["holdout_gain_points"] <= 0:
        return f"{cal['holdout_gain_points']:+.1f}: fails on the holdout (the full model is the baseline)"
    versus = cal["ablation_vs_calibration"]
    return f"{cal['holdout_gain_points']:+.1f} (ablation - calibration {versus['gain_points']:+.1f}, {p_is(versus['p_value'])})"


def paper_gains_against(task: str, ci_low: float | None, ci_high: float | None, paper_rows: list[dict]) -> str:
    """The paper's Table 1 gains for ``task``'s family (three models), each placed against this run's 95% interval."""
    family = task_family(task)
    rows = [r for r in paper_rows if r["task"] == family]
    if not rows or ci_low is None or ci_high is None:
        return "n/a"

    def where(gain: float) -> str:
        return "inside" if ci_low <= gain <= ci_high else ("above" if gain > ci_high else "below")

    order = {m: i for i, m in enumerate(PAPER_MODELS)}
    rows = sorted(rows, key=lambda r: order.get(r["model"], len(order)))
    cells = [f"{r['model']} {float(r['gain_points']):+.2f} ({where(float(r['gain_points']))})" for r in rows]
    note = " (the paper pools ten arithmetic configs)" if family == "arithmetic" and task != "arithmetic" else ""
    return "; ".join(cells) + note


def read_paper_table(path: Path) -> list[dict]:
    """data/paper_table1.csv: the paper's Table 1 as printed, one row per (model, task)."""
    with open(path, newline="", encoding="utf-8") as handle:
        return list(csv.DictReader(handle))


def _link(text: str, row, link_prefix: str) -> str:
    return f"[{text}]({link_prefix}{row.stem}.ipynb)" if row.page else text


def results_markdown(artifacts: list[dict], paper_rows: list[dict], runs_dir: Path | None = None,
                     link_prefix: str = "runs/", source_note: str = "", strategies: list[dict] | None = None,
                     transfers: list[dict] | None = None) -> str:
    """The results page (MyST Markdown): our Table 1, every run in detail, and the paper's reference."""
    table = summarize(artifacts, runs_dir)
    out = ["# Results", "",
           "Each run searches a discovery set for at most *k* heads whose zero-ablation helps most (see "
           "[the method](method.md)), freezes them, and scores them once on a disjoint holdout. A cell reads "
           "**full -> ablated (gain)**: holdout accuracy in percent of the full model, of the model with the frozen "
           "heads ablated, and the difference in points. The relative error reduction is gain / (100 - full). "
           "Click a cell for the run's page: the stage-1 heat map, the pool, the best subsets and the flipped examples.",
           ""]
    if table.empty:
        out += ["```{note}", "No runs yet. Run `python -m cel_utils grid` (or `python -m cel_utils main`), then rebuild the book.",
                "```", ""]
    else:
        verdicts = [[r.task, f"{r.model}, seed {r.seed}", f"{r.n_discovery} / {r.n_holdout}", r.stage1,
                     _link(r.verdict, r, link_prefix), paper_gains_against(r.task, r.ci_low, r.ci_high, paper_rows)]
                    for r in table.itertuples()]
        out += ["## Verdicts", "",
                "What each run shows, from its paired holdout test (exact McNemar, 95% bootstrap interval). A result "
                "that is not significant rules out only the effects outside its interval; the smallest change the test "
                "detects with 80% power describes the design, not the effect. For multiple choice the ablation is "
                "weighed against the better of the full model and a calibration baseline (the full model with answer "
                "offsets fitted on the discovery items, the cheapest fix of a response bias; see "
                "[beyond the paper](beyond.md)). The last column places the paper's own gains for the task (its Table 1, "
                "three 3B models) against the run's 95% interval.", "",
                md_table(["task", "model", "discovery / holdout items", "stage 1", "verdict",
                          "the paper's gains (Table 1) against this run's 95% CI"], verdicts), ""]
        out += _forking_paths_note(set(int(seed) for seed in table.seed))
        models = list(dict.fromkeys(table.model))
        tasks = sorted(dict.fromkeys(table.task), key=task_sort_key)
        body = []
        for task in tasks:
            cells = []
            for model in models:
                runs = table[(table.task == task) & (table.model == model)]
                texts = [_link(r.holdout, r, link_prefix) + f", {r.rel_error_reduction}"
                         + (f", {r.ci}" if r.ci else "") + (f" (seed {r.seed})" if len(runs) > 1 else "")
                         for r in runs.itertuples()]
                cells.append("; ".join(texts) if texts else "")
            metric = table[table.task == task].metric.iloc[0]
            body.append([f"{task} ({metric})"] + cells)
        out += ["## Table 1: holdout accuracy, full -> ablated (gain), relative error reduction", "",
                "Where a run stores its per-item holdout outcomes, the cell also gives the gain's 95% paired bootstrap "
                "interval and the exact McNemar p-value (see [beyond the paper](beyond.md)).", "",
                md_table(["task (metric)"] + models, body), ""]
        detail = [[r.task, f"{r.model}, seed {r.seed}", _link(r.holdout, r, link_prefix), r.rel_error_reduction,
                   f"`{r.heads}`", f"{r.n_discovery} / {r.n_holdout}, p={r.p}, k={r.k}", r.data]
                  for r in table.itertuples()]
        out += ["## Every run", "",
                "The frozen heads, the sizes (discovery / holdout items), the search parameters (pool *p*, budget *k*) "
                "and where the items came from (hub, local mirror, or generated, with any fallback).",
                "", md_table(["task", "model", "full -> ablated (gain)", "rel. error red.", "heads",
                               "items, search", "data"], detail), ""]
        checks = [[r.task, f"{r.model}, seed {r.seed}", r.ci or "n/a", r.power_text, r.calibration_text, r.null_text,
                   r.curse_text, r.stability_text] for r in table.itertuples()]
        out += ["## Is the gain real?", "",
                "Per run: the holdout gain's paired 95% interval and exact McNemar p-value; the smallest change that test "
                "detects with 80% power; the gain of the calibration baseline (multiple choice) and the paired test of "
                "the ablation against it; the frozen set's place among "
                "random head sets of the same size on the same holdout (percentile, empirical one-sided p); the discovery "
                "gain against the holdout gain (the winner's curse), with the number of evaluated sets that tie with the "
                "frozen one on discovery when there is more than one (the ranking's last keys, fewer heads and lower head "
                "ids, then chose among them); and how often the whole selection picks the same set "
                "again on resampled discovery sets, how much the selections overlap (mean pairwise Jaccard) and the range "
                "of their holdout gains. [Beyond the paper](beyond.md) defines each.",
                "", md_table(["task", "model", "gain: 95% CI, McNemar p",
                               "smallest detectable change (80% power)", "calibration baseline's gain",
                               "vs random sets", "discovery -> holdout gain",
                               "frozen set re-selected, overlap, holdout gains"], checks), ""]
    out += transfer_section(transfers or [])
    out += strategies_section(strategies or [], task_sort_key)
    out += _paper_section(paper_rows, table)
    out += hour_note(artifacts, transfers or [])
    if source_note:
        out += ["", f"<small>{html.escape(source_note)}</small>", ""]
    return "\n".join(out).rstrip() + "\n"


def _forking_paths_note(seeds: set[int]) -> list[str]:
    """How the holdouts shown here have been looked at: the disclosure a reader needs to weigh the verdicts. Runs of
    :data:`BOOK_SEED` (the main job's) are single looks; runs of seed 0 are not."""
    text = ["Each holdout is meant to be scored once, after the search is frozen. The policy for every preset decision "
            "(screen, *m*, sizes) is that it comes from discovery-only benchmarks (`benchmarks/bench_screening.py`: a "
            "screen is kept when it reproduces exhaustive stage 1 on the discovery items) and from timings, never from "
            "a holdout score."]
    if BOOK_SEED in seeds:
        text.append(f"The main job draws its items with seed {BOOK_SEED}, which no screen or *m* decision has seen: "
                    f"those were made on seed 0's items. One sizing decision came after seed-{BOOK_SEED} holdouts had "
                    "been scored: the first seed-1 main job (the default model alone, BoolQ and HellaSwag holdouts of "
                    "500 items) found BoolQ +12.0 points (95% CI [+6.0, +18.0], L1.H3+L2.H4, below its calibration "
                    "baseline) and HellaSwag -1.8 (95% CI [-3.4, -0.4], L9.H6); to fit the second model into the hour, "
                    "chosen from timings alone, those two holdouts were then cut to 300 items, which also changed their "
                    "discovery items (both are drawn from one pool, holdout first), so the search froze other sets. "
                    "Gemma's BoolQ run, first scored on 200 holdout items (-2.0 points, 95% CI [-4.5, +0.0], L12.H1), "
                    "likewise moved to 500 items and to the screen its own benchmark supports. Those three verdicts "
                    "are a second look at the same pool; the other runs kept their items and frozen sets.")
    if seeds - {BOOK_SEED}:
        text.append("Seed 0 is not that clean: the `cpu` preset's BoolQ screen was switched from `boundary` (m = 8) to "
                    "`attribution` (m = 20) after an earlier main job had scored the boundary screen's frozen set on "
                    "the seed-0 holdout (+6.8 points), and the other tasks' settings were revised while their seed-0 "
                    "holdouts were being reported. No choice used a holdout number as its criterion, but no seed-0 "
                    "holdout is a single look, so a seed-0 p-value is that of one look among several.")
    return ["```{admonition} How often these holdouts were looked at", ":class: note", " ".join(text), "```", ""]


def _paper_section(paper_rows: list[dict], table: pd.DataFrame) -> list[str]:
    """The paper's Table 1 beside ours (cel_utils.book.paper_comparison), with how the paper's cells are printed."""
    if not paper_rows:
        return []
    section = side_by_side(table, paper_rows)
    return [section[0], "",
            f"All twelve cells of Table 1 of *{PAPER_TITLE}*, as printed: holdout accuracy in percent of the full model "
            "and of the model with the frozen heads ablated, and the gain in points (SmolLM3-3B in its non-thinking "
            "mode). The gain is the printed one: in three cells it differs from ablated - full by 0.01, a rounding of "
            "item counts. The paper prints the relative error reduction only for the column's minimum and maximum; "
            f"the cells marked {PAPER_COMPUTED_MARK} are computed here as gain / (100 - full), the formula that "
            "reproduces both printed values. The paper does not report which heads it froze. Our runs use other "
            "(smaller) models and, on a CPU, far fewer items, so they are not expected to match.", "", *section[2:]]


def write_results_page(results_dir: Path, out_path: Path, runs_dir: Path | None = None,
                       paper_table: Path | None = None) -> Path:
    """Aggregate every artifact in ``results_dir`` into the results page at ``out_path``."""
    results_dir, out_path = Path(results_dir), Path(out_path)
    artifacts = load_artifacts(results_dir) if results_dir.is_dir() else []
    strategies = load_artifacts(results_dir / "strategies") if (results_dir / "strategies").is_dir() else []
    paper_rows = read_paper_table(paper_table) if paper_table is not None and Path(paper_table).exists() else []
    transfers = load_transfers(results_dir) if results_dir.is_dir() else []
    link_prefix = ""
    if runs_dir is not None:
        link_prefix = Path(os.path.relpath(Path(runs_dir).resolve(), out_path.parent.resolve())).as_posix() + "/"
    stamp = datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    note = (f"Generated by python -m cel_utils aggregate on {stamp} from {len(artifacts)} artifact(s) in "
            f"{results_dir.name}/.")
    atomic_write(out_path, results_markdown(artifacts, paper_rows, runs_dir, link_prefix, note, strategies, transfers))
    return out_path
