"""Algorithm 1: find at most k heads whose joint zero-ablation most improves discovery accuracy.

Stage 1 scores the full model and every single head on the discovery set and ranks them with the paper's key
(:mod:`cel_utils.search.ranking`: higher gain, lower harm, higher accuracy, fewer heads, head ids); a screened stage 1
(:mod:`cel_utils.search.screening`) scores only the heads a cheap screen ranks first. The top p single heads form the
pool. Stage 2 scores every subset of the pool of size 2..k (size 1 is reused from stage 1), ranks all subsets of size
1..k with the same key and freezes the best. Only the discovery evaluator is ever passed in here: the holdout cannot leak into
the selection. :func:`evaluate_holdout` then scores the frozen set once against the full model.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

from cel_utils.checks import check_int
from cel_utils.evaluation.evaluator import EvaluatorProtocol, Intervention
from cel_utils.models.heads import HeadId, format_heads, head_set
from cel_utils.search.ranking import Score, pool_subsets, rank, rank_singles, score
from cel_utils.search.screening import Screen
from cel_utils.tasks.scoring import Outcome, relative_error_reduction


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
    screen: Screen | None = None  # stage 1 was screened: only its top `keep` heads were evaluated exactly
    keep: int | None = None

    def stage1_json(self) -> dict:
        """How stage 1 ran, for the artifact: every head exactly, or a screen and how many heads it passed on (m)."""
        return {"method": "exact"} if self.screen is None else self.screen.to_json(self.keep)

    @property
    def frozen(self) -> Intervention:
        return self.best.heads


def check_search_params(p: int, k: int, n_heads: int) -> None:
    for name, value in (("p", p), ("k", k)):
        check_int(name, value)
    if p < k:
        raise ValueError(f"pool size p={p} is smaller than the budget k={k}: the subsets of size k come from the pool, so use p >= k")
    if p > n_heads:
        raise ValueError(f"pool size p={p} is larger than the model's {n_heads} heads: use p <= {n_heads}")


def run_search(discovery: EvaluatorProtocol, p: int = 10, k: int = 3, candidates: list[HeadId] | None = None,
               screen: Screen | None = None, keep: int | None = None) -> SearchResult:
    """Algorithm 1 on a discovery evaluator. ``candidates`` restricts stage 1 (default: every head).

    With a ``screen`` (:mod:`cel_utils.search.screening`), stage 1 evaluates exactly only the screen's top ``keep``
    heads (m) on the discovery items; the pool is the top p of those by the paper's key, and stage 2 is unchanged.
    With m at least the number of candidates, that is exact stage 1 itself.
    """
    geometry = discovery.lm.geometry
    candidates = geometry.all_heads() if candidates is None else list(candidates)
    if screen is not None:
        check_int("keep (m, the heads the screen passes on)", keep)
        if keep < p:
            raise ValueError(f"the screen passes on m={keep} heads, fewer than the pool size p={p}: the pool is drawn "
                             "from them, so use m >= p")
        candidates = screen.top(keep, candidates)
    check_search_params(p, k, len(candidates))
    timings = {}
    start = time.perf_counter()
    what = f"top {len(candidates)} heads of the {screen.method} screen" if screen else f"{len(candidates)} heads"
    outcomes = discovery.evaluate([()] + [(head,) for head in candidates], desc=f"stage 1: full + {what}")
    full = outcomes[0]
    stage1 = rank_singles(candidates, outcomes[1:], full)
    timings["stage1_s"] = time.perf_counter() - start

    pool = [s.heads for s in stage1[:p]]
    subsets = pool_subsets([heads[0] for heads in pool], k)
    start = time.perf_counter()
    subset_outcomes = discovery.evaluate(subsets, desc=f"stage 2: {len(subsets)} subsets of the pool") if subsets else []
    timings["stage2_s"] = time.perf_counter() - start
    stage2 = rank(stage1[:p] + [score(heads, out, full) for heads, out in zip(subsets, subset_outcomes)])
    return SearchResult(full=full, stage1=stage1, pool=pool, stage2=stage2, best=stage2[0], p=p, k=k,
                        timings=timings, n_evaluated=1 + len(candidates) + len(subsets), screen=screen,
                        keep=len(candidates) if screen else None)


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


def evaluate_holdout(holdout: EvaluatorProtocol, heads: Intervention) -> HoldoutResult:
    """One run of the full model and one of the frozen set on the holdout items."""
    full, ablated = holdout.evaluate([(), heads], desc="holdout: full + frozen")
    return HoldoutResult(heads=head_set(heads), full=full, ablated=ablated, score=score(head_set(heads), ablated, full))
