"""The run page's baselines: the trivial accuracies (floors) of the run's holdout items beside the full, ablated and
control accuracies, how often each answer is given, and the other-ablation control in words (issue 42). Each a pure
function of the run's JSON artifact, as :mod:`cel_utils.book.run_page`'s parts are.
"""
from __future__ import annotations

import pandas as pd

from cel_utils.book.text import ci_text
from cel_utils.pipeline.schema import Floors, RunArtifact


def floor_rows(artifact: RunArtifact) -> list[tuple[str, float | None, str]]:
    """(what, accuracy as a fraction or None, note) for the trivial baselines of the run's holdout items."""
    return floor_rows_of(artifact["floors"])


def floor_rows_of(floors: Floors | None) -> list[tuple[str, float | None, str]]:
    """:func:`floor_rows` from a floors section alone (the explorer scores items of its own)."""
    if not floors:
        return []
    rows = []
    if floors.get("chance") is not None:
        rows.append(("chance", floors["chance"], "a uniformly random answer"))
    best = floors.get("best_constant")
    if best:
        from cel_utils.stats.power import floor_name

        rows.append((floor_name({"best_constant": best})[0], best["accuracy"], f"best constant answer ({best['what']})"))
    if not rows:
        rows.append(("solving nothing", 0.0, floors.get("note", "no trivial answer")))
    return rows


def floors_table(artifact: RunArtifact) -> pd.DataFrame:
    """The full, ablated and control accuracies beside the floors of the same holdout items, highest first."""
    h, control = artifact["holdout"], artifact["control"]
    rows = [(name, value, note) for name, value, note in floor_rows(artifact)]
    rows += [("full model", h["full_accuracy"], "the model as it is"),
             (f"{h['heads_label']} {_ablation_word(artifact)}-ablated", h["ablated_accuracy"], "the run's frozen set")]
    if control:
        rows.append((f"{control['heads_label']} {control['ablation']}-ablated", control["accuracy"],
                     "the control (same heads, other ablation)"))
    rows.sort(key=lambda r: -r[1])
    return pd.DataFrame({"accuracy (%)": [round(100 * v, 1) for _, v, _ in rows], "what": [n for _, _, n in rows]},
                        index=pd.Index([name for name, _, _ in rows], name=f"on the {h['n_items']} holdout items"))


def _ablation_word(artifact: RunArtifact) -> str:
    return artifact["config"]["ablation"]


def answer_profile(artifact: RunArtifact) -> str:
    """Multiple choice: how often the full and the ablated model give each answer, and which way the changed answers
    went, from the stored predictions (a bias shift reads here); empty for the other kinds."""
    from cel_utils.tasks.floors import answer_shares, changed_answers

    floors, h = artifact["floors"] or {}, artifact["holdout"]
    labels = floors.get("labels")
    if not labels:
        return ""
    full = answer_shares(h["full_predictions"] or [], len(labels))
    ablated = answer_shares(h["ablated_predictions"] or [], len(labels))
    if full is None or ablated is None:
        return ""

    def shares(values: list[float]) -> str:
        return ", ".join(f"{label!r} {100 * v:.1f}%" for label, v in zip(labels, values))

    moves = changed_answers(h["full_predictions"], h["ablated_predictions"])
    n_moved = sum(moves.values())
    top = ", ".join(f"{n} {labels[a]!r} -> {labels[b]!r}" for (a, b), n in list(moves.items())[:3])
    gold = floors.get("gold_shares")
    return (f"The full model answers {shares(full)}; ablated, {shares(ablated)}"
            + (f" (the right answers: {shares(gold)})" if gold else "") + ". "
            + (f"Of the {n_moved} answers the ablation changed: {top}." if n_moved else "No answer changed."))


def control_sentence(artifact: RunArtifact) -> str:
    """The control in words: the frozen set under the other ablation, against the full model and the run's ablation."""
    control = artifact["control"]
    if not control:
        return ""
    h, vf, vs = artifact["holdout"], control["vs_full"], control["vs_search"]
    word, other = _ablation_word(artifact), control["ablation"]
    how = ("each replaced by its mean over the discovery items' tokens, not by zero" if other == "mean"
           else "each set to zero, not to its mean")
    moved = "significant alone" if vf["p_value"] <= 0.05 else "not significant"
    differ = "differ significantly" if vs["p_value"] <= 0.05 else "do not differ significantly"
    text = (f"**Control: {other}-ablation.** With the same heads {other}-ablated ({how}), the holdout accuracy is "
            f"{100 * control['accuracy']:.1f}%, against the full model's {100 * h['full_accuracy']:.1f}% and the "
            f"{word}-ablated {100 * h['ablated_accuracy']:.1f}%: {vf['gain_points']:+.1f} points from the full model "
            f"({ci_text(vf)}; {moved}). The two ablations {differ} on these items ({other} - {word} "
            f"{vs['gain_points']:+.1f} points, {ci_text(vs)}).")
    if word == "zero" and vs["p_value"] <= 0.05:
        text += " Part of what zero-ablation does here needs the zero vector, a state the model never produced."
    return text
