"""Search strategies side by side on the same discovery and holdout items.

* ``exhaustive`` -- the paper's Algorithm 1 (:func:`cel_utils.search.run_search`): every head alone, the top
  p form a pool, every subset of the pool of size 2..k;
* ``greedy`` -- forward selection over *all* heads: add the head that ranks best with the current set, stop
  at k heads or when no addition ranks above the best set so far;
* ``beam`` -- the same with the ``beam_width`` best sets kept at each size (width 1 is greedy);
* ``attribution pool`` -- attribution patching (:mod:`cel_utils.search.attribution`) ranks every head from one
  forward and backward pass; only its top ``attribution_candidates`` heads are evaluated exactly, and
  Algorithm 1 runs on them (``run_search`` restricted to those candidates);
* ``attribution top-k`` -- the k heads with the largest estimated margin gain, with no exact evaluation
  on discovery at all.

Every strategy ranks with the paper's key (:func:`cel_utils.search.rank`) and freezes the best-ranked set it
evaluated. They share one :class:`cel_utils.evaluation.outcomes.OutcomeTable`, so nothing is evaluated twice, but each
strategy's cost counts everything it asked for, as if it had run alone:

* ``evaluations``: distinct interventions scored on the whole discovery set (the full model included);
* ``forward_equivalents``: forward passes of the full model over one item. Scoring intervention S costs
  ``n_items * (L - l_S) / L``, with l_S the lowest layer of S (the layers below are reused, as the engine
  does; the full model runs all L); generation (MBPP) counts 1 per item per intervention (its decoding
  reuses the layers below only for the shared few-shot prefix, which this count ignores);
  attribution costs ``3 * n_items`` (a backward pass is about two forwards).

:func:`cel_utils.pipeline.strategies_run.compare_strategies` runs them all for one (model, task, seed); the notebook
``notebooks/cel_strategies.ipynb`` shows its summary.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterable

import numpy as np
from scipy import stats

from cel_utils.checks import check_int
from cel_utils.evaluation.evaluator import Intervention
from cel_utils.evaluation.outcomes import OutcomeTable, Wrapper
from cel_utils.models.heads import HeadId, head_set
from cel_utils.search.algorithm import run_search
from cel_utils.search.ranking import Score, rank, rank_key, rank_singles, score
from cel_utils.tasks.scoring import Outcome


class Ledger(Wrapper):
    """One strategy's view of the shared table: the table evaluates (each intervention once, for every strategy), the
    ledger records every distinct intervention this strategy asks for (its cost). An evaluator of the interface
    (:class:`~cel_utils.evaluation.evaluator.EvaluatorProtocol`): the search runs on it as on any other."""

    def __init__(self, table: OutcomeTable):
        self.table = table
        self.requested: dict[Intervention, None] = {}

    @property
    def inner(self) -> OutcomeTable:
        return self.table

    def evaluate(self, interventions: Iterable[Iterable[HeadId]], desc: str | None = None) -> list[Outcome]:
        interventions = [head_set(heads) for heads in interventions]
        self.requested.update(dict.fromkeys(interventions))
        return self.table.evaluate(interventions, desc=desc)

    def evaluate_one(self, heads: Iterable[HeadId] = ()) -> Outcome:
        return self.evaluate([heads])[0]


@dataclass
class StrategyResult:
    name: str
    selected: Intervention
    discovery: Score | None  # None: never scored exactly on discovery (attribution top-k before the summary)
    requested: list[Intervention] = field(default_factory=list)
    extra_forward_equivalents: float = 0.0  # attribution's forward + backward passes
    notes: str = ""


def forward_equivalents(interventions: list[Intervention], n_items: int, n_layers: int, generate: bool = False) -> float:
    """Cost of scoring ``interventions`` on ``n_items`` items (see the module docstring)."""
    if generate:
        return float(n_items * len(interventions))
    return float(sum(n_items * (n_layers - (min(h.layer for h in heads) if heads else 0)) / n_layers
                     for heads in interventions))


def exhaustive(table: OutcomeTable, p: int, k: int) -> StrategyResult:
    ledger = Ledger(table)
    result = run_search(ledger, p=p, k=k)
    return StrategyResult("exhaustive (paper)", result.frozen, result.best, list(ledger.requested),
                          notes=f"all heads alone, then every subset of the top {p}")


def beam(table: OutcomeTable, k: int, width: int = 1) -> StrategyResult:
    """Beam search over head sets of size 1..k, ``width`` sets kept per size (1: greedy forward selection)."""
    check_int("beam width", width)
    ledger = Ledger(table)
    heads = ledger.lm.geometry.all_heads()
    full = ledger.evaluate([()])[0]
    frontier: list[Intervention] = [()]
    evaluated: list[Score] = []
    for size in range(1, k + 1):
        candidates = list(dict.fromkeys(head_set(s + (h,)) for s in frontier for h in heads if h not in s))
        outcomes = ledger.evaluate(candidates, desc=f"beam {width}: {len(candidates)} sets of {size}")
        ranked = rank([score(c, o, full) for c, o in zip(candidates, outcomes)])
        best_before = rank(evaluated)[0] if evaluated else None
        evaluated += ranked
        if best_before is not None and rank_key(ranked[0]) > rank_key(best_before):
            break  # no set of this size ranks above the best smaller one: adding heads stopped helping
        frontier = [s.heads for s in ranked[:width]]
    best = rank(evaluated)[0]
    name = "greedy" if width == 1 else f"beam (width {width})"
    return StrategyResult(name, best.heads, best, list(ledger.requested), notes=f"over all {len(heads)} heads")


def attribution_pool(table: OutcomeTable, estimate: np.ndarray, p: int, k: int, candidates: int,
                     cost: float) -> StrategyResult:
    """Algorithm 1 on the ``candidates`` heads with the largest estimated gain."""
    ledger = Ledger(table)
    top = top_heads(estimate, candidates)
    result = run_search(ledger, p=p, k=k, candidates=top)
    return StrategyResult("attribution pool", result.frozen, result.best, list(ledger.requested), cost,
                          notes=f"top {candidates} heads by attribution, then Algorithm 1 on them")


def top_heads(estimate: np.ndarray, n: int) -> list[HeadId]:
    """The ``n`` heads with the largest estimate; ties by (layer, head)."""
    flat = [(-float(estimate[l, h]), HeadId(l, h)) for l in range(estimate.shape[0]) for h in range(estimate.shape[1])]
    return [head for _, head in sorted(flat)[:n]]


def _rank_correlation(method, x: np.ndarray, y: np.ndarray) -> float:
    """scipy's rank correlation, NaN (without a warning) when either side is constant, e.g. no head changed accuracy."""
    if np.ptp(x) == 0 or np.ptp(y) == 0:
        return float("nan")
    return float(method(x, y).statistic)


def screening_agreement(estimate: np.ndarray, table: OutcomeTable, p: int) -> dict:
    """Attribution against exact single-head screening: rank correlations and recall of the exact top p."""
    geometry = table.lm.geometry
    heads = geometry.all_heads()
    outcomes = table.evaluate([()] + [(h,) for h in heads])
    full, singles = outcomes[0], outcomes[1:]
    margin_effect = np.array([float(np.mean(o.margin - full.margin)) for o in singles])
    gain = np.array([score((h,), o, full).gain for h, o in zip(heads, singles)])
    flat = np.array([estimate[h.layer, h.head] for h in heads])
    exact_pool = [s.heads[0] for s in rank_singles(heads, singles, full)[:p]]
    shape = (geometry.n_layers, geometry.n_heads)
    return {
        "spearman_margin": _rank_correlation(stats.spearmanr, flat, margin_effect),
        "kendall_margin": _rank_correlation(stats.kendalltau, flat, margin_effect),  # tau-b: ties allowed
        "spearman_gain": _rank_correlation(stats.spearmanr, flat, gain),
        "kendall_gain": _rank_correlation(stats.kendalltau, flat, gain),
        "recall_at_p": len(set(exact_pool) & set(top_heads(estimate, p))) / p, "p": p,
        "exact_pool": [str(h) for h in exact_pool],
        "estimate": estimate.tolist(), "exact_margin_effect": margin_effect.reshape(shape).tolist(),
        "exact_gain_points": gain.reshape(shape).tolist(),
    }
