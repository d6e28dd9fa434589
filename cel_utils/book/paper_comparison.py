"""The paper's Table 1 beside ours: one table (the paper's three models and any number of this project's models, by
task), a sentence per task on what each of our runs shows next to the paper's gains, and what the CPU hour left out
that ``--preset paper`` on a GPU would add.

Every word is chosen from the numbers, and none claims what they cannot carry: our models are 135M-270M 4-bit models,
the paper's 3B ones, with other sizes and another search, so no sentence says our runs "agree" or "disagree" with the
paper. A run whose full model is at its floor is said to be incomparable; otherwise a sentence says what the run shows
for *its* model, from the family-adjusted test and interval (:mod:`cel_utils.book.claims`).
"""
from __future__ import annotations

import pandas as pd

from cel_utils.book.text import md_table
from cel_utils.config import RunConfig
from cel_utils.presets import TASK_FAMILIES, task_family
from cel_utils.pipeline.schema import RunArtifact, TransferArtifact
from cel_utils.tasks.scoring import relative_error_reduction

PAPER_MODELS = ("SmolLM3-3B", "Qwen2.5-3B-Instruct", "Llama-3.2-3B-Instruct")  # Table 1's column order
PAPER_COMPUTED_MARK = "*"  # a relative error reduction computed here: the paper prints only the column's min and max


def paper_rer(row: dict) -> tuple[float, bool]:
    """A Table 1 cell's relative error reduction in percent, and whether it was computed here (gain / (100 - full),
    from the printed gain) because the paper does not print it."""
    if row.get("relative_error_reduction"):
        return float(row["relative_error_reduction"]), False
    return relative_error_reduction(float(row["full_accuracy"]), float(row["full_accuracy"]) + float(row["gain_points"])), True


def paper_cell(row: dict) -> str:
    """``full -> ablated (+gain), rer%``, the gain as printed (three printed gains differ from ablated - full by 0.01);
    a computed relative error reduction carries the (escaped) mark."""
    rer, computed = paper_rer(row)
    mark = "\\" + PAPER_COMPUTED_MARK if computed else ""
    return (f"{float(row['full_accuracy']):.2f} -> {float(row['ablated_accuracy']):.2f} "
            f"({float(row['gain_points']):+.2f}), {rer:.2f}%{mark}")


PAPER_NOTE = "paper:"


def _paper_models(paper_rows: list[dict]) -> list[str]:

    models = [m for m in PAPER_MODELS if any(r["model"] == m for r in paper_rows)]
    return models + [m for m in dict.fromkeys(r["model"] for r in paper_rows) if m not in models]


def _our_columns(table: pd.DataFrame) -> list[tuple[str, int]]:
    return list(dict.fromkeys(zip(table.model, table.seed)))


def _column_name(model: str, seed: int, columns: list[tuple[str, int]]) -> str:
    return model if sum(m == model for m, _ in columns) == 1 else f"{model} (seed {seed})"


def our_cell(run) -> str:
    """``task: gain; verdict`` for one of our runs (a summary row): the gain beside the paper's, the rest of the run's
    numbers in the verdict table above it."""
    text = f"{run.gain_points:+.1f}; **{run.word}**"
    if task_family(run.task) != run.task:
        text = f"{run.task}: {text}"
    return text


def _placement(low: float, high: float, gains: list[tuple[str, float]]) -> str:
    inside = [m for m, g in gains if low <= g <= high]
    if len(inside) == len(gains):
        return "its interval holds all of the paper's gains"
    if inside:
        return f"its interval holds the paper's gains of {', '.join(inside)} but not the others"
    if high < min(g for _, g in gains):
        return "its interval lies below every gain the paper reports"
    if low > max(g for _, g in gains):
        return "its interval lies above every gain the paper reports"
    return "its interval falls between the paper's gains"


def task_sentence(family: str, runs: list, paper: list[tuple[str, float]],
                  paper_full: list[float] | None = None) -> str:
    """What each of our runs shows for its own model, next to the paper's gains for one task."""
    if paper:
        low, high = min(g for _, g in paper), max(g for _, g in paper)
        lead = (f"**{family}:** the paper's {len(paper)} models gain {low:+.2f} to {high:+.2f} points" if len(paper) > 1
                else f"**{family}:** the paper's model gains {low:+.2f} points")
        if paper_full:
            lead += f" from full accuracies of {min(paper_full):.1f}% to {max(paper_full):.1f}%"
    else:
        lead = f"**{family}:** the paper reports no number for this task"
    if not runs:
        return lead + "; none of our models ran it."
    parts = []
    for run in runs:
        who = f"{run.model}{'' if task_family(run.task) == run.task else f' ({run.task})'}"
        if run.ci_low is None:
            parts.append(f"{who} has no paired test")
            continue
        adjusted = "family-adjusted " if run.family and run.family["m"] > 1 else ""
        if run.at_floor:
            parts.append(f"{who} cannot be set beside them (at its floor)")
            continue
        if run.kind == "gain":
            verdict = f"{who} gains significantly too"
        elif run.kind == "loss":
            verdict = f"for {who} the ablation significantly hurts"
        elif run.kind == "not significant" and paper and run.ci_high < min(g for _, g in paper):
            verdict = (f"{who} shows no significant gain, and its {adjusted}interval rules out, for this model on this "
                       "holdout, gains as large as the paper's")
        else:
            verdict = (f"{who}: "
                       + ("too few changed answers to detect any gain" if run.kind == "underpowered"
                          else "not significant")
                       + (f"; {_placement(run.ci_low, run.ci_high, paper)}" if paper and run.kind != "underpowered"
                          else ""))
        parts.append(verdict)
    return lead + "; " + "; ".join(parts) + "."


def side_by_side(table: pd.DataFrame, paper_rows: list[dict]) -> list[str]:
    """The section: one table (tasks x the paper's models and ours) and a sentence per task."""

    paper_models = _paper_models(paper_rows)
    columns = _our_columns(table) if not table.empty else []
    families = [f for f in TASK_FAMILIES if any(r["task"] == f for r in paper_rows)
                or (not table.empty and any(task_family(t) == f for t in table.task))]
    lookup = {(r["model"], r["task"]): r for r in paper_rows}
    body, sentences = [], []
    for family in families:
        row = [family] + [paper_cell(lookup[m, family]) if (m, family) in lookup else "" for m in paper_models]
        runs_here = []
        for model, seed in columns:
            runs = [r for r in table.itertuples() if r.model == model and r.seed == seed and task_family(r.task) == family]
            row.append("; ".join(our_cell(r) for r in runs))
            runs_here += runs
        body.append(row)
        paper = [(m, float(lookup[m, family]["gain_points"])) for m in paper_models if (m, family) in lookup]
        paper_full = [float(lookup[m, family]["full_accuracy"]) for m in paper_models if (m, family) in lookup]
        sentences.append(task_sentence(family, runs_here, paper, paper_full))
    header = (["task"] + [f"{PAPER_NOTE} {m.replace('SmolLM3-3B', 'SmolLM3-3B (non-thinking)')}" for m in paper_models]
              + [_column_name(m, s, columns) for m, s in columns])
    return ["## The paper's Table 1 beside ours", "",
            "The paper's three 3B models (its Table 1, as printed: full -> ablated (gain), relative error reduction) "
            "and the gain of each of our runs with its verdict. This is not a replication: our models are 135M and 270M "
            "parameters, quantized to 4 bits; our holdouts are hundreds of items, the paper's thousands; our stage 1 is "
            "screened. So nothing below says that a run agrees or disagrees with the paper: each sentence says what a "
            "run shows for its own model, and a run whose full model is at its floor measures something else than a "
            "gain of a model that can do the task, so it is not set beside the paper's at all.", "",
            md_table(header, body), "", *[f"* {s}" for s in sentences], ""]


def _stage1(config: dict) -> str:
    return ("exact (every head)" if config.get("stage1", "exact") == "exact"
            else f"screened ({config.get('screen')}, m = {config.get('screen_keep')})")


def hour_note(artifacts: list[RunArtifact], transfers: list[TransferArtifact]) -> list[str]:
    """What the CPU runs left out, per task, against what ``--preset paper`` (a GPU) runs: generated from the
    artifacts' configurations and the paper preset's."""
    from cel_utils.tasks.catalog import get_task

    rows = []
    for art in sorted(artifacts, key=lambda a: (a["model"]["name"], a["task"]["name"], a["config"]["seed"])):
        c = art["config"]
        if c.get("preset") == "paper":
            continue
        paper = RunConfig.from_dict({"task": c["task"], "preset": "paper"})
        d, h = get_task(c["task"]).paper_sizes
        transfer = next((t for t in transfers if t["model"]["name"] == art["model"]["name"] and t["seed"] == c["seed"]),
                        None)
        sub = [x for x in (transfer or {}).get("cells", []) if x["target"] == art["task"]["name"] and not x["diagonal"]]
        rows.append([f"{art['model']['name']}, {c['task']}",
                     f"{art['data'].get('n_discovery')} / {art['holdout']['n_items']}",
                     f"{paper.n_discovery or d:,} / {paper.n_holdout or h:,} (or as many as the data hold)",
                     f"{_stage1(c)}, p = {c['p']}, k = {c['k']}",
                     f"{_stage1({'stage1': paper.stage1})}, p = {paper.p}, k = {paper.k}",
                     f"{c.get('n_random_sets', '?')}"
                     + (f" on {c['null_items']} items" if c.get("null_items") and c.get("n_random_sets") else "")
                     + f", {c.get('n_resamples', '?')} resamples",
                     f"{paper.n_random_sets}, {paper.n_resamples} resamples",
                     f"{sub[0]['n_items']} of {sub[0]['n_holdout']}" if sub else "none"])
    if not rows:
        return []
    return ["```{admonition} What the CPU hour left out, and what --preset paper on a GPU adds", ":class: dropdown note",
            "On two CPU cores the main job runs the `cpu` preset: small discovery and holdout sets, a screened stage 1 "
            "(a cheap screen picks the *m* heads evaluated exactly), a small pool and budget, few or no random sets "
            "and stability resamples, and the transfer matrix on a subset of each holdout. `python -m cel_utils main --preset paper` "
            "on a GPU runs the paper's protocol instead: Table 3's sizes, exact stage 1 over every head, p = 10, "
            "k = 3, the full random-set null and stability resamples, and every transfer cell on the whole holdout; "
            "the smaller intervals would then show what the `cpu` runs cannot resolve. Per run:", "",
            md_table(["run", "discovery / holdout (this book)", "discovery / holdout (paper preset)",
                      "search (this book)", "search (paper preset)", "random sets, resamples (this book)",
                      "random sets, resamples (paper preset)", "transfer items (this book)"], rows), "```", ""]
