"""Algorithm 1: find at most k heads whose joint zero-ablation most improves discovery accuracy.

Stage 1 scores the full model and every single head on the discovery set. Interventions are ranked by

    higher gain, then lower harm, then higher accuracy, then fewer heads, then the sorted head ids in
    lexicographic (layer, head) order

where gain = acc(ablated) - acc(full) and harm counts examples the full model gets right and the ablated
model gets wrong (help is the reverse). The top p single heads form the pool. Stage 2 scores every subset
of the pool of size 2..k (size 1 is reused from stage 1), ranks all subsets of size 1..k with the same key
and freezes the best. Only the discovery evaluator is ever passed in here: the holdout cannot leak into
the selection. :func:`evaluate_holdout` then scores the frozen set once against the full model.

Counts are kept as integers, so ranking never depends on float rounding.
"""
from __future__ import annotations

import itertools
import math
import time
from dataclasses import dataclass, field

import numpy as np

from cel_utils.evaluation import Evaluator, Intervention
from cel_utils.heads import HeadId, format_heads, head_set
from cel_utils.scoring import Outcome


@dataclass(frozen=True)
class Score:
    """One intervention on one item set, relative to the full model on the same items."""

    heads: Intervention
    n_correct: int
    n_items: int
    gain_count: int  # n_correct(ablated) - n_correct(full)
    harm: int
    help: int
    screened: bool = False  # True: scored only by the low-precision screen, never re-evaluated exactly

    @property
    def accuracy(self) -> float:
        return self.n_correct / self.n_items

    @property
    def gain(self) -> float:
        """Gain in percentage points."""
        return 100.0 * self.gain_count / self.n_items

    def to_json(self) -> dict:
        payload = {"heads": [str(h) for h in self.heads], "accuracy": self.accuracy, "gain_points": self.gain,
                   "n_correct": self.n_correct, "harm": self.harm, "help": self.help}
        return {**payload, "screened": True} if self.screened else payload


def score(heads: Intervention, ablated: Outcome, full: Outcome, screened: bool = False) -> Score:
    if ablated.item_ids != full.item_ids:
        raise ValueError("ablated and full outcomes are over different items")
    a, f = ablated.correct, full.correct
    return Score(heads=heads, n_correct=int(a.sum()), n_items=len(a), gain_count=int(a.sum()) - int(f.sum()),
                 harm=int((f & ~a).sum()), help=int((~f & a).sum()), screened=screened)


def rank_key(s: Score) -> tuple:
    """The paper's ranking key; sorting ascending by it puts the best intervention first."""
    return (-s.gain_count, s.harm, -s.n_correct, len(s.heads), tuple((h.layer, h.head) for h in s.heads))


def rank(scores: list[Score]) -> list[Score]:
    return sorted(scores, key=rank_key)


@dataclass
class SearchResult:
    full: Outcome
    stage1: list[Score]  # ranked
    pool: list[Intervention]
    stage2: list[Score]  # all subsets of the pool of size 1..k, ranked
    best: Score
    p: int
    k: int
    timings: dict = field(default_factory=dict)
    n_evaluated: int = 0

    @property
    def frozen(self) -> Intervention:
        return self.best.heads


def check_search_params(p: int, k: int, n_heads: int) -> None:
    for name, value in (("p", p), ("k", k)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{name} must be a positive integer, got {value!r}")
    if p < k:
        raise ValueError(f"pool size p={p} is smaller than the budget k={k}: the subsets of size k come from the pool, so use p >= k")
    if p > n_heads:
        raise ValueError(f"pool size p={p} is larger than the model's {n_heads} heads: use p <= {n_heads}")


def run_search(discovery: Evaluator, p: int = 10, k: int = 3, candidates: list[HeadId] | None = None,
               screen: Evaluator | None = None, rescore: int | None = None) -> SearchResult:
    """Algorithm 1 on a discovery evaluator. ``candidates`` restricts stage 1 (default: every head).

    With a ``screen`` evaluator (the same items on a cheaper, e.g. bf16, copy of the model), stage 1 runs
    there first and only its top ``rescore`` heads (default 3p) are re-evaluated exactly; the pool is
    drawn from those exact scores, and stage 2 is exact. This is the opt-in fast mode: it is exact
    whenever the true top-p heads are within the screen's top ``rescore``.
    """
    geometry = discovery.lm.geometry
    candidates = geometry.all_heads() if candidates is None else list(candidates)
    check_search_params(p, k, len(candidates))
    timings = {}
    start = time.perf_counter()
    singles = [(head,) for head in candidates]
    if screen is None:
        outcomes = discovery.evaluate([()] + singles, desc=f"stage 1: full + {len(singles)} heads")
        full, single_outcomes = outcomes[0], outcomes[1:]
        stage1 = rank([score(heads, out, full) for heads, out in zip(singles, single_outcomes)])
    else:
        outcomes = screen.evaluate([()] + singles, desc=f"stage 1 screen: full + {len(singles)} heads")
        screened = rank([score(heads, out, outcomes[0], screened=True) for heads, out in zip(singles, outcomes[1:])])
        rescore = min(len(screened), rescore or 3 * p)
        top = [s.heads for s in screened[:rescore]]
        exact = discovery.evaluate([()] + top, desc=f"stage 1 rescore: full + top {rescore} heads")
        full = exact[0]
        stage1 = rank([score(heads, out, full) for heads, out in zip(top, exact[1:])]) + screened[rescore:]
        timings["stage1_screen_rescored"] = rescore
    timings["stage1_s"] = time.perf_counter() - start

    pool = [s.heads for s in stage1[:p]]
    pool_heads = [heads[0] for heads in pool]
    subsets = [head_set(c) for size in range(2, k + 1) for c in itertools.combinations(pool_heads, size)]
    start = time.perf_counter()
    subset_outcomes = discovery.evaluate(subsets, desc=f"stage 2: {len(subsets)} subsets of the pool") if subsets else []
    timings["stage2_s"] = time.perf_counter() - start
    stage2 = rank(stage1[:p] + [score(heads, out, full) for heads, out in zip(subsets, subset_outcomes)])
    return SearchResult(full=full, stage1=stage1, pool=pool, stage2=stage2, best=stage2[0], p=p, k=k,
                        timings=timings, n_evaluated=1 + len(singles) + len(subsets))


@dataclass
class HoldoutResult:
    heads: Intervention
    full: Outcome
    ablated: Outcome
    score: Score

    @property
    def full_accuracy(self) -> float:
        return self.full.accuracy

    @property
    def ablated_accuracy(self) -> float:
        return self.ablated.accuracy

    @property
    def gain(self) -> float:
        return self.score.gain

    @property
    def relative_error_reduction(self) -> float:
        """gain / (100 - full accuracy in %), in percent (paper's Table 1: 70.40 -> 83.50 gives 44.26%)."""
        return relative_error_reduction(100 * self.full_accuracy, 100 * self.ablated_accuracy)

    def summary(self) -> dict:
        return {"heads": [str(h) for h in self.heads], "heads_label": format_heads(self.heads),
                "full_accuracy": self.full_accuracy, "ablated_accuracy": self.ablated_accuracy,
                "gain_points": self.gain, "relative_error_reduction": self.relative_error_reduction,
                "harm": self.score.harm, "help": self.score.help, "n_items": self.score.n_items,
                "full_metrics": self.full.metric_means(), "ablated_metrics": self.ablated.metric_means()}


def relative_error_reduction(full_pct: float, ablated_pct: float) -> float:
    if full_pct >= 100.0:
        return float("nan")  # no error left to reduce
    return 100.0 * (ablated_pct - full_pct) / (100.0 - full_pct)


def evaluate_holdout(holdout: Evaluator, heads: Intervention) -> HoldoutResult:
    """One run of the full model and one of the frozen set on the holdout items."""
    full, ablated = holdout.evaluate([(), heads], desc="holdout: full + frozen")
    return HoldoutResult(heads=head_set(heads), full=full, ablated=ablated, score=score(head_set(heads), ablated, full))


def n_stage2(p: int, k: int) -> int:
    return sum(math.comb(p, size) for size in range(2, k + 1))


def flips(full: Outcome, ablated: Outcome) -> dict[str, np.ndarray]:
    """Indices of items that went wrong -> right (help) and right -> wrong (harm) under the ablation."""
    return {"wrong_to_right": np.flatnonzero(~full.correct & ablated.correct),
            "right_to_wrong": np.flatnonzero(full.correct & ~ablated.correct)}
