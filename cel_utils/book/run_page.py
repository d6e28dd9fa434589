"""The tables and sentences of one run's page, each a pure function of the run's JSON artifact (no model needed,
so any stored run can be re-rendered)."""
from __future__ import annotations

from pathlib import Path

import pandas as pd

from cel_utils.book.text import ci_text, ordinal, p_is, p_text, provenance_text, rer_text, styled, transition_text
from cel_utils.pipeline.schema import RunArtifact
from cel_utils.pipeline.stats_schema import Margin, PairedTest, Power, Verdict
from cel_utils.tasks.scoring import relative_error_reduction


def run_stem(artifact: RunArtifact) -> str:
    """The file stem shared by a run's artifact and its executed notebook: ``model__task__seedN``."""
    from cel_utils.pipeline.artifacts import artifact_name

    return artifact_name(artifact["model"]["name"], artifact["task"]["name"], artifact["config"]["seed"]).removesuffix(".json")


def run_timings(artifact: RunArtifact) -> dict:
    """A run's timings: from the run info beside its artifact (:func:`cel_utils.pipeline.artifacts.run_info_path`), or
    inline in artifacts written before the run info existed; {} when neither is there."""
    if "timings" in artifact:
        return artifact["timings"]
    from cel_utils.pipeline.artifacts import read_run_info

    return read_run_info(Path(artifact["config"]["results_dir"]) / f"{run_stem(artifact)}.json").get("timings", {})


def run_overview(artifact: RunArtifact) -> pd.DataFrame:
    """What was run, on what, and how long it took, as a two-column table."""
    cfg, model, data, geo = artifact["config"], artifact["model"], artifact["data"], artifact["model"]["geometry"]
    timings = run_timings(artifact)
    total = sum(v for key, v in timings.items() if key in ("data_s", "model_load_s", "search_s", "holdout_s", "reliability_s"))
    rows = {
        "model": f"{model['name']} ({model['source'].get('kind', '?')}: {cfg['model']})",
        "heads": f"{geo['n_layers']} layers x {geo['n_heads']} query heads ({geo['n_kv_heads']} KV heads), head_dim {geo['head_dim']}",
        "weights": weights_text(artifact),
        "precision": precision_text(artifact),
        "task": f"{artifact['task']['name']} (primary metric {artifact['task']['metric']}, prompt format {cfg['fmt']})",
        "items": f"{data.get('n_discovery')} discovery, {data.get('n_holdout')} holdout, {data.get('num_fewshot')} few-shot",
        "data": provenance_text(data),
        "stage 1": stage1_text(artifact),
        "search": f"pool p = {cfg['p']}, budget k = {cfg['k']}, {artifact['n_interventions_evaluated']} interventions "
                  f"scored exactly on discovery (engine {cfg['engine']})",
        "frozen heads": artifact["frozen"]["label"],
        "wall time": f"{total:.1f} s (search {timings.get('search_s', float('nan')):.1f} s, "
                     f"holdout {timings.get('holdout_s', float('nan')):.1f} s, "
                     f"null and stability {timings.get('reliability_s', 0.0):.1f} s)",
    }
    return pd.DataFrame({"": list(rows.values())}, index=pd.Index(list(rows), name="run"))


def quantization(source: dict) -> str | None:
    """The GGUF quantization a model's weights were made from (``Q4_1``, ``Q4_K_M``), read from its file name; None
    for weights that were not a GGUF file."""
    import re

    name = Path(source.get("gguf", "")).name
    found = re.search(r"(?i)[._-](q\d+_[a-z0-9_]+?|f16|bf16|f32)\.gguf$", name)
    return found.group(1).upper() if found else None


QUANT_BITS = {"Q4": "4-bit", "Q5": "5-bit", "Q6": "6-bit", "Q8": "8-bit", "F16": "16-bit", "BF16": "16-bit",
              "F32": "32-bit"}


def weights_text(artifact: RunArtifact) -> str:
    """What the weights are: for a GGUF model, its quantization (these are 4-bit models' heads), then the dtype they
    were dequantized to and computed in."""
    model = artifact["model"]
    quant = quantization(model["source"] or {})
    bits = QUANT_BITS.get((quant or "").split("_")[0], "quantized")
    made = (f"{bits} GGUF ({quant}) dequantized to {model['dtype']}" if quant else model["dtype"])
    return f"{made} on {model['device']}, fingerprint {model['fingerprint']}"


def interval_name(sig: dict) -> str:
    """How the gain's interval was found, in a few words."""
    return "exact (few changed answers)" if sig.get("interval", "").startswith("exact") else "paired bootstrap"


def margin_text(margin: Margin) -> str:
    """The secondary measure in one line: the mean change of the gold answer's margin with its interval."""
    return (f"{margin['mean_change']:+.3g} {margin['unit'].split(' (')[0]} on average (95% CI "
            f"[{margin['ci_low']:+.3g}, {margin['ci_high']:+.3g}]), up on {100 * margin['share_up']:.0f}% of "
            f"{margin['n_items']} items")


def precision_text(artifact: RunArtifact) -> str:
    """What the evaluations computed in (issue 27), and for the guarded precision what its audit saw."""
    record = artifact["precision"]
    if record is None:
        return "fp32 (recorded since issue 27)"
    text = record["resolved"] + ("" if record["setting"] == record["resolved"] else f" (setting {record['setting']})")
    if record.get("approximate"):
        return text + ": plain bfloat16, every number on this page is approximate (rounding flips ~1% of decisions)"
    audit = record.get("audit")
    if not audit:
        return text
    outside = "the bands" if audit.get("depth_bands") else "the band"
    if audit.get("depth_bands"):
        bands = (f"bands {', '.join(f'{b:.3g}' for b in audit['depth_bands'])} for interventions starting in the "
                 f"lowest, middle and top third of the layers, each {audit['multiple']:g} x the largest error audited "
                 f"in its third, or in the whole run ({audit['largest_error'] or 0:.3g}) for a third with fewer than "
                 f"{audit['group_evidence']} audited pairs")
    else:
        bands = (f"band {audit['band']:.3g} = {audit['multiple']:g} x the largest audited error "
                 f"{audit['largest_error'] or 0:.3g}")
    text += (f": the search in bf16 with fp32's decisions, the holdout in fp32; on this run's machine {audit['pairs']} "
             f"pairs, {audit['share_rechecked'] or 0:.1%} rechecked in fp32; {bands}; {audit['audited']} audited "
             f"outside {outside}, {audit['bf16_decisions_caught']} bf16 decisions corrected")
    if audit.get("fell_back_to_fp32"):
        text += f"; FELL BACK TO FP32: {audit['fell_back_to_fp32']}"
    return text


def stage1_text(artifact: RunArtifact) -> str:
    """How stage 1 ran: every head exactly, or which screen passed how many heads on to exact evaluation."""
    method = artifact["stage1_method"]
    geo = artifact["model"]["geometry"]
    n_heads = geo["n_layers"] * geo["n_heads"]
    if method["method"] == "exact":
        return f"exact: all {n_heads} heads, each ablated alone on every discovery item"
    return (f"screened by {method['screen']}: every head ranked on all discovery items, its top m = {method['keep']} "
            f"of {n_heads} evaluated exactly")


def pool_table(artifact: RunArtifact) -> pd.DataFrame:
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


def stage2_table(artifact: RunArtifact, top: int = 10) -> pd.DataFrame:
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


def holdout_table(artifact: RunArtifact) -> pd.DataFrame:
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
                     "rel. error reduction": rer_text(relative_error_reduction(100 * full, 100 * ablated))})
    return pd.DataFrame(rows).set_index("metric")


def holdout_sentence(artifact: RunArtifact) -> str:
    """One Markdown sentence with the run's result, and :func:`selection_note` and :func:`sandbox_note` when they
    apply."""
    h = artifact["holdout"]
    sentence = (f"On **{h['n_items']}** held-out items, ablating **{h['heads_label']}** moves {artifact['task']['metric']} "
                f"**{transition_text(h['full_accuracy'], h['ablated_accuracy'], h['gain_points'])}** "
                f"(relative error reduction {rer_text(h['relative_error_reduction'])}): "
                f"{h['help']} item(s) went wrong -> right and {h['harm']} right -> wrong.")
    return "\n\n".join(part for part in (verdict_sentence(artifact), sentence, selection_note(artifact),
                                         sandbox_note(artifact)) if part)


def sandbox_note(artifact: RunArtifact) -> str:
    """A warning when the run's model-written code (MBPP) ran in a sandbox with only best-effort layers somewhere
    (:func:`cel_utils.sandbox.isolation_report`, stored by the run); empty otherwise."""
    warning = (artifact["sandbox"] or {}).get("warning")
    return f"**Warning: best-effort sandbox.** This run executed model-written code, and {warning}." if warning else ""


def tied_at_top(artifact: RunArtifact) -> tuple[int, int]:
    """(sets tied with the frozen one on discovery gain, harm and accuracy, the frozen one included; sets evaluated)."""
    best = artifact["frozen"]["discovery"]
    evaluated = {tuple(s["heads"]): s for s in artifact["stage1"] + artifact["stage2"]}
    counts = (best["help"], best["harm"], best["n_correct"])
    return sum((s["help"], s["harm"], s["n_correct"]) == counts for s in evaluated.values()), len(evaluated)


def selection_note(artifact: RunArtifact) -> str:
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


def significance(artifact: RunArtifact) -> PairedTest | None:
    """The holdout's paired test, computed by today's code from the stored per-item vectors (the same seed stream as
    the run's, so the same numbers wherever the method did not change since; a run stored before the exact interval
    for few changed answers gets it here); the stored test only where the vectors are missing, else None."""
    h = artifact["holdout"]
    if h["full_correct"] is None or h["ablated_correct"] is None:
        return (artifact["reliability"] or {}).get("significance")
    from cel_utils.stats.significance import CI_STREAM, paired_test

    return paired_test(h["full_correct"], h["ablated_correct"], seed=[artifact["config"]["seed"], CI_STREAM]).to_json()


def power_of(artifact: RunArtifact) -> Power | None:
    """The smallest change the holdout test detects: stored by the run, else computed from the per-item vectors."""
    rel, h = artifact["reliability"] or {}, artifact["holdout"]
    if rel.get("power"):
        return rel["power"]
    if h["full_correct"] is None or h["ablated_correct"] is None:
        return None
    from cel_utils.stats.power import discordant, power_json

    return power_json(h["n_items"], discordant(h["full_correct"], h["ablated_correct"]))


def verdict_of(artifact: RunArtifact, family: dict | None = None) -> Verdict | None:
    """The run's one-line verdict (:func:`cel_utils.stats.power.verdict`), worded by the code that builds the page from
    the artifact's numbers, so that a page never repeats wording since found to claim more than the numbers support;
    the stored text only where the numbers are missing. ``family``: the run's place among the tests it is shown with
    (:mod:`cel_utils.book.claims`); None: a family of one."""
    rel = artifact["reliability"] or {}
    sig, power = significance(artifact), power_of(artifact)
    if sig is None or power is None:
        return rel.get("verdict")
    from cel_utils.stats.power import verdict

    h = artifact["holdout"]
    return verdict(sig, power, rel.get("calibration"), floors=artifact["floors"],
                   accuracies=(h["full_accuracy"], h["ablated_accuracy"]), family=family)


def verdict_sentence(artifact: RunArtifact, family: dict | None = None) -> str:
    found = verdict_of(artifact, family)
    if not found:
        return ""
    alone = "" if family and family["m"] > 1 else (
        " This page tests the run alone; the results page adjusts its p-value for every run the book shows.")
    return f"**Verdict: {found['text']}.**{alone}"


def reliability_sentence(artifact: RunArtifact) -> str:
    """Markdown: the holdout gain with its interval and p-value, its place in the null, the winner's curse."""
    sig, rel = significance(artifact), artifact["reliability"] or {}
    if sig is None:
        return "This artifact stores no per-item holdout outcomes, so the gain cannot be tested."
    parts = [f"The holdout gain is **{sig['gain_points']:+.1f} points** ({ci_text(sig).replace(', p =', '; exact McNemar p =')}): "
             f"{sig['help']} item(s) helped against {sig['harm']} harmed, out of {sig['n_items']}."]
    null = rel.get("null")
    if null:
        where = (f"on {null['n_items']} holdout items drawn at random with the run's seed (where the frozen set "
                 f"gained {null['selected_gain_points']:+.1f})" if "n_items" in null else "on the same holdout")
        parts.append(f"Among **{null['n_sets']} random sets of {null['size']} head(s)** scored {where}, the "
                     f"frozen set's gain is at the **{ordinal(null['percentile'])} percentile** (empirical one-sided "
                     f"{p_is(null['p_value'])}; random sets' median {null['quantiles']['median']:+.1f}).")
    curse = rel.get("winners_curse")
    if curse:
        parts.append(f"On the discovery items the same set gained {curse['discovery_gain_points']:+.1f} points: the "
                     f"search's optimism (winner's curse) is **{curse['gap_points']:+.1f} points**.")
    return " ".join(parts)


def reliability_table(artifact: RunArtifact) -> pd.DataFrame:
    """The numbers behind :func:`reliability_sentence`, one per row."""
    sig, rel = significance(artifact), artifact["reliability"] or {}
    rows = {}
    if verdict_of(artifact):
        rows["verdict"] = verdict_of(artifact)["text"]
    if sig:
        rows["holdout gain (points)"] = f"{sig['gain_points']:+.2f}"
        rows[f"{round(100 * sig['confidence'])}% CI, {interval_name(sig)}"] = f"[{sig['ci_low']:+.2f}, {sig['ci_high']:+.2f}]"
        rows["exact McNemar p (two-sided)"] = p_text(sig["p_value"])
        rows["helped / harmed items"] = f"{sig['help']} / {sig['harm']} of {sig['n_items']}"
    power = power_of(artifact)
    if power:
        mdg = power["min_detectable_gain_points"]
        rows[f"smallest change detectable ({100 * power['power']:.0f}% power; the design, not a bound)"] = (
            f"{mdg:.1f} points, with {power['n_discordant']} of {power['n_items']} answers changed" if mdg is not None else
            f"none: only {power['n_discordant']} of {power['n_items']} answers changed")
    margin = rel.get("margin")
    if margin:
        rows["gold answer's margin, ablated - full (secondary)"] = margin_text(margin)
    if rel.get("calibration"):
        cal, versus = rel["calibration"], rel["calibration"]["ablation_vs_calibration"]
        kept = (f"{cal['n_groups']} group(s) kept by {cal['folds']}-fold cross-validation" if "n_groups" in cal
                else "every group")
        rows["calibration baseline (offsets fitted on discovery)"] = (
            f"{100 * cal['holdout_accuracy']:.1f}% on the holdout ({cal['holdout_gain_points']:+.2f} points; {kept})"
            + ("" if cal["holdout_gain_points"] <= 0 else
               f"; ablation minus calibration {versus['gain_points']:+.2f}, McNemar {p_is(versus['p_value'])}"))
    if rel.get("winners_curse"):
        c = rel["winners_curse"]
        rows["discovery gain -> holdout gain"] = f"{c['discovery_gain_points']:+.2f} -> {c['holdout_gain_points']:+.2f} (gap {c['gap_points']:+.2f})"
    if rel.get("null"):
        n = rel["null"]
        q = n["quantiles"]
        on = f" on {n['n_items']} holdout items (a seeded random subset)" if "n_items" in n else ""
        rows["random sets of the same size"] = (f"{n['n_sets']} sets of {n['size']}{on}: median {q['median']:+.2f}, "
                                                f"range [{q['min']:+.2f}, {q['max']:+.2f}]")
        rows["frozen set among them"] = f"{n['percentile']:.1f}th percentile, empirical {p_is(n['p_value'])}"
    if rel.get("stability"):
        st = rel["stability"]
        q = st["holdout_gain_quantiles"]
        rows["selection stability"] = (f"{st['n_resamples']} {st['method']} resamples: frozen set re-selected in "
                                       f"{100 * st['frozen_set_frequency']:.0f}%, {st['distinct_selections']} distinct sets, "
                                       f"mean Jaccard {st['mean_jaccard']:.2f}")
        rows["holdout gains of the resampled selections"] = f"median {q['median']:+.2f}, range [{q['min']:+.2f}, {q['max']:+.2f}]"
    config = artifact["config"]
    for part, setting, flag in (("null", "n_random_sets", "--n-random-sets"), ("stability", "n_resamples", "--n-resamples")):
        if rel and not rel.get(part) and config.get(setting) == 0:  # say so, rather than leave the reader to wonder
            rows["random sets of the same size" if part == "null" else "selection stability"] = (
                f"not run ({setting} = 0 in this run's preset, to fit its time budget; {flag} N runs it)")
    return pd.DataFrame({"": list(rows.values())}, index=pd.Index(list(rows), name="is the gain real?"))


def stability_table(artifact: RunArtifact, top: int = 10) -> pd.DataFrame:
    """The sets selected most often across resampled discovery sets, with their holdout gain."""
    st = (artifact["reliability"] or {}).get("stability")
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


def flip_table(artifact: RunArtifact) -> pd.DataFrame:
    """The holdout items the ablation flipped, in both directions, with what each model answered (stored by the run,
    :func:`cel_utils.pipeline.examples.flip_examples`)."""
    rows = [{"flip": e["direction"].replace("_to_", " -> ").replace("_", " "), "item": e["item"],
             "prompt (end)": e["prompt_end"],
             "gold": e["gold"], "full model": e["full"], "ablated model": e["ablated"]}
            for e in artifact["holdout"]["examples"]]
    return pd.DataFrame(rows, columns=["flip", "item", "prompt (end)", "gold", "full model", "ablated model"])


def show_flips(table: pd.DataFrame):
    """The flip table for display (prompts and code keep their line breaks), or a note when nothing flipped."""
    if table.empty:
        from IPython.display import Markdown

        return Markdown("No holdout item flipped: the ablated and full models agree on every item.")
    return styled(table, monospace=True, index=False)


def verdict_word(found: dict) -> str:
    """The verdict in a word or two, for tables: the floor first, as in the sentence."""
    word = {"gain": "gain", "loss": "loss", "not significant": "no effect shown",
            "underpowered": "underpowered"}.get(found["kind"], found["kind"])
    return f"at floor; {word}" if found.get("at_floor") else word
