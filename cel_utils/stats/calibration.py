"""A calibration baseline for every multiple-choice gain: the cheapest fix of a response bias, fitted on discovery.

An ablation can raise accuracy by fixing a bias rather than by unlocking a capability: a model that answers " no" to
most BoolQ items gains from anything that shifts it towards " yes". The baseline here shifts the full model's answer
scores by additive offsets, one per group of answers (the task's ``calibration``: per answer for BoolQ, per
answer-length bucket for HellaSwag), chosen to maximise *discovery* accuracy, and applies them unchanged to the
holdout. It needs no forward pass: the full model's per-answer scores are already computed (``Outcome.scores``).

The offsets are fitted by coordinate ascent: each offset in turn is set to the value that maximises discovery accuracy
with the others fixed (an exact search over the points where some item's choice changes; among equally good values the
middle of the interval closest to zero), until no offset changes. The first group's offset is fixed at 0 (adding the
same number to every answer changes nothing).
"""
from __future__ import annotations

import numpy as np

from cel_utils.stats.significance import CI_STREAM, paired_test

N_LENGTH_BUCKETS = 4
MAX_ROUNDS = 20
OFFSET_DECIMALS = 4


def answer_groups(kind: str, requests, edges: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray | None]:
    """[items, answers] group of every answer, and the length-bucket edges (fitted on discovery, reused on holdout)."""
    if kind == "answer":
        return np.tile(np.arange(len(requests[0].continuations)), (len(requests), 1)), None
    lengths = np.array([r.choice_chars for r in requests], dtype=float)
    if edges is None:
        edges = np.quantile(lengths, np.linspace(0, 1, N_LENGTH_BUCKETS + 1)[1:-1])
    return np.searchsorted(edges, lengths, side="right"), edges


def _accuracy(scores: np.ndarray, gold: np.ndarray, groups: np.ndarray, offsets: np.ndarray) -> float:
    return float((np.argmax(scores + offsets[groups], axis=1) == gold).mean())


def _best_value(scores, gold, groups, offsets, g: int) -> float:
    """The value of offset ``g`` that maximises accuracy with the others fixed."""
    shifted = scores + offsets[groups]
    inside = groups == g
    # Where an item's choice can change: an answer in group g ties the best answer outside it.
    best_out = np.where(inside, -np.inf, shifted).max(axis=1)
    base = np.where(inside, shifted - offsets[g], -np.inf)
    points = np.unique((best_out[:, None] - base)[inside & np.isfinite(best_out)[:, None]])
    if points.size == 0:
        return float(offsets[g])
    candidates = np.concatenate([[points[0] - 1.0], (points[:-1] + points[1:]) / 2, [points[-1] + 1.0]])
    accuracy = [_accuracy(scores, gold, groups, np.where(np.arange(len(offsets)) == g, c, offsets)) for c in candidates]
    best = max(accuracy)
    winners = candidates[np.isclose(accuracy, best)]
    return float(winners[np.argmin(np.abs(winners))])


def fit_offsets(scores: np.ndarray, gold: np.ndarray, groups: np.ndarray) -> np.ndarray:
    """Offsets per group (group 0 fixed at 0) that maximise the accuracy of argmax(scores + offsets[groups])."""
    offsets = np.zeros(int(groups.max()) + 1)
    for _ in range(MAX_ROUNDS):
        before = offsets.copy()
        for g in range(1, len(offsets)):
            offsets[g] = _best_value(scores, gold, groups, offsets, g)
        if np.array_equal(before, offsets):
            break
    return offsets


def calibration_baseline(kind: str | None, discovery_requests, discovery_full, holdout_requests, holdout_full,
                         holdout_ablated, seed: int = 0) -> dict | None:
    """The baseline fitted on discovery and scored on the holdout, beside the ablation; None where the task has none."""
    if kind is None or discovery_full.scores is None or holdout_full.scores is None:
        return None
    gold_d = np.array([r.gold for r in discovery_requests])
    gold_h = np.array([r.gold for r in holdout_requests])
    groups_d, edges = answer_groups(kind, discovery_requests)
    groups_h, _ = answer_groups(kind, holdout_requests, edges)
    # Rounded: scores carry float noise (batch size, engine), which must not reach the artifact through the offsets.
    offsets = np.round(fit_offsets(discovery_full.scores, gold_d, groups_d), OFFSET_DECIMALS)
    calibrated = np.argmax(holdout_full.scores + offsets[groups_h], axis=1) == gold_h
    vs_full = paired_test(holdout_full.correct, calibrated, seed=[seed, CI_STREAM])
    vs_ablation = paired_test(calibrated, holdout_ablated.correct, seed=[seed, CI_STREAM])
    return {"groups": kind, "offsets": offsets.tolist(), "length_edges": None if edges is None else edges.tolist(),
            "discovery_accuracy": _accuracy(discovery_full.scores, gold_d, groups_d, offsets),
            "holdout_accuracy": float(calibrated.mean()), "holdout_gain_points": vs_full.gain_points,
            "holdout_correct": [int(c) for c in calibrated], "test": vs_full.to_json(),
            "ablation_vs_calibration": vs_ablation.to_json()}
