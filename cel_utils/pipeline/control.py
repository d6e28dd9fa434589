"""The control for zero-ablation: the run's frozen set scored again with its heads mean-ablated, on the same holdout.

Zeroing a head's output puts the layer in a state the model never produced; part of what zero-ablation does may come
from that alone, the more so in the first layers, whose outputs every later layer reads. Replacing the head's output
by its mean over the discovery items' tokens (:mod:`cel_utils.evaluation.means`) removes what the head says about
the item while keeping the layer's input where it usually is: the field's standard control. The search itself stays
as configured (``ablation``, zero by default, the paper's); the control scores only the frozen set, once, under the
other ablation, on the same holdout items, and compares it item by item with both the full model and the search's
ablation. A gain that survives mean-ablation is not an artefact of the zero vector; one that vanishes may be.
"""
from __future__ import annotations


from cel_utils.evaluation.evaluator import Evaluator
from cel_utils.evaluation.means import HeadMeans
from cel_utils.models.heads import format_heads
from cel_utils.pipeline.artifacts import bits
from cel_utils.search.algorithm import HoldoutResult
from cel_utils.stats.reliability import MARGIN_STREAM
from cel_utils.stats.significance import CI_STREAM, paired_mean_change, paired_test

CONTROL_STREAM = 107  # the control's bootstrap intervals


def control_ablation(ablation: str) -> str:
    """The ablation the control uses: the other one."""
    return "mean" if ablation == "zero" else "zero"


def score_control(evaluator: Evaluator, holdout: HoldoutResult, means: HeadMeans, seed: int) -> dict:
    """The artifact's ``control`` section: the frozen set under the control's ablation (``evaluator`` ablates that
    way), on the holdout items, against the full model and against the search's own ablation."""
    outcome = evaluator.evaluate_one(holdout.heads)
    if outcome.item_ids != holdout.full.item_ids:
        raise ValueError("the control must score the holdout's items, in the holdout's order")
    unit = evaluator.kind.margin_unit(evaluator.task)
    vs_full = paired_test(holdout.full.correct, outcome.correct, seed=[seed, CONTROL_STREAM, 0])
    vs_search = paired_test(holdout.ablated.correct, outcome.correct, seed=[seed, CONTROL_STREAM, 1])
    return {
        "ablation": evaluator.ablation_name, "search_ablation": "zero" if evaluator.means is not None else "mean",
        "means": means.to_json(), "heads": [str(h) for h in holdout.heads], "heads_label": format_heads(holdout.heads),
        "n_items": len(outcome.correct), "accuracy": outcome.accuracy, "metrics": outcome.metric_means(),
        "correct": bits(outcome.correct), "predictions": outcome.predictions,
        # the control against the full model (its own gain), and against the search's ablation (control - search)
        "vs_full": vs_full.to_json(), "vs_search": vs_search.to_json(),
        "margin": None if unit is None else {"unit": unit, **paired_mean_change(
            holdout.full.margin, outcome.margin, seed=[seed, MARGIN_STREAM, CI_STREAM])},
    }
