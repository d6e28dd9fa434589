"""Tables for one run (the run notebook) and across runs (the book's results page), from JSON artifacts.

Everything here reads artifacts (or a finished :class:`cel_utils.protocol.CelRun`); nothing re-scores a
model, except :func:`greedy_answers`, which generates a short answer for the few arithmetic items a run page
displays (arithmetic is scored teacher-forced, so the artifact stores no generated text for it).

Numbers are printed in percent with one decimal; a holdout cell reads ``full -> ablated (gain)``, e.g.
``50.0 -> 75.0 (+25.0)``, and the relative error reduction is gain / (100 - full), e.g. ``50.0%``.
"""
from __future__ import annotations

import csv
import html
import math
from datetime import datetime, timezone
from pathlib import Path
from typing import TYPE_CHECKING, Iterable

import pandas as pd

from cel_utils.artifacts import load_artifacts

if TYPE_CHECKING:  # only for annotations: importing protocol pulls in torch
    from cel_utils.protocol import CelRun

PAPER_MODELS = ("Llama-3.2-3B-Instruct", "Qwen2.5-3B-Instruct", "SmolLM3-3B")
TASK_ORDER = ("arithmetic", "boolq", "hellaswag", "mbpp")
NOT_TRANSCRIBED = "not transcribed"


# --- numbers as text ----------------------------------------------------------------------------------------

def pct(fraction: float) -> str:
    """0.5 -> '50.0'."""
    return "n/a" if fraction is None or math.isnan(fraction) else f"{_tidy(100 * fraction):.1f}"


def _tidy(value: float) -> float:
    """Drop float noise before rounding for display, so 40.0 - 43.75 computed as -3.7499999... prints as -3.8,
    like the difference of the printed accuracies."""
    return round(value, 9)


def transition_text(full: float, ablated: float, gain_points: float | None = None) -> str:
    """Accuracies as fractions -> ``'50.0 -> 75.0 (+25.0)'`` (gain in points)."""
    if gain_points is None:
        gain_points = 100 * (ablated - full)
    return f"{pct(full)} -> {pct(ablated)} ({_tidy(gain_points):+.1f})"


def relative_error_reduction(full: float, ablated: float) -> float:
    """Accuracies as fractions -> gain / (100 - full), in percent; NaN when the full model is at 100%."""
    return float("nan") if full >= 1.0 else 100.0 * (ablated - full) / (1.0 - full)


def rer_text(value: float | None) -> str:
    """Relative error reduction in percent -> ``'50.0%'``; NaN (full model already at 100%) -> ``'n/a'``."""
    return "n/a" if value is None or math.isnan(value) else f"{value:.1f}%"


def provenance_text(data: dict) -> str:
    """Where a run's items came from, in a few words: hub, mirror or generated, and any fallback."""
    text = data.get("source", "unknown")
    if "fallback" in data:
        text += " (no train split: discovery drawn from validation)"
    return text


def run_stem(artifact: dict) -> str:
    """The file stem shared by a run's artifact and its executed notebook: ``model__task__seedN``."""
    from cel_utils.artifacts import artifact_name

    return artifact_name(artifact["model"]["name"], artifact["task"]["name"], artifact["config"]["seed"]).removesuffix(".json")


def run_timings(artifact: dict) -> dict:
    """A run's timings: from the run info beside its artifact (:func:`cel_utils.artifacts.run_info_path`), or
    inline in artifacts written before the run info existed; {} when neither is there."""
    if "timings" in artifact:
        return artifact["timings"]
    from cel_utils.artifacts import read_run_info

    return read_run_info(Path(artifact["config"]["results_dir"]) / f"{run_stem(artifact)}.json").get("timings", {})


# --- one run: the tables of the run notebook ------------------------------------------------------------------

def run_overview(artifact: dict) -> pd.DataFrame:
    """What was run, on what, and how long it took, as a two-column table."""
    cfg, model, data, geo = artifact["config"], artifact["model"], artifact["data"], artifact["model"]["geometry"]
    timings = run_timings(artifact)
    total = sum(v for key, v in timings.items() if key in ("data_s", "model_load_s", "search_s", "holdout_s", "reliability_s"))
    rows = {
        "model": f"{model['name']} ({model['source'].get('kind', '?')}: {cfg['model']})",
        "heads": f"{geo['n_layers']} layers x {geo['n_heads']} query heads ({geo['n_kv_heads']} KV heads), head_dim {geo['head_dim']}",
        "weights": f"{model['dtype']} on {model['device']}, fingerprint {model['fingerprint']}",
        "task": f"{artifact['task']['name']} (primary metric {artifact['task']['metric']}, prompt format {cfg['fmt']})",
        "items": f"{data.get('n_discovery')} discovery, {data.get('n_holdout')} holdout, {data.get('num_fewshot')} few-shot",
        "data": provenance_text(data),
        "search": f"pool p = {cfg['p']}, budget k = {cfg['k']}, {artifact['n_interventions_evaluated']} interventions "
                  f"scored on discovery (engine {cfg['engine']})",
        "frozen heads": artifact["frozen"]["label"],
        "wall time": f"{total:.1f} s (search {timings.get('search_s', float('nan')):.1f} s, "
                     f"holdout {timings.get('holdout_s', float('nan')):.1f} s, "
                     f"null and stability {timings.get('reliability_s', 0.0):.1f} s)",
    }
    return pd.DataFrame({"": list(rows.values())}, index=pd.Index(list(rows), name="run"))


def pool_table(artifact: dict) -> pd.DataFrame:
    """Stage 1's ranked pool: the p best single heads on the discovery set."""
    rows = [s for s in artifact["stage1"] if len(s["heads"]) == 1][: len(artifact["pool"])]
    return pd.DataFrame({
        "rank": range(1, len(rows) + 1),
        "head": [s["heads"][0] for s in rows],
        "accuracy (%)": [round(100 * s["accuracy"], 2) for s in rows],
        "gain (points)": [round(s["gain_points"], 2) for s in rows],
        "harm": [s["harm"] for s in rows],
        "help": [s["help"] for s in rows],
    }).set_index("rank")


def stage2_table(artifact: dict, top: int = 10) -> pd.DataFrame:
    """The best ``top`` subsets of the pool (sizes 1..k) by the ranking key; rank 1 is the frozen set."""
    rows = artifact["stage2"][:top]
    return pd.DataFrame({
        "rank": range(1, len(rows) + 1),
        "heads": ["+".join(s["heads"]) for s in rows],
        "size": [len(s["heads"]) for s in rows],
        "accuracy (%)": [round(100 * s["accuracy"], 2) for s in rows],
        "gain (points)": [round(s["gain_points"], 2) for s in rows],
        "harm": [s["harm"] for s in rows],
        "help": [s["help"] for s in rows],
    }).set_index("rank")


def holdout_table(artifact: dict) -> pd.DataFrame:
    """The frozen set against the full model on the holdout, one row per metric (primary first)."""
    h = artifact["holdout"]
    primary = artifact["task"]["metric"]
    metrics = [primary] + [m for m in artifact["task"]["metrics"] if m != primary]
    rows = []
    for metric in metrics:
        full, ablated = h["full_metrics"].get(metric, float("nan")), h["ablated_metrics"].get(metric, float("nan"))
        rows.append({"metric": metric + (" (primary)" if metric == primary else ""),
                     "full (%)": round(100 * full, 2), "ablated (%)": round(100 * ablated, 2),
                     "gain (points)": round(100 * (ablated - full), 2),
                     "rel. error reduction": rer_text(relative_error_reduction(full, ablated))})
    return pd.DataFrame(rows).set_index("metric")


def holdout_sentence(artifact: dict) -> str:
    """One Markdown sentence with the run's result, and :func:`selection_note` when it applies."""
    h = artifact["holdout"]
    sentence = (f"On **{h['n_items']}** held-out items, ablating **{h['heads_label']}** moves {artifact['task']['metric']} "
                f"**{transition_text(h['full_accuracy'], h['ablated_accuracy'], h['gain_points'])}** "
                f"(relative error reduction {rer_text(h['relative_error_reduction'])}): "
                f"{h['help']} item(s) went wrong -> right and {h['harm']} right -> wrong.")
    note = selection_note(artifact)
    return f"{sentence}\n\n{note}" if note else sentence


def tied_at_top(artifact: dict) -> tuple[int, int]:
    """(sets tied with the frozen one on discovery gain, harm and accuracy, the frozen one included; sets evaluated)."""
    best = artifact["frozen"]["discovery"]
    evaluated = {tuple(s["heads"]): s for s in artifact["stage1"] + artifact["stage2"]}
    counts = (best["help"], best["harm"], best["n_correct"])
    return sum((s["help"], s["harm"], s["n_correct"]) == counts for s in evaluated.values()), len(evaluated)


def selection_note(artifact: dict) -> str:
    """A warning when the frozen set is not a discovery finding: nothing improved discovery, or other evaluated
    sets tie with it on gain, harm and accuracy, so the ranking's last keys (fewer heads, lower ids) chose it.
    Empty otherwise. With few discovery items (MBPP on CPU: 2) every head can tie."""
    best = artifact["frozen"]["discovery"]
    tied, evaluated = tied_at_top(artifact)
    notes = []
    if best["gain_points"] <= 0:
        notes.append(f"No evaluated head set improved discovery {artifact['task']['metric']} (the frozen set's discovery "
                     f"gain is {best['gain_points']:+.1f} points), so the search found nothing.")
    if tied > 1:
        notes.append(f"{tied} of the {evaluated} evaluated sets tie on discovery gain, harm and accuracy; the "
                     "ranking's last keys (fewer heads, then lower head ids) picked this one.")
    return " ".join(["**Caution.**"] + notes) if notes else ""


# --- is the gain real? (cel_utils.reliability) ----------------------------------------------------------------

def p_text(p: float | None) -> str:
    """0.0312 -> '0.031'; tiny values -> '<0.001'; missing -> 'n/a'."""
    if p is None or math.isnan(p):
        return "n/a"
    return "<0.001" if p < 0.001 else f"{p:.3f}" if p < 0.1 else f"{p:.2f}"


def significance(artifact: dict) -> dict | None:
    """The holdout's paired test: stored by the run, else computed from the stored per-item vectors (artifacts
    written before the test existed), else None."""
    stored = (artifact.get("reliability") or {}).get("significance")
    if stored:
        return stored
    h = artifact["holdout"]
    if "full_correct" not in h:
        return None
    from cel_utils.stats import CI_STREAM, paired_test

    return paired_test(h["full_correct"], h["ablated_correct"], seed=[artifact["config"]["seed"], CI_STREAM]).to_json()


def ci_text(sig: dict | None) -> str:
    """``'95% CI [-3.1, +8.0], p = 0.031'`` (McNemar); empty when there is no test."""
    if not sig:
        return ""
    level = round(100 * sig["confidence"])
    return f"{level}% CI [{sig['ci_low']:+.1f}, {sig['ci_high']:+.1f}], p = {p_text(sig['p_value'])}"


def reliability_sentence(artifact: dict) -> str:
    """Markdown: the holdout gain with its interval and p-value, its place in the null, the winner's curse."""
    sig, rel = significance(artifact), artifact.get("reliability") or {}
    if sig is None:
        return "This artifact stores no per-item holdout outcomes, so the gain cannot be tested."
    parts = [f"The holdout gain is **{sig['gain_points']:+.1f} points** ({ci_text(sig).replace(', p =', '; exact McNemar p =')}): "
             f"{sig['help']} item(s) helped against {sig['harm']} harmed, out of {sig['n_items']}."]
    null = rel.get("null")
    if null:
        parts.append(f"Among **{null['n_sets']} random sets of {null['size']} head(s)** scored on the same holdout, the "
                     f"frozen set's gain is at the **{null['percentile']:.0f}th percentile** (empirical one-sided "
                     f"p = {p_text(null['p_value'])}; random sets' median {null['quantiles']['median']:+.1f}).")
    curse = rel.get("winners_curse")
    if curse:
        parts.append(f"On the discovery items the same set gained {curse['discovery_gain_points']:+.1f} points: the "
                     f"search's optimism (winner's curse) is **{curse['gap_points']:+.1f} points**.")
    return " ".join(parts)


def reliability_table(artifact: dict) -> pd.DataFrame:
    """The numbers behind :func:`reliability_sentence`, one per row."""
    sig, rel = significance(artifact), artifact.get("reliability") or {}
    rows = {}
    if sig:
        rows["holdout gain (points)"] = f"{sig['gain_points']:+.2f}"
        rows[f"{round(100 * sig['confidence'])}% CI, paired bootstrap"] = f"[{sig['ci_low']:+.2f}, {sig['ci_high']:+.2f}]"
        rows["exact McNemar p (two-sided)"] = p_text(sig["p_value"])
        rows["helped / harmed items"] = f"{sig['help']} / {sig['harm']} of {sig['n_items']}"
    if rel.get("winners_curse"):
        c = rel["winners_curse"]
        rows["discovery gain -> holdout gain"] = f"{c['discovery_gain_points']:+.2f} -> {c['holdout_gain_points']:+.2f} (gap {c['gap_points']:+.2f})"
    if rel.get("null"):
        n = rel["null"]
        q = n["quantiles"]
        rows["random sets of the same size"] = f"{n['n_sets']} sets of {n['size']}: median {q['median']:+.2f}, range [{q['min']:+.2f}, {q['max']:+.2f}]"
        rows["frozen set among them"] = f"{n['percentile']:.1f}th percentile, empirical p = {p_text(n['p_value'])}"
    if rel.get("stability"):
        st = rel["stability"]
        q = st["holdout_gain_quantiles"]
        rows["selection stability"] = (f"{st['n_resamples']} {st['method']} resamples: frozen set re-selected in "
                                       f"{100 * st['frozen_set_frequency']:.0f}%, {st['distinct_selections']} distinct sets, "
                                       f"mean Jaccard {st['mean_jaccard']:.2f}")
        rows["holdout gains of the resampled selections"] = f"median {q['median']:+.2f}, range [{q['min']:+.2f}, {q['max']:+.2f}]"
    return pd.DataFrame({"": list(rows.values())}, index=pd.Index(list(rows), name="is the gain real?"))


def stability_table(artifact: dict, top: int = 10) -> pd.DataFrame:
    """The sets selected most often across resampled discovery sets, with their holdout gain."""
    st = (artifact.get("reliability") or {}).get("stability")
    if not st:
        return pd.DataFrame(columns=["selected in (%)", "holdout gain (points)"])
    gain_of = dict(zip(st["selections"], st["holdout_gains_points"]))
    frozen = artifact["frozen"]["label"]
    rows = list(st["set_frequency"].items())[:top]
    return pd.DataFrame({
        "heads": [label + (" (frozen)" if label == frozen else "") for label, _ in rows],
        "selected in (%)": [round(100 * share, 1) for _, share in rows],
        "holdout gain (points)": [round(gain_of[label], 2) for label, _ in rows],
    }).set_index("heads")


# --- search strategies (cel_utils.strategies) ----------------------------------------------------------------

def strategies_table(payload: dict) -> pd.DataFrame:
    """One row per strategy: its set, discovery and holdout gains (with the paired test), and its cost."""
    rows = payload["strategies"]
    reference = next((r["forward_equivalents"] for r in rows if r["strategy"].startswith("exhaustive")), None)
    return pd.DataFrame({
        "strategy": [r["strategy"] for r in rows],
        "heads": [r["label"] for r in rows],
        "discovery gain": [f"{r['discovery_gain_points']:+.1f}" for r in rows],
        "holdout gain": [f"{r['holdout_gain_points']:+.1f}" for r in rows],
        "holdout 95% CI": [f"[{r['holdout_ci'][0]:+.1f}, {r['holdout_ci'][1]:+.1f}]" for r in rows],
        "McNemar p": [p_text(r["holdout_p_value"]) for r in rows],
        "evaluations": [r["evaluations"] for r in rows],
        "forward-pass equivalents": [round(r["forward_equivalents"]) for r in rows],
        "cost vs exhaustive": [f"{r['forward_equivalents'] / reference:.2f}x" if reference else "n/a" for r in rows],
    }).set_index("strategy")


def screening_text(payload: dict) -> str:
    """Markdown: how well attribution patching predicts exact single-head screening."""
    sc = payload.get("screening")
    if not sc:
        return f"Attribution patching: {payload.get('attribution_skipped') or 'not run'}."
    def rho(value: float) -> str:
        return "n/a (one side constant)" if value is None or math.isnan(value) else f"{value:.2f}"

    return (f"Attribution patching against exact screening of all {len(sc['estimate']) * len(sc['estimate'][0])} heads: "
            f"rank correlation with the exact effect on the margin, Spearman **{rho(sc['spearman_margin'])}** "
            f"(Kendall {rho(sc['kendall_margin'])}); with the exact accuracy gain, Spearman **{rho(sc['spearman_gain'])}** "
            f"(Kendall {rho(sc['kendall_gain'])}); it recovers **{100 * sc['recall_at_p']:.0f}%** of the exact top "
            f"{sc['p']} (the pool). Its margins of the full model differ from the evaluator's by at most "
            f"{sc['full_margin_max_abs_difference']:.1e}.")


def _strategies_section(payloads: list[dict]) -> list[str]:
    if not payloads:
        return []
    out = ["## Search strategies", "",
           "The paper's exhaustive search within a pool of the top *p* single heads, next to greedy forward selection "
           "and beam search over all heads and to attribution patching (a first-order estimate of every head's effect "
           "from one backward pass), on the same items; gains in points, cost in forward passes of the full model over "
           "one discovery item (see [beyond the paper](beyond.md)). Made by `python -m cel_utils strategies`.", ""]
    for payload in sorted(payloads, key=lambda q: (_task_sort_key(q["task"]["name"]), q["model"]["name"], q["config"]["seed"])):
        table = strategies_table(payload).reset_index()
        out += [f"### {payload['model']['name']} on {payload['task']['name']} (seed {payload['config']['seed']}, "
                f"{payload['n_discovery']} discovery / {payload['n_holdout']} holdout items, p={payload['config']['p']}, "
                f"k={payload['config']['k']}, beam width {payload['beam_width']})", "",
                _md_table(list(table.columns), [[str(v) for v in row] for row in table.itertuples(index=False)]), "",
                screening_text(payload), ""]
    return out


def _clip(text: str, limit: int, tail: bool = False) -> str:
    text = str(text)
    if len(text) <= limit:
        return text
    return "..." + text[-limit:] if tail else text[:limit] + "..."


def greedy_answers(run: "CelRun", indices: Iterable[int], heads=(), max_new_tokens: int = 12) -> list[str]:
    """Short greedy answers for a few holdout items of a teacher-forced task (arithmetic), for display.

    The prompt is exactly the one the scorer used; generation stops at a newline.
    """
    from cel_utils.generation import generate
    from cel_utils.prompts import GenRequest, build_requests

    items = [run.data.holdout[i] for i in indices]
    if not items:
        return []
    model_type = run.lm.model.config.model_type
    scored = build_requests(run.data.task, items, run.data.fewshot, run.lm.tokenizer, run.config.fmt, model_type)
    requests = [GenRequest(item_id=r.item_id, context=r.context, prompt=r.prompt, stop="\n", tests=(), setup="", prefix="")
                for r in scored]
    return generate(run.lm, requests, heads, batch_size=run.config.batch_size, max_new_tokens=max_new_tokens)


def _choice_text(choices: list[str], index) -> str:
    if index is None:
        return "(not stored)"
    return f"[{index}] {_clip(choices[index].strip(), 120)}"


def flip_examples(run: "CelRun", n: int = 3, prompt_chars: int = 300) -> pd.DataFrame:
    """Up to ``n`` holdout items per direction that the ablation flipped, with both models' outputs.

    Multiple choice shows the chosen option, MBPP the generated code and its test status, arithmetic a short
    greedy answer generated here for the displayed items only.
    """
    from cel_utils.search import flips

    task = run.data.task
    full, ablated = run.holdout.full, run.holdout.ablated
    picked = [(direction, int(i)) for direction, idx in flips(full, ablated).items() for i in idx[:n]]
    generated = {}
    if task.kind == "greedy" and picked:
        indices = [i for _, i in picked]
        generated["full"] = dict(zip(indices, greedy_answers(run, indices, ())))
        generated["ablated"] = dict(zip(indices, greedy_answers(run, indices, run.holdout.heads)))
    rows = []
    for direction, i in picked:
        doc = run.data.holdout[i].doc
        row = {"flip": direction.replace("_to_", " -> ").replace("_", " "), "item": run.data.holdout[i].id,
               "prompt (end)": _clip(task.doc_to_text(doc), prompt_chars, tail=True)}
        if task.kind == "choice":
            choices = task.doc_to_choices(doc)
            row["gold"] = _choice_text(choices, task.doc_to_gold(doc))
            row["full model"] = _choice_text(choices, _prediction(full, i))
            row["ablated model"] = _choice_text(choices, _prediction(ablated, i))
        elif task.kind == "generate":
            row["gold"] = _clip(doc.get("code", ""), 400)
            for label, outcome in (("full model", full), ("ablated model", ablated)):
                pred = _prediction(outcome, i) or {}
                row[label] = f"[{pred.get('status', '?')}]\n{_clip(pred.get('completion', '(not stored)'), 600)}"
        else:
            row["gold"] = repr(task.doc_to_target(doc))
            row["full model"] = repr(generated["full"][i])
            row["ablated model"] = repr(generated["ablated"][i])
        rows.append(row)
    columns = ["flip", "item", "prompt (end)", "gold", "full model", "ablated model"]
    return pd.DataFrame(rows, columns=columns)


def _prediction(outcome, index: int):
    return outcome.predictions[index] if index < len(outcome.predictions) else None


def styled(table: pd.DataFrame, monospace: bool = False, index: bool = True):
    """A table for display without pandas' truncation of long text: left-aligned, line breaks kept, escaped."""
    style = {"white-space": "pre-wrap", "text-align": "left", "vertical-align": "top"}
    if monospace:
        style.update({"font-family": "monospace", "font-size": "0.8em"})
    styler = table.style.format(escape="html").set_properties(**style)
    return styler if index else styler.hide(axis="index")


def show_flips(table: pd.DataFrame):
    """The flip table for display (prompts and code keep their line breaks), or a note when nothing flipped."""
    if table.empty:
        from IPython.display import Markdown

        return Markdown("No holdout item flipped: the ablated and full models agree on every item.")
    return styled(table, monospace=True, index=False)


# --- across runs: the results page ------------------------------------------------------------------------------

def _task_sort_key(task: str) -> tuple:
    family = "arithmetic" if task.startswith("arithmetic") else task
    rank = TASK_ORDER.index(family) if family in TASK_ORDER else len(TASK_ORDER)
    return rank, task


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
            "rel_error_reduction": rer_text(relative_error_reduction(h["full_accuracy"], h["ablated_accuracy"])),
            "heads": h["heads_label"], "data": provenance_text(art["data"]),
            "engine": art["config"].get("engine", "?"), "stem": stem, "page": bool(page),
            **_reliability_columns(art),
        })
    columns = ["task", "model", "seed", "metric", "n_discovery", "n_holdout", "p", "k", "full", "ablated", "gain_points",
               "holdout", "rel_error_reduction", "heads", "data", "engine", "stem", "page", "ci", "p_value",
               "null_text", "curse_text", "stability_text"]
    table = pd.DataFrame(rows, columns=columns)
    if table.empty:
        return table
    order = sorted(range(len(table)), key=lambda i: (_task_sort_key(table.task[i]), table.model[i], table.seed[i]))
    return table.iloc[order].reset_index(drop=True)


def _reliability_columns(art: dict) -> dict:
    """Text cells for the results page from a run's significance, null, winner's curse and stability."""
    sig, rel = significance(art), art.get("reliability") or {}
    null, curse, stab = rel.get("null"), rel.get("winners_curse"), rel.get("stability")
    tied = tied_at_top(art)[0]
    return {
        "ci": ci_text(sig), "p_value": sig["p_value"] if sig else float("nan"),
        "null_text": (f"{null['percentile']:.0f}th pct of {null['n_sets']} (p = {p_text(null['p_value'])})"
                      if null else "not run"),
        "curse_text": (f"{curse['discovery_gain_points']:+.1f} -> {curse['holdout_gain_points']:+.1f}" if curse else "n/a")
        + (f", {tied} sets tied" if tied > 1 else ""),
        "stability_text": (f"{100 * stab['frozen_set_frequency']:.0f}% of {stab['n_resamples']}, Jaccard "
                           f"{stab['mean_jaccard']:.2f}, holdout gains {stab['holdout_gain_quantiles']['min']:+.1f} .. "
                           f"{stab['holdout_gain_quantiles']['max']:+.1f}" if stab else "not run"),
    }


def read_paper_table(path: Path) -> list[dict]:
    with open(path, newline="", encoding="utf-8") as handle:
        return list(csv.DictReader(handle))


def paper_cell(row: dict) -> str:
    if row.get("status") != "transcribed":
        return NOT_TRANSCRIBED
    full, ablated = float(row["full_accuracy"]), float(row["ablated_accuracy"])
    return f"{full:.2f} -> {ablated:.2f} ({ablated - full:+.2f}), {float(row['relative_error_reduction']):.2f}%"


def _md_escape(text) -> str:
    return str(text).replace("|", "\\|")


def _md_table(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join(["---"] * len(header)) + "|"]
    lines += ["| " + " | ".join(_md_escape(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def _link(text: str, row, link_prefix: str) -> str:
    return f"[{text}]({link_prefix}{row.stem}.ipynb)" if row.page else text


def results_markdown(artifacts: list[dict], paper_rows: list[dict], runs_dir: Path | None = None,
                     link_prefix: str = "runs/", source_note: str = "", strategies: list[dict] | None = None) -> str:
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
        models = list(dict.fromkeys(table.model))
        tasks = sorted(dict.fromkeys(table.task), key=_task_sort_key)
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
                _md_table(["task (metric)"] + models, body), ""]
        detail = [[r.task, f"{r.model}, seed {r.seed}", _link(r.holdout, r, link_prefix), r.rel_error_reduction,
                   f"`{r.heads}`", f"{r.n_discovery} / {r.n_holdout}, p={r.p}, k={r.k}", r.data]
                  for r in table.itertuples()]
        out += ["## Every run", "",
                "The frozen heads, the sizes (discovery / holdout items), the search parameters (pool *p*, budget *k*) "
                "and where the items came from (hub, local mirror, or generated, with any fallback).",
                "", _md_table(["task", "model", "full -> ablated (gain)", "rel. error red.", "heads",
                               "items, search", "data"], detail), ""]
        checks = [[r.task, f"{r.model}, seed {r.seed}", r.ci or "n/a", r.null_text, r.curse_text, r.stability_text]
                  for r in table.itertuples()]
        out += ["## Is the gain real?", "",
                "Per run: the holdout gain's paired 95% interval and exact McNemar p-value; the frozen set's place among "
                "random head sets of the same size on the same holdout (percentile, empirical one-sided p); the discovery "
                "gain against the holdout gain (the winner's curse), with the number of evaluated sets that tie with the "
                "frozen one on discovery when there is more than one (the ranking's last keys, fewer heads and lower head "
                "ids, then chose among them); and how often the whole selection picks the same set "
                "again on resampled discovery sets, how much the selections overlap (mean pairwise Jaccard) and the range "
                "of their holdout gains. [Beyond the paper](beyond.md) defines each.",
                "", _md_table(["task", "model", "gain: 95% CI, McNemar p", "vs random sets", "discovery -> holdout gain",
                               "frozen set re-selected, overlap, holdout gains"], checks), ""]
    out += _strategies_section(strategies or [])
    out += _paper_section(paper_rows)
    if source_note:
        out += ["", f"<small>{html.escape(source_note)}</small>", ""]
    return "\n".join(out).rstrip() + "\n"


def _paper_section(paper_rows: list[dict]) -> list[str]:
    if not paper_rows:
        return []
    models = [m for m in PAPER_MODELS if any(r["model"] == m for r in paper_rows)]
    models += [m for m in dict.fromkeys(r["model"] for r in paper_rows) if m not in models]
    tasks = sorted(dict.fromkeys(r["task"] for r in paper_rows), key=_task_sort_key)
    lookup = {(r["model"], r["task"]): r for r in paper_rows}
    body = [[task] + [paper_cell(lookup[(m, task)]) if (m, task) in lookup else NOT_TRANSCRIBED for m in models]
            for task in tasks]
    return ["## The paper's Table 1 (reference)", "",
            "The paper's three 3B models, as full -> ablated (gain), relative error reduction. Only the figures "
            "transcribed into `data/paper_table1.csv` are shown; the other cells are marked *not transcribed* "
            "rather than guessed. Our runs use other (smaller) models and, on CPU, far fewer items, so they are "
            "not expected to match.", "", _md_table(["task"] + models, body), ""]


def write_results_page(results_dir: Path, out_path: Path, runs_dir: Path | None = None,
                       paper_table: Path | None = None) -> Path:
    """Aggregate every artifact in ``results_dir`` into the results page at ``out_path``."""
    from cel_utils.artifacts import atomic_write_text

    results_dir, out_path = Path(results_dir), Path(out_path)
    artifacts = load_artifacts(results_dir) if results_dir.is_dir() else []
    strategies = load_artifacts(results_dir / "strategies") if (results_dir / "strategies").is_dir() else []
    paper_rows = read_paper_table(paper_table) if paper_table is not None and Path(paper_table).exists() else []
    link_prefix = ""
    if runs_dir is not None:
        import os

        link_prefix = Path(os.path.relpath(Path(runs_dir).resolve(), out_path.parent.resolve())).as_posix() + "/"
    stamp = datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    note = (f"Generated by python -m cel_utils aggregate on {stamp} from {len(artifacts)} artifact(s) in "
            f"{results_dir.name}/.")
    atomic_write_text(out_path, results_markdown(artifacts, paper_rows, runs_dir, link_prefix, note, strategies))
    return out_path
