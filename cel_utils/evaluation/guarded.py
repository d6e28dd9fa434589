"""bfloat16 at float32's word: compute in bf16, recompute in fp32 exactly the decisions bf16 could have got wrong.

A decision can only flip where its margin is smaller than the rounding error. The guarded precision evaluates every
(item, intervention) pair on a bf16 copy of the model and recomputes in fp32 (:meth:`EngineEvaluator.pair_stats`) the
pairs whose bf16 *decision margin* lies inside a guard band that bounds bf16's error on that margin:

* multiple choice and BoolQ: the gap between the chosen answer's score and the runner-up's under the primary metric
  (HellaSwag's ``acc_norm``, BoolQ's ``acc``); its error is bounded by the spread of the answers' score errors (the
  largest minus the smallest, so a shift shared by all answers, such as the softmax normaliser, costs nothing);
* arithmetic (teacher-forced greedy match): the smallest per-token margin of the target (target logit minus the best
  other), whose sign is the decision; its error is the difference of the two precisions' smallest margins.

The band comes from evidence (:class:`Guard`): before bf16 is trusted, a random sample of pairs is computed in both
precisions, and the band is ``multiple`` times the largest error seen, per unit of the item's *error scale*
(:func:`error_scales`: what drives the error, so that a short answer is not given a long one's band). Every later call
audits a small random share of the pairs outside the band in both precisions too; any error larger than seen before
widens the band for the rest of the run (and rechecks what the wider band takes in), and an audited decision that
differs between the precisions, outside the band, means the evidence was wrong: that call and every later one are
computed in fp32 (the run *falls back*) and the artifact says so.

What is exact and what is not. A guarded decision under the primary metric (``correct``, the chosen answer) equals
fp32's (up to fp32's own float ties, which the fast engine and the naive path share). The numbers beside the decisions
are not fp32's: a pair outside the band keeps bf16's margin and scores, and its secondary metric (HellaSwag's ``acc``,
reported beside ``acc_norm``) is bf16's, approximate. The store keeps bf16 statistics under a bf16 context (its key has the dtype) and fp32's under
fp32's, so neither is ever served as the other; guarded outcomes themselves are composed anew from those each call,
and the rechecked pairs (stacked otherwise than the full product) are not stored. Generation (MBPP) is not guarded
yet: under ``guarded`` it decodes in fp32.
"""
from __future__ import annotations

import copy
import dataclasses
import warnings
import weakref
from typing import Iterable, Sequence

import numpy as np
import torch

from cel_utils.evaluation.evaluator import Intervention
from cel_utils.models.heads import HeadId, format_heads
from cel_utils.models.loading import LoadedModel
from cel_utils.tasks.scoring import ContinuationStats, Outcome

# The stated safety multiple: the band is this many times the largest error the audit saw (per unit of error scale).
SAFETY_MULTIPLE = 2.0
AUDIT_PAIRS = 256  # pairs computed in both precisions before bf16 is trusted
AUDIT_SHARE = 0.02  # of the pairs outside the band, in every later call


def resolve_precision(precision: str, device: torch.device | str) -> str:
    """``auto``: ``guarded`` where ``device`` computes bf16 natively (a CUDA GPU, a CPU with bf16 units), else
    ``fp32``; any other choice as given."""
    from cel_utils.config import PRECISIONS

    if precision not in PRECISIONS:
        raise ValueError(f"unknown precision {precision!r}: choose from {', '.join(PRECISIONS)}")
    if precision != "auto":
        return precision
    from cel_utils.hardware import native_bf16

    return "guarded" if native_bf16(device) else "fp32"


_BF16_COPIES: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def bf16_model(lm: LoadedModel) -> LoadedModel:
    """A bfloat16 copy of ``lm``'s model (made once per model, kept while the model lives); ``lm`` if it is bf16."""
    if lm.dtype == torch.bfloat16:
        return lm
    copied = _BF16_COPIES.get(lm.model)
    if copied is None:
        copied = copy.deepcopy(lm.model).to(torch.bfloat16)
        _BF16_COPIES[lm.model] = copied
    return dataclasses.replace(lm, model=copied)


# --- margins and their errors ------------------------------------------------------------------------------------

def _choice_scores(task, request, stats: ContinuationStats) -> list[np.ndarray]:
    """The answers' scores under the task's primary metric (as :func:`cel_utils.tasks.scoring.decide_choice`).

    Only the primary one: it makes every decision the search, the holdout and the statistics use. Guarding HellaSwag's
    secondary ``acc`` too (unnormalised sums over ~20 tokens, bf16 errors up to 1.6 on 32 items x 13 interventions,
    against 0.02 for ``acc_norm``) sent every pair to fp32."""
    chars = np.asarray(request.choice_chars, dtype=np.float64)
    return [stats.ll if task.metric == "acc" else stats.ll / chars]


def decision_margin(kind: str, task, request, stats: ContinuationStats) -> float:
    """How far the pair's decision is from changing: >= 0; the decision can only differ in the other precision where
    this is within that precision's error."""
    if kind == "greedy":
        return abs(float(stats.greedy_margin[0]))
    gaps = []
    for scores in _choice_scores(task, request, stats):
        top = np.sort(scores)[::-1]
        gaps.append(top[0] - top[1])
    return float(min(gaps))


def margin_error(kind: str, task, request, low: ContinuationStats, high: ContinuationStats) -> float:
    """A bound on how far the decision margin moved between the precisions (see the module docstring)."""
    if kind == "greedy":
        return abs(float(low.greedy_margin[0]) - float(high.greedy_margin[0]))
    return float(max(np.ptp(a - b) for a, b in zip(_choice_scores(task, request, low), _choice_scores(task, request, high))))


def decision(kind: str, task, request, stats: ContinuationStats) -> tuple:
    """What the outcome takes from the pair: the greedy match, or the chosen answer under each metric."""
    if kind == "greedy":
        return (bool(stats.greedy[0]),)
    return tuple(int(np.argmax(scores)) for scores in _choice_scores(task, request, stats))


def error_scales(kind: str, requests: Sequence) -> np.ndarray:
    """Per request, what bf16's error on its decision margin grows with, in units the band is stated in: 1, one band per
    task (each run's guard sees one task).

    Measured on the default model (32 items x 13 interventions per task, 3-shot arithmetic_1dc): scaling by the answer's
    token count or the context's length did not narrow the band (the share of pairs inside a 2x band stayed 23-30%, or
    grew), and scaling by each item's own full-model error made it grow (38-84%): the error is not an item's property
    that one audited pair predicts. Kept as the place a better predictor goes."""
    return np.ones(len(requests))


# --- the guard -------------------------------------------------------------------------------------------------

@dataclasses.dataclass
class Guard:
    """The evidence about bf16's error in one run, shared by the run's evaluators, and what it decided."""

    multiple: float = SAFETY_MULTIPLE
    audit_pairs: int = AUDIT_PAIRS
    audit_share: float = AUDIT_SHARE
    seed: int = 0
    largest_ratio: float | None = None  # the largest error seen per unit of error scale; None before the audit
    largest_error: float = 0.0
    pairs: int = 0  # (item, intervention) pairs decided under the guard
    rechecked: int = 0  # of them, inside the band: recomputed in fp32
    audited: int = 0  # of them, outside the band but computed in fp32 too, as evidence
    caught: int = 0  # rechecked pairs whose bf16 decision differed from fp32's (plain bf16 would have got them wrong)
    differed: int = 0  # audited pairs outside the band whose decisions differed: the band was wrong
    fell_back: str | None = None  # why the run went on in fp32, if it did
    fp32_pairs: int = 0  # pairs computed in fp32 alone after the fall-back

    def __post_init__(self):
        self.rng = np.random.default_rng(self.seed)

    @property
    def band_ratio(self) -> float:
        return self.multiple * (self.largest_ratio or 0.0)

    def see(self, error: float, scale: float) -> None:
        self.largest_error = max(self.largest_error, error)
        self.largest_ratio = max(self.largest_ratio or 0.0, error / scale)

    def to_json(self) -> dict:
        return {"multiple": self.multiple, "band_per_unit_scale": self.band_ratio, "largest_error": self.largest_error,
                "largest_error_per_unit_scale": self.largest_ratio, "initial_audit_pairs": self.audit_pairs,
                "audit_share": self.audit_share, "pairs": self.pairs, "rechecked": self.rechecked,
                "share_rechecked": self.rechecked / self.pairs if self.pairs else None, "audited": self.audited,
                "bf16_decisions_caught": self.caught, "audited_decisions_differed": self.differed,
                "fell_back_to_fp32": self.fell_back, "pairs_after_fall_back": self.fp32_pairs}


class GuardedEvaluator:
    """An evaluator whose decisions are fp32's, computed mostly in bf16 (see the module docstring).

    ``exact`` is an :class:`~cel_utils.evaluation.engine.EngineEvaluator` on the fp32 model, ``fast`` the same on its
    bf16 copy (:func:`bf16_model`); attributes it does not define (``requests``, ``task``, ``lm``...) are ``exact``'s."""

    def __init__(self, exact, fast, guard: Guard):
        if exact.kind.name != fast.kind.name:
            raise ValueError("the guarded evaluator's two evaluators must score the same task")
        self.exact, self.fast, self.guard = exact, fast, guard
        self.scales = error_scales(exact.kind.name, exact.requests)

    def __getattr__(self, name: str):
        if name in ("exact", "fast", "guard"):  # not yet set: do not recurse
            raise AttributeError(name)
        return getattr(self.exact, name)

    def evaluate(self, interventions: Iterable[Iterable[HeadId]], desc: str | None = None) -> list[Outcome]:
        interventions = self.exact._canonical(interventions)
        unique = list(dict.fromkeys(interventions))
        if not self.exact.kind.loglikelihood:  # decoding is not guarded yet: fp32
            outcomes = self.exact.evaluate(unique, desc)
        elif self.guard.fell_back:
            outcomes = self.exact.evaluate(unique, desc)
            self.guard.fp32_pairs += len(unique) * len(self.exact.requests)
        else:
            outcomes = self._guarded(unique, desc)
        found = dict(zip(unique, outcomes))
        return [found[heads] for heads in interventions]

    def evaluate_one(self, heads: Iterable[HeadId] = ()) -> Outcome:
        return self.evaluate([heads])[0]

    def _guarded(self, unique: list[Intervention], desc: str | None) -> list[Outcome]:
        guard, kind, task, requests = self.guard, self.exact.kind.name, self.exact.task, self.exact.requests
        n = len(requests)
        stats = self.fast.continuation_stats(unique, desc)
        margins = np.array([[decision_margin(kind, task, requests[i], s[i]) for i in range(n)] for s in stats])
        pairs = [(u, i) for u in range(len(unique)) for i in range(n)]
        exact: dict[tuple[int, int], ContinuationStats] = {}

        def compute(todo: list[tuple[int, int]]) -> None:
            todo = [pair for pair in todo if pair not in exact]
            for pair, value in zip(todo, self.exact.pair_stats([(i, unique[u]) for u, i in todo])):
                exact[pair] = value
                guard.see(margin_error(kind, task, requests[pair[1]], stats[pair[0]][pair[1]], value), self.scales[pair[1]])

        if guard.largest_ratio is None:  # the first audit: before bf16 is trusted
            sample = guard.rng.choice(len(pairs), min(len(pairs), guard.audit_pairs), replace=False)
            compute([pairs[j] for j in sorted(sample)])
        outside = np.ones(margins.shape, bool)
        audit: set = set()
        while True:  # a larger error seen widens the band: recheck what it takes in, until it holds
            inside = margins <= guard.band_ratio * self.scales[None, :]
            todo = [(u, i) for u, i in zip(*np.nonzero(inside & outside))]
            outside &= ~inside
            candidates = [(u, i) for u, i in zip(*np.nonzero(outside)) if (u, i) not in exact]
            picked = guard.rng.random(len(candidates)) < guard.audit_share if candidates else []
            audit.update(pair for pair, chosen in zip(candidates, picked) if chosen)
            before = guard.band_ratio
            compute(todo + sorted(audit))
            if guard.band_ratio <= before:
                break
        inside_pairs = [pair for pair in exact if not outside[pair]]
        outside_pairs = [pair for pair in exact if outside[pair]]
        differs = [pair for pair in outside_pairs if decision(kind, task, requests[pair[1]], stats[pair[0]][pair[1]])
                   != decision(kind, task, requests[pair[1]], exact[pair])]
        guard.pairs += len(pairs)
        guard.rechecked += len(inside_pairs)
        guard.audited += len(outside_pairs)
        guard.caught += sum(decision(kind, task, requests[i], stats[u][i]) != decision(kind, task, requests[i], exact[u, i])
                            for u, i in inside_pairs)
        if differs:
            guard.differed += len(differs)
            u, i = differs[0]
            guard.fell_back = (f"{self.exact.task.name}: an audited bf16 decision differed from fp32's outside the band "
                               f"(item {requests[i].item_id}, {format_heads(unique[u])}, bf16 margin "
                               f"{margins[u, i]:.4g}, band {guard.band_ratio * self.scales[i]:.4g}); the rest of the run "
                               "is computed in fp32")
            warnings.warn(guard.fell_back, RuntimeWarning, stacklevel=3)
            guard.pairs -= len(pairs)  # this call is fp32's after all
            guard.fp32_pairs += len(pairs)
            return self.exact.evaluate(unique, desc)
        merged = [[exact.get((u, i), stats[u][i]) for i in range(n)] for u in range(len(unique))]
        return [self.exact.decide(per) for per in merged]
