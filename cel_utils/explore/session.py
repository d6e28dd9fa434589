"""What the explorer computes, without any widget: one model, one task and its items, and head sets to compare.

Every number goes through the run's own machinery: the evaluator :func:`cel_utils.pipeline.protocol.make_evaluator`
builds from the run's settings (the fast engine or the naive path, the store, the prompt format), the ablation hook
and the paired test the run pages report, so an item's answer or a head set's gain shown here is the one a run of the
same settings computes for it.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Sequence

import numpy as np

from cel_utils.config import DEFAULT_MODEL, RunConfig
from cel_utils.evaluation.evaluator import Evaluator
from cel_utils.evaluation.kinds import TaskKind, kind_of
from cel_utils.evaluation.store import EvalStore
from cel_utils.models.heads import HeadId, format_heads, head_set
from cel_utils.models.loading import LoadedModel
from cel_utils.progress import ProgressSink
from cel_utils.stats.significance import CI_STREAM, PairedTest, paired_test
from cel_utils.tasks.scoring import Outcome
from cel_utils.tasks.specs import Item, TaskSpec
from cel_utils.tasks.splits import TaskData, load_task_data

SPLITS = ("discovery", "holdout")
OWN = "__own_prompt__"  # marks a typed prompt's document (its text and answers are the user's, not the dataset's)
GREEDY_ANSWER_TOKENS = 12  # a teacher-forced task's shown answer: a short greedy continuation, as the run pages show


@dataclass
class ItemView:
    """One prompt under the full and the ablated model: each one's outcome on that single item and its answer as text."""

    label: str  # "holdout #3 (validation/2649)" or "own prompt"
    prompt: str  # the item's text (without the few-shot exemplars)
    heads: tuple[HeadId, ...]
    kind: TaskKind  # the task's kind: how its answers read (cel_utils.evaluation.kinds)
    metric: str
    options: list[str]  # a multiple-choice item's answers; [] otherwise
    gold: str  # the right answer as the run pages show it
    gold_index: int | None  # a multiple-choice item's right option
    full: Outcome
    ablated: Outcome
    full_answer: str
    ablated_answer: str

    @property
    def flipped(self) -> bool:
        return bool(self.full.correct[0] != self.ablated.correct[0])


@dataclass
class Score:
    """A head set on the first ``n`` items of a split: both outcomes and the paired test, as a run page reports it."""

    split: str
    heads: tuple[HeadId, ...]
    full: Outcome
    ablated: Outcome
    test: PairedTest
    floors: dict | None = None  # chance and the best constant answer on the same items (cel_utils.tasks.floors)

    @property
    def n(self) -> int:
        return len(self.full.correct)


def _own_task(task: TaskSpec) -> TaskSpec:
    """The task, reading a typed prompt's text and answers from its document as its kind says (exemplars keep the
    dataset's)."""
    def own(read, original):
        return lambda doc: read(doc) if OWN in doc else original(doc)

    reads = kind_of(task).typed_prompt.reads
    if not reads:  # read like a dataset row (MBPP: the typed text is the task's description)
        return dataclasses.replace(task)
    changes = {name: own(read, getattr(task, name)) for name, read in reads.items()}
    return dataclasses.replace(task, validate=None, **changes)


class ExploreSession:
    """A model, a task's items and the run settings the numbers are computed with."""

    def __init__(self, config: RunConfig, lm: LoadedModel | None = None, data: TaskData | None = None):
        from cel_utils.pipeline.protocol import load_for

        self.config = config.validate()
        self.data = data or load_task_data(config.task, config.n_discovery, config.n_holdout, seed=config.seed,
                                           num_fewshot=config.num_fewshot, data_dir=config.data_dir)
        self.lm = lm or load_for(config)
        self.store = EvalStore() if config.cache else None
        self.kind = kind_of(self.data.task)
        self._single: dict[tuple[str, int], Evaluator] = {}

    @classmethod
    def open(cls, model: str = DEFAULT_MODEL, task: str = "hellaswag", seed: int = 0, preset: str = "cpu",
             lm: LoadedModel | None = None, **settings) -> "ExploreSession":
        """A session with the settings a run of (model, task, seed, preset) would use; ``settings`` override them."""
        return cls(RunConfig.from_dict({"model": model, "task": task, "seed": seed, "preset": preset, **settings}), lm)

    @classmethod
    def from_artifact(cls, path: str | Path, lm: LoadedModel | None = None) -> "ExploreSession":
        """A session with the settings of the run that wrote the artifact (so the same items, prompts and model)."""
        from cel_utils.explore.runs import load_run

        run = load_run(path)
        session = cls(run.config, lm)
        run.check_items(session.data)
        return session

    @property
    def task(self) -> TaskSpec:
        return self.data.task

    @property
    def heads(self) -> list[HeadId]:
        return self.lm.geometry.all_heads()

    def items(self, split: str) -> list[Item]:
        if split not in SPLITS:
            raise ValueError(f"unknown split {split!r}: choose discovery or holdout")
        return getattr(self.data, split)

    def item(self, split: str, index: int) -> Item:
        items = self.items(split)
        if not 0 <= index < len(items):
            raise ValueError(f"{split} has items 0..{len(items) - 1}; index {index} is outside them")
        return items[index]

    def find(self, text: str, split: str, limit: int = 50) -> list[int]:
        """Indices of the split's items whose text or answers contain ``text`` (case-insensitive), at most ``limit``."""
        needle = text.strip().lower()
        if not needle:
            return []
        found = []
        for index, item in enumerate(self.items(split)):
            if needle in self._searchable(item.doc).lower():
                found.append(index)
                if len(found) == limit:
                    break
        return found

    def _searchable(self, doc: dict) -> str:
        task = self.task
        answers = task.doc_to_choices(doc) if task.doc_to_choices else [task.doc_to_target(doc)]
        return "\n".join([task.doc_to_text(doc), *answers])

    def evaluator(self, items: Sequence[Item], progress: bool | str | ProgressSink = False, *, stored: bool = True,
                  task: TaskSpec | None = None) -> Evaluator:
        """The evaluator a run builds for ``items`` with these settings; ``stored``: it reads and writes the session's
        store (when the settings keep one)."""
        from cel_utils.pipeline.protocol import make_evaluator

        data = self.data if task is None else dataclasses.replace(self.data, task=task)
        config = self.config if stored else dataclasses.replace(self.config, cache=False)
        return make_evaluator(self.lm, data, items, config, progress, self.store if stored else None)

    # One item ----------------------------------------------------------------------------------------------------

    def view(self, split: str, index: int, heads: Iterable[HeadId | str] = ()) -> ItemView:
        """Item ``index`` of ``split`` under the full model and with ``heads`` ablated."""
        item = self.item(split, index)
        key = (split, index)
        if key not in self._single:
            self._single[key] = self.evaluator([item])
        return self._compare(self._single[key], item, f"{split} #{index} ({item.id})", heads)

    def view_prompt(self, text: str, heads: Iterable[HeadId | str] = (), *, options: Sequence[str] = (),
                    gold: int = 0, target: str = "", tests: Sequence[str] = ()) -> ItemView:
        """A typed prompt (after the task's few-shot exemplars, as an item's would be): a multiple-choice task's
        ``options`` and right ``gold`` index, a greedy-match task's ``target``, or MBPP's ``tests`` (assert lines)."""
        if not text.strip():
            raise ValueError("the prompt is empty: type a prompt")
        doc = {OWN: True, **self.kind.typed_prompt.document(text, options=options, gold=gold, target=target,
                                                             tests=tests)}
        task = _own_task(self.task)
        item = Item(id="own prompt", doc=doc)
        evaluator = self.evaluator([item], stored=False, task=task)  # the store is for the task's items only
        return self._compare(evaluator, item, "own prompt", heads, task)

    def _compare(self, evaluator: Evaluator, item: Item, label: str, heads, task: TaskSpec | None = None) -> ItemView:
        task = task or self.task
        heads = head_set(heads)
        full, ablated = evaluator.evaluate([(), heads], desc=f"full and {format_heads(heads)}")
        doc = item.doc
        if self.kind.predicts:
            answers = [self.kind.show(task, doc, o.predictions[0]) for o in (full, ablated)]
        else:  # teacher forced: a short greedy continuation shows what the model would say
            answers = [repr(a) for a in self._greedy_answers(evaluator, ((), heads))]
        choice = self.kind.compares_answers
        return ItemView(label=label, prompt=task.doc_to_text(doc), heads=heads, kind=self.kind, metric=task.metric,
                        options=list(task.doc_to_choices(doc)) if choice else [], gold=self.kind.show_gold(task, doc),
                        gold_index=task.doc_to_gold(doc) if choice else None, full=full, ablated=ablated,
                        full_answer=answers[0], ablated_answer=answers[1])

    def _greedy_answers(self, evaluator: Evaluator, head_sets) -> list[str]:
        from cel_utils.evaluation.generation import generate
        from cel_utils.tasks.prompts import GenRequest

        (request,) = evaluator.requests
        ask = [GenRequest(item_id=request.item_id, context=request.context, prompt=request.prompt, stop="\n",
                          tests=(), setup="", prefix="")]
        return [generate(self.lm, ask, heads, batch_size=1, max_new_tokens=GREEDY_ANSWER_TOKENS)[0]
                for heads in head_sets]

    # Many items ---------------------------------------------------------------------------------------------------

    def score(self, heads: Iterable[HeadId | str], split: str = "holdout", n: int | None = None,
              progress: bool | str | ProgressSink = False) -> Score:
        """The full model and ``heads`` ablated on the first ``n`` items of ``split`` (all: None), and their paired
        test with the run's seed (the interval is drawn as the run draws its holdout's)."""
        items = self.items(split)
        n = len(items) if n is None else n
        if not 1 <= n <= len(items):
            raise ValueError(f"{split} has {len(items)} items: score on 1..{len(items)}, got {n}")
        heads = head_set(heads)
        full, ablated = self.evaluator(items[:n], progress).evaluate([(), heads], desc=f"full and {format_heads(heads)}")
        test = paired_test(full.correct, ablated.correct, seed=[self.config.seed, CI_STREAM])
        floors = kind_of(self.task).floors(self.task, items[:n])
        return Score(split=split, heads=heads, full=full, ablated=ablated, test=test, floors=floors)


def option_scores(outcome: Outcome) -> np.ndarray | None:
    """A multiple-choice item's per-option scores under the primary metric (log-likelihood, or per character for
    acc_norm): what the decision compares. None for the other kinds."""
    return None if outcome.scores is None else np.asarray(outcome.scores[0], dtype=float)
