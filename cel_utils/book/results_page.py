"""The book's results page across runs, meant to be read in five minutes: every run in one figure, one compact verdict
table and what holds across the runs, the transfer matrices, the strategies, and the paper's own Table 1; written by
``python -m cel_utils aggregate`` from the JSON artifacts. The details of a run are on its run page
(:mod:`cel_utils.book.run_page`), each number once."""
from __future__ import annotations

import csv
import html
import os
from datetime import datetime, timezone
from pathlib import Path

import pandas as pd

from cel_utils.book.claims import first_looks, primary_family, run_key, second_look
from cel_utils.book.baselines import floor_rows
from cel_utils.book.run_page import run_stem, significance, verdict_of, verdict_word
from cel_utils.book.paper_comparison import PAPER_COMPUTED_MARK, PAPER_MODELS, hour_note, side_by_side
from cel_utils.book.overview_figure import overview_figure
from cel_utils.book.strategies_page import strategies_section
from cel_utils.book.transfer_page import raw_html, transfer_section
from cel_utils.book.text import ci_text, md_table, p_text, pct, transition_text
from cel_utils.presets import BOOK_SEED, TASK_FAMILIES, task_family, task_sort_key
from cel_utils.paths import atomic_write
from cel_utils.pipeline.artifacts import load_artifacts
from cel_utils.pipeline.schema import RunArtifact, TransferArtifact
from cel_utils.pipeline.transfer import load_transfers
from cel_utils.stats.power import ALPHA

PAPER_TITLE = "Can Capability Enhancement Be Localized to Specific Attention Heads?"
TASK_ORDER = TASK_FAMILIES  # the book's task order


def summarize(artifacts: list[RunArtifact], runs_dir: Path | None = None) -> pd.DataFrame:
    """One row per artifact with every column the results page shows; every run's test is adjusted among all of them
    (:func:`cel_utils.book.claims.primary_family`)."""
    family = primary_family(artifacts)
    looks = first_looks()
    rows = []
    for art in artifacts:
        h, stem = art["holdout"], run_stem(art)
        page = runs_dir is not None and (Path(runs_dir) / f"{stem}.ipynb").exists()
        adjusted = family.get(run_key(art))
        rows.append({
            "task": art["task"]["name"], "model": art["model"]["name"], "seed": art["config"]["seed"],
            "metric": art["task"]["metric"], "n_discovery": art["data"]["n_discovery"], "n_holdout": h["n_items"],
            "p": art["config"]["p"], "k": art["config"]["k"],
            "full": h["full_accuracy"], "ablated": h["ablated_accuracy"],
            "gain_points": 100 * (h["ablated_accuracy"] - h["full_accuracy"]),
            "holdout": transition_text(h["full_accuracy"], h["ablated_accuracy"]),
            "heads": h["heads_label"], "stem": stem, "page": bool(page),
            "family": adjusted.to_json() if adjusted else None, "second_look": second_look(art, looks),
            **_reliability_columns(art, adjusted.to_json() if adjusted else None),
        })
    columns = ["task", "model", "seed", "metric", "n_discovery", "n_holdout", "p", "k", "full", "ablated", "gain_points",
               "holdout", "heads", "stem", "page", "family", "second_look", "ci_low", "ci_high", "ci", "p_value",
               "verdict", "kind", "word", "at_floor", "floor_text", "floor_what", "floor", "control_gain"]
    table = pd.DataFrame(rows, columns=columns)
    if table.empty:
        return table
    order = sorted(range(len(table)), key=lambda i: (task_sort_key(table.task[i]), table.model[i], table.seed[i]))
    return table.iloc[order].reset_index(drop=True)


def _reliability_columns(art: RunArtifact, family: dict | None = None) -> dict:
    """The verdict, floor and control cells of a run's row. ``ci_low``/``ci_high`` are the interval quoted against other
    numbers: the family-adjusted one when there is a family of more than one."""
    sig = significance(art)
    verdict = verdict_of(art, family)
    floors = floor_rows(art)
    floor = max(floors, key=lambda r: r[1]) if floors else None
    wide = family is not None and family["m"] > 1
    control = art["control"]
    return {
        "verdict": verdict["text"] if verdict else "n/a", "kind": verdict["kind"] if verdict else "n/a",
        "word": verdict_word(verdict) if verdict else "n/a", "at_floor": bool(verdict and verdict.get("at_floor")),
        "floor": floor[1] if floor else None,
        "floor_text": f"{pct(floor[1])} ({floor[0]})" if floor else "n/a", "floor_what": floor[0] if floor else None,
        "ci": ci_text(sig), "p_value": sig["p_value"] if sig else float("nan"),
        "ci_low": (family["ci_low"] if wide else sig["ci_low"]) if sig else None,
        "ci_high": (family["ci_high"] if wide else sig["ci_high"]) if sig else None,
        "control_gain": control["vs_full"]["gain_points"] if control else None,
    }


def paper_gains_against(task: str, ci_low: float | None, ci_high: float | None, paper_rows: list[dict]) -> str:
    """The paper's Table 1 gains for ``task``'s family (three models), each placed against this run's interval (the
    family-adjusted one, as summarize gives it)."""
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


SECOND_LOOK_MARK = "†"


def _run_label(row, link_prefix: str) -> str:
    label = f"{row.model}, {row.task}" + (f" (seed {row.seed})" if row.seed != BOOK_SEED else "")
    return _link(label, row, link_prefix) + (f" {SECOND_LOOK_MARK}" if row.second_look else "")


def family_sentence(table: pd.DataFrame) -> str:
    """How many of the primary tests are significant alone and after Holm's adjustment, and how many would be by
    chance alone."""
    m = int(table.family.notna().sum())
    if m == 0:
        return ""
    raw = int((table.p_value <= ALPHA).sum())
    adjusted = int(sum(f["p_adjusted"] <= ALPHA for f in table.family if f))
    floor = int(table.at_floor.sum())
    return (f"These {m} runs are one family of tests. Alone, {raw} of them {'is' if raw == 1 else 'are'} significant at "
            f"p ≤ {ALPHA:g}; if no ablation changed anything, {ALPHA * m:.1f} would be on average by chance. After "
            f"Holm's adjustment for the {m} tests, {adjusted} {'is' if adjusted == 1 else 'are'} "
            f"({{ref}}`the method <many-tests-one-family>` says why). In {floor} of the {m} runs the full model is not "
            "above its floor, and the verdict says so first.")


def results_markdown(artifacts: list[RunArtifact], paper_rows: list[dict], runs_dir: Path | None = None,
                     link_prefix: str = "runs/", source_note: str = "", strategies: list[dict] | None = None,
                     transfers: list[TransferArtifact] | None = None) -> str:
    """The results page (MyST Markdown), read in five minutes: every run in one figure, one compact verdict table with
    what holds across the runs in a few sentences, the transfer matrices, and the paper's reference. Each run's long
    verdict, its checks (power, margin, calibration, random sets, stability), its control and its answer shares are on
    its run page; the per-cell transfer numbers and the CPU hour's sizes are in dropdowns."""
    table = summarize(artifacts, runs_dir)
    out = ["# Results", "",
           "Each run searches a discovery set for at most *k* heads whose zero-ablation helps most (see "
           "[the method](method.md)), freezes them, and scores them once on a disjoint holdout. **full -> ablated "
           "(gain)** is holdout accuracy in percent of the full model and of the ablated one, and the difference in "
           "points. A run's page has its verdict in words, its checks and its control.", ""]
    if table.empty:
        out += ["```{note}", "No runs yet. Run `python -m cel_utils grid` (or `python -m cel_utils main`), then rebuild the book.",
                "```", ""]
    else:
        verdicts = [[_run_label(r, link_prefix), r.holdout, pct(r.floor) if r.floor is not None else "n/a",
                     f"[{r.ci_low:+.1f}, {r.ci_high:+.1f}]" if r.ci_low is not None else "n/a", p_text(r.p_value),
                     p_text(r.family["p_adjusted"]) if r.family else "n/a", f"**{r.word}**"]
                    for r in table.itertuples()]
        adjusted_level = f"{100 * (1 - ALPHA / max(1, len(table))):.2f}%"
        by_stem = {run_stem(a): a for a in artifacts}
        figure = overview_figure(table, by_stem, paper_rows, link_prefix.replace(".ipynb", ""))
        out += ["## Every run at once", "", *raw_html(figure.to_html()),
                "Each row is one run: the dot is its holdout gain with the interval adjusted for all the runs (thick) "
                "and the interval of the run alone (thin); the open diamond is the same set's gain on the discovery "
                "items it was chosen on (the gap is the winner's curse); the grey band is the range of random head sets "
                "of the same size on the same holdout; the square is the same heads mean-ablated, the cross the "
                "calibration baseline (multiple choice). The paper's gains are on an axis of their own: other models "
                "and sizes. Hover for the numbers, click a run for its page.", ""]
        out += ["## Verdicts", "",
                f"The floor is the best trivial answer on the same items ({floors_legend(table)}); the interval is the gain's, adjusted for the {len(table)} runs ({adjusted_level} each, 95% together); p is "
                "the exact McNemar p alone, Holm p the same after Holm's adjustment."
                + (f" {SECOND_LOOK_MARK} marks a second look at a holdout pool (below)." if table.second_look.any()
                   else ""), "",
                md_table(["run", "full -> ablated (gain)", "floor", "gain, adjusted CI", "p", "Holm p", "verdict"],
                         verdicts), "",
                family_sentence(table), "", *control_sentences(table, artifacts), "",
                *[f"{s}\n" for s in (bias_sentence(table, artifacts), checks_sentence(artifacts)) if s]]
        out += ["", *_forking_paths_note(set(int(seed) for seed in table.seed), table)]
    out += transfer_section(transfers or [])
    out += strategies_section(strategies or [], task_sort_key)
    out += _paper_section(paper_rows, table)
    out += hour_note(artifacts, transfers or [])
    if source_note:
        out += ["", f"<small>{html.escape(source_note)}</small>", ""]
    return "\n".join(out).rstrip() + "\n"


def floors_legend(table: pd.DataFrame) -> str:
    """What the floor is on each task shown, once per task and answer (``boolq: always answering "yes"``)."""
    seen = dict.fromkeys((r.task, r.floor_what) for r in table.itertuples() if r.floor_what)
    return "; ".join(f"{task}: {what}" for task, what in seen) or "none stored"


BIAS_SHARE = 0.75  # a run's changed answers read as a response-bias shift when at least this share go one way
BIAS_MIN_CHANGED = 10  # ... and at least this many answers changed (fewer say nothing about a direction)


def bias_sentence(table: pd.DataFrame, artifacts: list[RunArtifact]) -> str:
    """Multiple choice: the runs whose changed answers mostly go one way (a shift of response bias, not a skill),
    from the stored predictions; the run pages give every run's answer shares."""
    from cel_utils.tasks.floors import changed_answers

    by_stem, shifts, looked = {run_stem(a): a for a in artifacts}, [], 0
    for r in table.itertuples():
        art = by_stem[r.stem]
        labels, h = (art["floors"] or {}).get("labels"), art["holdout"]
        if not labels or not h["full_predictions"]:
            continue
        looked += 1
        moves = changed_answers(h["full_predictions"], h["ablated_predictions"] or [])
        moved = sum(moves.values())
        if moved >= BIAS_MIN_CHANGED:
            (a, b), n = next(iter(moves.items()))
            if n >= BIAS_SHARE * moved:
                shifts.append(f"{r.model} on {r.task}, where {n} of the {moved} changed answers went "
                              f"{labels[a]!r} -> {labels[b]!r}")
    if not looked:
        return ""
    if not shifts:
        return (f"In none of the {looked} multiple-choice runs do {100 * BIAS_SHARE:.0f}% or more of the changed answers "
                "go one way; each run page shows its answer shares.")
    return (f"A gain can be a shift of response bias rather than a skill: {'; '.join(shifts)} ({100 * BIAS_SHARE:.0f}% "
            f"or more one way, of at least {BIAS_MIN_CHANGED} changed). Each run page shows its answer shares.")


def checks_sentence(artifacts: list[RunArtifact]) -> str:
    """The winner's curse and the random-set null across the runs, from the artifacts: how often the discovery gain
    exceeds the holdout gain, and what the random sets can show at their number."""
    curses = [c for c in ((a["reliability"] or {}).get("winners_curse") for a in artifacts) if c]
    nulls = [n for n in ((a["reliability"] or {}).get("null") for a in artifacts) if n]
    parts = []
    if curses:
        shrunk = [c for c in curses if c["discovery_gain_points"] > c["holdout_gain_points"]]
        gaps = [c["discovery_gain_points"] - c["holdout_gain_points"] for c in shrunk]
        parts.append(f"The winner's curse: the frozen set gained more on the discovery items it was chosen on than on the "
                     f"holdout in {len(shrunk)} of {len(curses)} runs"
                     + (f", by {min(gaps):+.1f} to {max(gaps):+.1f} points" if gaps else "") + ".")
    if nulls:
        below = sum(n["p_value"] > ALPHA for n in nulls)
        smallest = min(1 / (n["n_sets"] + 1) for n in nulls)
        parts.append(f"Against random head sets of the same size the frozen set is not beyond chance in {below} of "
                     f"{len(nulls)} runs with random sets"
                     + (f"; with as few as {min(n['n_sets'] for n in nulls)} sets the smallest p a run can reach is "
                        f"{smallest:.2f}, so this check cannot reject at {ALPHA:g} there" if smallest > ALPHA else "")
                     + ".")
    return " ".join(parts)


def control_sentences(table: pd.DataFrame, artifacts: list[RunArtifact]) -> list[str]:
    """What the control shows across the runs, from the numbers: how far mean-ablation moves the full model against
    zero-ablation, and in how many runs the two differ significantly (alone, and after Holm over the runs)."""
    from cel_utils.stats.multiplicity import holm

    by_stem = {run_stem(a): a for a in artifacts}
    rows = [r for r in table.itertuples() if r.control_gain is not None]
    if not rows:
        return ["No run of this book stores a control (artifacts written before it existed)."]
    versus = [by_stem[r.stem]["control"]["vs_search"] for r in rows]
    adjusted = holm([v["p_value"] for v in versus])
    differ = [f"{r.model} on {r.task} ({v['gain_points']:+.1f} points, p = {v['p_value']:.2g}, Holm p = {q:.2g})"
              for r, v, q in zip(rows, versus, adjusted) if v["p_value"] <= ALPHA]
    same_sign = sum((r.control_gain > 0) == (r.gain_points > 0) for r in rows if r.gain_points != 0 and r.control_gain)
    text = (f"Across the {len(rows)} runs the mean-ablated set moves the full model's accuracy by "
            f"{min(r.control_gain for r in rows):+.1f} to {max(r.control_gain for r in rows):+.1f} points, against "
            f"{min(r.gain_points for r in rows):+.1f} to {max(r.gain_points for r in rows):+.1f} for zero-ablation; "
            f"the two move it the same way in {same_sign} of the {sum(r.gain_points != 0 and r.control_gain != 0 for r in rows)} "
            "runs where both move it.")
    if differ:
        text += (f" The two ablations differ significantly alone in {len(differ)}: " + "; ".join(differ) + ". "
                 + ("After Holm's adjustment over the runs none does." if min(adjusted) > ALPHA else
                    f"After Holm's adjustment {sum(q <= ALPHA for q in adjusted)} still do{'es' if sum(q <= ALPHA for q in adjusted) == 1 else ''}."))
    else:
        text += " In no run do the two ablations differ significantly on the same items."
    return [text]


def _forking_paths_note(seeds: set[int], table: pd.DataFrame | None = None) -> list[str]:
    """How the holdouts shown here have been looked at: the disclosure a reader needs to weigh the verdicts. Runs of
    :data:`BOOK_SEED` (the main job's) are single looks except those in data/first_looks.json; runs of seed 0 are
    not."""
    text = ["Each holdout is meant to be scored once, after the search is frozen. The policy for every preset decision "
            "(screen, *m*, sizes) is that it comes from discovery-only benchmarks (`benchmarks/bench_screening.py`: a "
            "screen is kept when it reproduces exhaustive stage 1 on the discovery items) and from timings, never from "
            "a holdout score."]
    if BOOK_SEED in seeds:
        looks = first_looks()
        shown = [look for look in looks if table is None or any(
            (r.model, r.task, int(r.seed)) == (look["model"], look["task"], look["seed"]) for r in table.itertuples())]
        text.append(f"The main job draws its items with seed {BOOK_SEED}, which no screen or *m* decision has seen: "
                    "those were made on seed 0's items.")
        if shown:
            firsts = "; ".join(f"{look['model']} on {look['task']}: {look['n_holdout']} holdout items, "
                               f"{look['gain_points']:+.1f} points (95% CI [{look['ci_low']:+.1f}, {look['ci_high']:+.1f}]"
                               f", `{look['heads']}`{', ' + look['note'] if look['note'] else ''}), then {look['why']}"
                               for look in shown)
            text.append(f"{len(shown)} sizing decision(s) came after seed-{BOOK_SEED} holdouts had been scored, each "
                        f"chosen from timings or a discovery-only benchmark, never from the holdout score: {firsts}. "
                        f"Those {len(shown)} verdicts (marked {SECOND_LOOK_MARK}) are a second look at the same pool; "
                        "the other runs kept their items and frozen sets. The first looks are recorded in "
                        "`data/first_looks.json`.")
    if seeds - {BOOK_SEED}:
        text.append("Seed 0 is not that clean: the `cpu` preset's BoolQ screen was switched from `boundary` (m = 8) to "
                    "`attribution` (m = 20) after an earlier main job had scored the boundary screen's frozen set on "
                    "the seed-0 holdout (+6.8 points), and the other tasks' settings were revised while their seed-0 "
                    "holdouts were being reported. No choice used a holdout number as its criterion, but no seed-0 "
                    "holdout is a single look, so a seed-0 p-value is that of one look among several.")
    return ["```{admonition} How often these holdouts were looked at", ":class: dropdown note", " ".join(text), "```", ""]


def _paper_section(paper_rows: list[dict], table: pd.DataFrame) -> list[str]:
    """The paper's Table 1 beside ours (cel_utils.book.paper_comparison), with how the paper's cells are printed."""
    if not paper_rows:
        return []
    section = side_by_side(table, paper_rows)
    return [*section,
            f"The paper's cells are Table 1 of *{PAPER_TITLE}* as printed (SmolLM3-3B in its non-thinking mode); in three the printed gain differs "
            "from ablated - full by 0.01, a rounding of item counts. The paper prints the relative error reduction only "
            f"for a column's minimum and maximum; cells marked {PAPER_COMPUTED_MARK} are computed here as gain / (100 - "
            "full), the formula that reproduces both printed values. The paper does not report which heads it froze.",
            ""]


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
    atomic_write(out_path.parent / INTRO_FIGURE, intro_figure_html(artifacts, paper_rows, runs_dir, link_prefix))
    return out_path


INTRO_FIGURE = "all_runs.html"  # beside the results page; book/intro.md includes it (a raw block's :file:)


def intro_figure_html(artifacts: list[RunArtifact], paper_rows: list[dict], runs_dir: Path | None = None,
                      link_prefix: str = "runs/") -> str:
    """The small copy of the results page's figure of every run, for the intro (no legend: the results page explains
    each mark); a line saying there are no runs yet where there are none."""
    table = summarize(artifacts, runs_dir)
    if table.empty:
        return "<p><em>No runs yet: the figure of every run appears here once the main job has run.</em></p>\n"
    by_stem = {run_stem(a): a for a in artifacts}
    return overview_figure(table, by_stem, paper_rows, link_prefix.replace(".ipynb", ""), small=True).to_html() + "\n"
