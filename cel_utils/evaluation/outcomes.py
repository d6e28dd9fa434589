"""Per-item outcomes of interventions on one fixed item list, each intervention evaluated at most once.

An intervention's per-item correctness on a fixed list of items is deterministic, so everything computed
from item subsets -- bootstrap resamples of the discovery set, other search strategies, the random-set null
-- can index vectors already computed instead of running the model again. :class:`OutcomeTable` wraps an
evaluator, answers from memory what it has seen, and sends only the missing interventions to the evaluator,
all in one batched ``evaluate`` call (the engine stacks them). It is itself an evaluator (same ``lm`` and
``evaluate``), so :func:`cel_utils.search.run_search` can run on it unchanged, and :class:`Resampled` is a
view of a table on a subset (with repeats) of its items, on which ``run_search`` runs unchanged too.
"""
from __future__ import annotations

from typing import Iterable, Sequence

import numpy as np

from cel_utils.evaluation.evaluator import Evaluator, Intervention
from cel_utils.models.heads import HeadId, head_set
from cel_utils.tasks.scoring import Outcome


def take(outcome: Outcome, indices: Sequence[int] | np.ndarray) -> Outcome:
    """The outcome restricted to the items at ``indices`` (in that order, repeats allowed)."""
    indices = np.asarray(indices, dtype=int)
    predictions = [outcome.predictions[i] for i in indices] if outcome.predictions else []
    return Outcome(item_ids=[outcome.item_ids[i] for i in indices], correct=outcome.correct[indices],
                   margin=outcome.margin[indices], metrics={name: v[indices] for name, v in outcome.metrics.items()},
                   predictions=predictions, scores=None if outcome.scores is None else outcome.scores[indices])


class OutcomeTable:
    """A memo of ``intervention -> Outcome`` in front of an evaluator.

    ``requested`` holds every distinct intervention asked for (served from memory or not), ``evaluated`` the
    ones the wrapped evaluator actually ran, in order; both are cost accounts. Attributes the table does not
    define (``items``, ``requests``, ``task``...) are the wrapped evaluator's.
    """

    def __init__(self, evaluator: Evaluator, known: dict[Intervention, Outcome] | None = None):
        self.evaluator = evaluator
        self.outcomes: dict[Intervention, Outcome] = {}
        self.evaluated: list[Intervention] = []
        self.requested: dict[Intervention, None] = {}  # insertion-ordered set
        self.calls = 0
        for heads, outcome in (known or {}).items():
            self.add(heads, outcome)

    def __getattr__(self, name: str):
        if name == "evaluator":  # not yet set (e.g. while unpickling): do not recurse
            raise AttributeError(name)
        return getattr(self.evaluator, name)

    def __contains__(self, heads: Iterable[HeadId]) -> bool:
        return head_set(heads) in self.outcomes

    def __len__(self) -> int:
        return len(self.outcomes)

    def add(self, heads: Iterable[HeadId], outcome: Outcome) -> None:
        """Record an outcome computed elsewhere (e.g. the holdout's full and frozen runs)."""
        self.outcomes[head_set(heads)] = outcome

    def missing(self, interventions: Iterable[Iterable[HeadId]]) -> list[Intervention]:
        """The distinct interventions not in the table yet, in first-seen order."""
        wanted = dict.fromkeys(head_set(heads) for heads in interventions)
        return [heads for heads in wanted if heads not in self.outcomes]

    def evaluate(self, interventions: Iterable[Iterable[HeadId]], desc: str | None = None) -> list[Outcome]:
        interventions = [head_set(heads) for heads in interventions]
        self.requested.update(dict.fromkeys(interventions))
        todo = self.missing(interventions)
        if todo:
            self.calls += 1
            for heads, outcome in zip(todo, self.evaluator.evaluate(todo, desc=desc)):
                self.outcomes[heads] = outcome
            self.evaluated += todo
        return [self.outcomes[heads] for heads in interventions]

    def evaluate_one(self, heads: Iterable[HeadId] = ()) -> Outcome:
        return self.evaluate([heads])[0]

    def correct_matrix(self, interventions: Sequence[Iterable[HeadId]]) -> np.ndarray:
        """Bool ``[interventions, items]``: per-item correctness, evaluating what is missing first."""
        return np.stack([outcome.correct for outcome in self.evaluate(interventions)])


class Resampled:
    """A table seen through item ``indices``: the evaluator Algorithm 1 would see on a resampled item set.

    Evaluation goes through the table (so anything missing is evaluated once, on all items) and is then
    indexed; ``run_search`` on this view is Algorithm 1 on the resampled items, with the same ranking.
    """

    def __init__(self, table: OutcomeTable, indices: Sequence[int] | np.ndarray):
        self.table, self.indices = table, np.asarray(indices, dtype=int)

    @property
    def lm(self):
        return self.table.lm

    def evaluate(self, interventions: Iterable[Iterable[HeadId]], desc: str | None = None) -> list[Outcome]:
        return [take(outcome, self.indices) for outcome in self.table.evaluate(interventions, desc=desc)]
