"""Per-item outcomes of interventions on one fixed item list, each intervention evaluated at most once.

An intervention's per-item correctness on a fixed list of items is deterministic, so everything computed
from item subsets -- bootstrap resamples of the discovery set, other search strategies, the random-set null
-- can index vectors already computed instead of running the model again. :class:`OutcomeTable` wraps an
evaluator, answers from memory what it has seen, and sends only the missing interventions to the evaluator,
all in one batched ``evaluate`` call (the engine stacks them). It is itself an evaluator
(:class:`~cel_utils.evaluation.evaluator.EvaluatorProtocol`), so :func:`cel_utils.search.run_search` can run on it
unchanged, and :class:`Resampled` is a view of a table on a subset (with repeats) of its items, an evaluator on which
``run_search`` runs unchanged too.
"""
from __future__ import annotations

from typing import Iterable, Sequence

import numpy as np

from cel_utils.evaluation.evaluator import Evaluator, EvaluatorProtocol, Intervention
from cel_utils.evaluation.kinds import TaskKind
from cel_utils.models.heads import HeadId, head_set
from cel_utils.models.loading import LoadedModel
from cel_utils.tasks.scoring import Outcome
from cel_utils.tasks.specs import Item, TaskSpec


def take(outcome: Outcome, indices: Sequence[int] | np.ndarray) -> Outcome:
    """The outcome restricted to the items at ``indices`` (in that order, repeats allowed)."""
    indices = np.asarray(indices, dtype=int)
    predictions = [outcome.predictions[i] for i in indices] if outcome.predictions else []
    return Outcome(item_ids=[outcome.item_ids[i] for i in indices], correct=outcome.correct[indices],
                   margin=outcome.margin[indices], metrics={name: v[indices] for name, v in outcome.metrics.items()},
                   predictions=predictions, scores=None if outcome.scores is None else outcome.scores[indices])


class Wrapper:
    """An evaluator in front of another (``inner``) that evaluates what it evaluates: the model, task, items, requests
    and siblings are the inner one's, declared here once for every wrapper (the outcome table, a strategy's ledger,
    the guarded evaluator: its fp32 engine); a wrapper adds ``evaluate`` and ``evaluate_one``."""

    @property
    def inner(self) -> EvaluatorProtocol:
        raise NotImplementedError

    @property
    def lm(self) -> LoadedModel:
        return self.inner.lm

    @property
    def task(self) -> TaskSpec:
        return self.inner.task

    @property
    def kind(self) -> TaskKind:
        return self.inner.kind

    @property
    def items(self) -> list[Item]:
        return self.inner.items

    @property
    def requests(self) -> list:
        return self.inner.requests

    @property
    def n_tokens(self) -> int:
        return self.inner.n_tokens

    def sibling(self, items: Sequence[Item] | None = None, *, lm: LoadedModel | None = None,
                with_store: bool = True) -> Evaluator:
        """The inner evaluator's sibling: a plain evaluator deciding as this one does."""
        return self.inner.sibling(items, lm=lm, with_store=with_store)


class OutcomeTable(Wrapper):
    """A memo of ``intervention -> Outcome`` in front of an evaluator.

    ``requested`` holds every distinct intervention asked for (served from memory or not), ``evaluated`` the
    ones the wrapped evaluator actually ran, in order; both are cost accounts. What it evaluates (``lm``, ``task``,
    ``items``, ``requests``...) is the wrapped evaluator's.
    """

    def __init__(self, evaluator: EvaluatorProtocol, known: dict[Intervention, Outcome] | None = None):
        self.evaluator = evaluator
        self.outcomes: dict[Intervention, Outcome] = {}
        self.evaluated: list[Intervention] = []
        self.requested: dict[Intervention, None] = {}  # insertion-ordered set
        self.calls = 0
        for heads, outcome in (known or {}).items():
            self.add(heads, outcome)

    @property
    def inner(self) -> EvaluatorProtocol:
        return self.evaluator

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
    def lm(self) -> LoadedModel:
        return self.table.lm

    @property
    def task(self) -> TaskSpec:
        return self.table.task

    @property
    def kind(self) -> TaskKind:
        return self.table.kind

    @property
    def items(self) -> list[Item]:
        return [self.table.items[i] for i in self.indices]

    @property
    def requests(self) -> list:
        return [self.table.requests[i] for i in self.indices]

    @property
    def n_tokens(self) -> int:
        return sum(r.n_tokens for r in self.requests)

    def evaluate(self, interventions: Iterable[Iterable[HeadId]], desc: str | None = None) -> list[Outcome]:
        return [take(outcome, self.indices) for outcome in self.table.evaluate(interventions, desc=desc)]

    def evaluate_one(self, heads: Iterable[HeadId] = ()) -> Outcome:
        return self.evaluate([heads])[0]

    def sibling(self, items: Sequence[Item] | None = None, *, lm: LoadedModel | None = None,
                with_store: bool = True) -> Evaluator:
        """A plain evaluator of the resampled items (repeats included), or of ``items``, with the table's settings."""
        return self.table.sibling(self.items if items is None else items, lm=lm, with_store=with_store)
