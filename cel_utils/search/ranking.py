"""The paper's ranking of interventions, and the candidates of each stage: one definition for every search.

Interventions are ranked by higher gain, then lower harm, then higher accuracy, then fewer heads, then the sorted head
ids in lexicographic (layer, head) order, where gain = acc(ablated) - acc(full) and harm counts items the full model
gets right and the ablated model gets wrong (help is the reverse). Counts are kept as integers, so ranking never
depends on float rounding.
"""
from __future__ import annotations

import itertools
import math
from dataclasses import dataclass
from typing import Sequence

from cel_utils.evaluation.evaluator import Intervention
from cel_utils.models.heads import HeadId, head_set
from cel_utils.tasks.scoring import Outcome


@dataclass(frozen=True)
class Score:
    """One intervention on one item set, relative to the full model on the same items."""

    heads: Intervention
    n_correct: int
    n_items: int
    gain_count: int  # n_correct(ablated) - n_correct(full)
    harm: int
    help: int

    @property
    def accuracy(self) -> float:
        return self.n_correct / self.n_items

    @property
    def gain(self) -> float:
        """Gain in percentage points."""
        return 100.0 * self.gain_count / self.n_items

    def to_json(self) -> dict:
        return {"heads": [str(h) for h in self.heads], "accuracy": self.accuracy, "gain_points": self.gain,
                "n_correct": self.n_correct, "harm": self.harm, "help": self.help}


def score(heads: Intervention, ablated: Outcome, full: Outcome) -> Score:
    if ablated.item_ids != full.item_ids:
        raise ValueError("ablated and full outcomes are over different items")
    a, f = ablated.correct, full.correct
    return Score(heads=heads, n_correct=int(a.sum()), n_items=len(a), gain_count=int(a.sum()) - int(f.sum()),
                 harm=int((f & ~a).sum()), help=int((~f & a).sum()))


def rank_key(s: Score) -> tuple:
    """The paper's ranking key; sorting ascending by it puts the best intervention first."""
    return (-s.gain_count, s.harm, -s.n_correct, len(s.heads), tuple((h.layer, h.head) for h in s.heads))


def rank(scores: list[Score]) -> list[Score]:
    return sorted(scores, key=rank_key)


def rank_singles(heads: Sequence[HeadId], outcomes: Sequence[Outcome], full: Outcome) -> list[Score]:
    """Stage 1's ranking: each head ablated alone, scored against the full model on the same items, best first."""
    return rank([score((head,), outcome, full) for head, outcome in zip(heads, outcomes)])


def pool_subsets(pool: Sequence[HeadId], k: int) -> list[Intervention]:
    """Stage 2's candidates: every subset of the pool of size 2..k (size 1 is stage 1's), in a fixed order."""
    return [head_set(c) for size in range(2, k + 1) for c in itertools.combinations(pool, size)]


def n_stage2(p: int, k: int) -> int:
    """How many subsets :func:`pool_subsets` gives for a pool of ``p`` heads."""
    return sum(math.comb(p, size) for size in range(2, k + 1))
