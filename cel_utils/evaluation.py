"""Evaluators: score many interventions (head sets) on one fixed list of items.

An evaluator is built once per (model, task, items, prompt format) -- tokenization happens there -- and
then answers ``evaluate([heads, heads, ...]) -> [Outcome, ...]``. The search, the holdout evaluation and
the statistics only ever talk to this interface, so the fast engine (:mod:`cel_utils.engine`) and the naive
reference path are interchangeable and can be checked against each other.
"""
from __future__ import annotations

from typing import Iterable, Sequence

from tqdm.auto import tqdm

from cel_utils.heads import HeadId, head_set
from cel_utils.models import LoadedModel
from cel_utils.prompts import build_gen_requests, build_requests
from cel_utils.scoring import Outcome, decide, loglikelihoods_naive
from cel_utils.tasks import Item, TaskSpec

Intervention = tuple[HeadId, ...]


class Evaluator:
    """Shared setup: requests built once; subclasses implement :meth:`evaluate`."""

    def __init__(self, lm: LoadedModel, task: TaskSpec, items: Sequence[Item], fewshot: Sequence[Item] = (), *,
                 fmt: str = "plain", batch_size: int = 8, max_new_tokens: int = 256, exec_timeout_s: float = 10.0,
                 progress: bool = True):
        self.lm, self.task, self.items = lm, task, list(items)
        self.fmt, self.batch_size, self.max_new_tokens = fmt, batch_size, max_new_tokens
        self.exec_timeout_s, self.progress = exec_timeout_s, progress
        model_type = lm.model.config.model_type
        if task.kind == "generate":
            self.requests = build_gen_requests(task, self.items, list(fewshot), lm.tokenizer, fmt, model_type)
        else:
            self.requests = build_requests(task, self.items, list(fewshot), lm.tokenizer, fmt, model_type)

    @property
    def n_tokens(self) -> int:
        """Prompt and answer tokens per pass over the items (a cost unit for reports)."""
        if self.task.kind == "generate":
            return sum(len(r.context) for r in self.requests)
        return sum(len(r.context) + sum(map(len, r.continuations)) for r in self.requests)

    def _canonical(self, interventions: Iterable[Iterable[HeadId]]) -> list[Intervention]:
        canonical = [head_set(heads) for heads in interventions]
        for heads in canonical:
            for head in heads:
                self.lm.geometry.check(head)
        return canonical

    def evaluate(self, interventions: Iterable[Iterable[HeadId]], desc: str | None = None) -> list[Outcome]:
        raise NotImplementedError

    def evaluate_one(self, heads: Iterable[HeadId] = ()) -> Outcome:
        return self.evaluate([heads])[0]


class NaiveEvaluator(Evaluator):
    """The reference path: one full forward of the whole model per intervention, batch by batch."""

    def evaluate(self, interventions: Iterable[Iterable[HeadId]], desc: str | None = None) -> list[Outcome]:
        interventions = self._canonical(interventions)
        outcomes = []
        for heads in tqdm(interventions, desc=desc or f"{self.task.name} (naive)", disable=not self.progress or len(interventions) < 2):
            if self.task.kind == "generate":
                from cel_utils.generation import generate, score_generations

                completions = generate(self.lm, self.requests, heads, batch_size=self.batch_size,
                                       max_new_tokens=self.max_new_tokens)
                outcomes.append(score_generations(self.requests, completions, timeout_s=self.exec_timeout_s))
            else:
                stats = loglikelihoods_naive(self.lm, self.requests, heads, batch_size=self.batch_size)
                outcomes.append(decide(self.task, self.requests, stats))
        return outcomes
