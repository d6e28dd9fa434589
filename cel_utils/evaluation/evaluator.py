"""Evaluators: score many interventions (head sets) on one fixed list of items.

An evaluator is built once per (model, task, items, prompt format) -- tokenization happens there -- and
then answers ``evaluate([heads, heads, ...]) -> [Outcome, ...]``. The search, the holdout evaluation, the screens and
the statistics only ever talk to one interface, :class:`EvaluatorProtocol`, so the fast engine
(:mod:`cel_utils.evaluation.engine`) and the naive reference path are interchangeable and can be checked against each
other, and the evaluators built on them (a memo of outcomes, its view on resampled items, the guarded precision) are
evaluators too.

With a ``store`` (:class:`cel_utils.evaluation.store.EvalStore`) every finished evaluation is kept on disk as it
finishes and read back instead of recomputed, so a killed run resumes where it stopped.
"""
from __future__ import annotations

from typing import Iterable, Protocol, Sequence, runtime_checkable

import torch

from cel_utils.evaluation.kinds import TaskKind, kind_of
from cel_utils.evaluation.means import HeadMeans
from cel_utils.models.ablation import replaced_by_means
from cel_utils.progress import progress_bar
from cel_utils.tasks.prompts import resolve_bos
from cel_utils.evaluation.store import EvalStore, StoreContext, batch_key, request_digest
from cel_utils.models.heads import HeadId, format_heads, head_set
from cel_utils.models.loading import LoadedModel
from cel_utils.sandbox import MEMORY_MB, TIMEOUT_S
from cel_utils.tasks.scoring import Outcome, loglikelihoods_naive
from cel_utils.tasks.specs import Item, TaskSpec

Intervention = tuple[HeadId, ...]


@runtime_checkable
class EvaluatorProtocol(Protocol):
    """What the search, the screens, the statistics and the pipeline use of an evaluator, and all they may use.

    Implemented by the plain evaluators (:class:`Evaluator`: :class:`NaiveEvaluator` and the engine), the memo in front
    of one (:class:`~cel_utils.evaluation.outcomes.OutcomeTable`), its view on resampled items
    (:class:`~cel_utils.evaluation.outcomes.Resampled`) and the guarded precision's evaluator
    (:class:`~cel_utils.evaluation.guarded.GuardedEvaluator`), each declaring every member: none forwards the attributes
    it does not name, so what a wrapper lacks fails where it is asked for, never answered by the wrong evaluator.
    """

    @property
    def lm(self) -> LoadedModel:
        """The model whose heads the interventions name (the float32 one under the guarded precision)."""

    @property
    def task(self) -> TaskSpec: ...

    @property
    def kind(self) -> TaskKind: ...

    @property
    def items(self) -> list[Item]:
        """The items evaluated: an outcome's vectors are in their order."""

    @property
    def requests(self) -> list:
        """One request per item: its tokenized prompt (and answers)."""

    @property
    def n_tokens(self) -> int:
        """Prompt (and answer) tokens per pass over the items (a cost unit for reports)."""

    def evaluate(self, interventions: Iterable[Iterable[HeadId]], desc: str | None = None) -> list[Outcome]: ...

    def evaluate_one(self, heads: Iterable[HeadId] = ()) -> Outcome: ...

    def sibling(self, items: Sequence[Item] | None = None, *, lm: LoadedModel | None = None,
                with_store: bool = True) -> Evaluator:
        """A new plain evaluator deciding as this one does, with every setting it was built with, on ``items``
        (default: its own, in order, repeats included) or on another copy of the model (``lm``, e.g. a bfloat16 one);
        ``with_store=False``: without the store. The one way to make an evaluator like another (the screens do)."""


class Evaluator:
    """Shared setup: requests built once; subclasses implement :meth:`_evaluate` on distinct interventions."""

    store_kind = "naive-1"  # names the computation in the store's key: change it whenever its numbers change
    # The modules whose code computes what this evaluator stores: tests/test_store_versions.py records their sha256
    # per store_kind and fails when they change while store_kind stays the same (a stale store would serve old numbers).
    store_sources = ("cel_utils.evaluation.evaluator", "cel_utils.evaluation.generation", "cel_utils.tasks.scoring",
                     "cel_utils.models.ablation", "cel_utils.models.plumbing")

    def __init__(self, lm: LoadedModel, task: TaskSpec, items: Sequence[Item], fewshot: Sequence[Item] = (), *,
                 fmt: str = "plain", bos: str = "auto", batch_size: int = 8, max_new_tokens: int = 256,
                 exec_timeout_s: float = TIMEOUT_S, exec_memory_mb: int = MEMORY_MB,
                 progress: bool | str = True, store: EvalStore | None = None, means: HeadMeans | None = None):
        self.lm, self.task, self.items = lm, task, list(items)
        # Every keyword setting as given: what sibling() passes on, so that no setting is dropped there.
        self.settings = dict(fmt=fmt, bos=bos, batch_size=batch_size, max_new_tokens=max_new_tokens,
                             exec_timeout_s=exec_timeout_s, exec_memory_mb=exec_memory_mb, progress=progress,
                             store=store, means=means)
        # Mean-ablation (cel_utils.evaluation.means): every intervention replaces its heads by these means, not zero.
        self.means = means
        self.fmt, self.batch_size, self.max_new_tokens = fmt, batch_size, max_new_tokens
        self.exec_timeout_s, self.exec_memory_mb, self.progress = exec_timeout_s, exec_memory_mb, progress
        self.fewshot = list(fewshot)
        self.fewshot_ids = [item.id for item in fewshot]
        self.store, self._stored, self._stored_state, self._digests = store, None, None, None
        self.kind = kind_of(task)
        self.bos = resolve_bos(lm.tokenizer, bos)
        self.requests = self.kind.build_requests(task, self.items, list(fewshot), lm.tokenizer, fmt, self.bos)

    @property
    def n_tokens(self) -> int:
        """Prompt (and answer) tokens per pass over the items (a cost unit for reports)."""
        return sum(r.n_tokens for r in self.requests)

    def progress_bar(self, total: int, desc: str | None):
        """Progress over ``total`` interventions in the evaluator's mode (:mod:`cel_utils.progress`)."""
        return progress_bar(total, f"{self.task.name}: {desc or 'evaluating'}", self.progress)

    def decide(self, raw: list) -> Outcome:
        """The task's decisions from one intervention's statistics (or completions) on every item."""
        return self.kind.decide(self.task, self.requests, raw, timeout_s=self.exec_timeout_s,
                                memory_mb=self.exec_memory_mb)

    def _canonical(self, interventions: Iterable[Iterable[HeadId]]) -> list[Intervention]:
        canonical = [head_set(heads) for heads in interventions]
        for heads in canonical:
            for head in heads:
                self.lm.geometry.check(head)
        return canonical

    def evaluate(self, interventions: Iterable[Iterable[HeadId]], desc: str | None = None) -> list[Outcome]:
        interventions = self._canonical(interventions)
        unique = list(dict.fromkeys(interventions))  # each distinct intervention is computed (and stored) once
        with self.ablation():
            outcomes = dict(zip(unique, self._evaluate(unique, desc)))
        return [outcomes[heads] for heads in interventions]

    def ablation(self):
        """The block inside which this evaluator's ablations happen: zero (nothing set), or its means."""
        return replaced_by_means(self.lm.model, None if self.means is None else self.means.values, self.lm.geometry)

    @property
    def ablation_name(self) -> str:
        return "zero" if self.means is None else "mean"

    def _evaluate(self, interventions: list[Intervention], desc: str | None) -> list[Outcome]:
        raise NotImplementedError

    def evaluate_one(self, heads: Iterable[HeadId] = ()) -> Outcome:
        return self.evaluate([heads])[0]

    def sibling(self, items: Sequence[Item] | None = None, *, lm: LoadedModel | None = None,
                with_store: bool = True) -> Evaluator:
        """This evaluator's class and :attr:`settings` on ``items`` or ``lm`` (see :class:`EvaluatorProtocol`)."""
        settings = self.settings if with_store else {**self.settings, "store": None}
        return type(self)(lm or self.lm, self.task, self.items if items is None else items, self.fewshot, **settings)

    # The store -------------------------------------------------------------------------------------------

    def store_fields(self) -> dict:
        """Everything besides items and intervention that the stored numbers depend on.

        The attention kernel and the torch and transformers versions are in it because each computes the same
        quantity with other float rounding (sdpa against eager is ~1e-6 apart, a library upgrade can change a kernel),
        and the store promises numbers bit for bit as a fresh run would compute them.
        """
        import transformers

        fields = {"evaluator": self.store_kind, "model": self.lm.fingerprint, "device": self.lm.device.type,
                  "dtype": str(self.lm.dtype).removeprefix("torch."), "task": self.task.name, "fmt": self.fmt,
                  "fewshot": self.fewshot_ids,
                  "attn_implementation": getattr(self.lm.model.config, "_attn_implementation", None),
                  "torch": torch.__version__, "transformers": transformers.__version__}
        if self.means is not None:  # zero-ablation's fields are those it always had (its records keep their names)
            fields.update(ablation="mean", means=self.means.sha256)
        if not self.kind.loglikelihood:
            from cel_utils.evaluation.generation import _stop_ids

            # where decoding stops besides the stop string: the tokenizer's and the generation config's eos ids
            fields.update(max_new_tokens=self.max_new_tokens, stop_ids=_stop_ids(self.lm))
        return fields

    @property
    def stored(self) -> StoreContext | None:
        """This evaluator's part of the store (None without a store). The model fingerprint is taken once per state of
        the model: a model cast or moved after the first evaluation (``lm.model.double()``) gets the part of its new
        dtype and device, never the numbers stored for the old ones."""
        if self.store is None:
            return None
        state = (self.lm.dtype, self.lm.device, getattr(self.lm.model.config, "_attn_implementation", None))
        if self._stored is None or self._stored_state != state:
            self._stored, self._stored_state = self.store.context(self.store_fields()), state
        return self._stored

    def store_key(self, indices: Iterable[int]) -> str:
        """The store's name for the requests at ``indices`` (in that order)."""
        if self._digests is None:
            self._digests = [request_digest(r) for r in self.requests]
        return batch_key(self._digests[i] for i in indices)

    def continuation_counts(self, indices: Iterable[int]) -> list[int]:
        return [len(self.requests[i].continuations) for i in indices]


class NaiveEvaluator(Evaluator):
    """The reference path: one full forward of the whole model per intervention, batch by batch.

    It stores one record per intervention over all items (its batches are of sequences, not items)."""

    def _evaluate(self, interventions: list[Intervention], desc: str | None) -> list[Outcome]:
        from cel_utils.evaluation.generation import generate

        everything = range(len(self.requests))
        key = self.store_key(everything) if self.stored else None
        generating = not self.kind.loglikelihood
        counts = None if generating else self.continuation_counts(everything)
        stored = {}
        if self.stored:
            stored = (self.stored.load_completions(key, len(self.requests)) if generating
                      else self.stored.load_stats(key, counts))
        outcomes = []
        progress = self.progress_bar(len(interventions), desc)
        for heads in interventions:
            progress.update(1)
            label = format_heads(heads)
            result = stored.get(label)
            if result is not None:
                self.stored.served(1)
            elif generating:
                result = generate(self.lm, self.requests, heads, batch_size=self.batch_size, max_new_tokens=self.max_new_tokens)
                if self.stored:
                    self.stored.save_completions(key, {label: result})
            else:
                result = loglikelihoods_naive(self.lm, self.requests, heads, batch_size=self.batch_size)
                if self.stored:
                    self.stored.save_stats(key, counts, {label: result})
            outcomes.append(self.decide(result))
        progress.close()
        return outcomes
