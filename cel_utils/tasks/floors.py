"""The floors under an accuracy: what a model scores on the same items without reading them.

An accuracy means little without the trivial baselines beside it. For the holdout items themselves:

* **chance**: the expected accuracy of a uniform random choice among an item's answers (multiple choice only; an open
  answer, as arithmetic's, has no chance level worth the name);
* **best constant answer**: the best accuracy of one answer given to every item, which for multiple choice is the
  *majority class* (always "yes" on BoolQ; always ending k on HellaSwag), and for arithmetic the most common gold
  answer. MBPP has none: every item asks for its own function, so no one program answers them all.

A model at or below its best constant answer has not shown the capability the task measures, and a gain that lifts it
there may be a shift of response bias rather than an ability (the calibration baseline tests that,
:mod:`cel_utils.stats.calibration`). Which floors a task has is its kind's (:mod:`cel_utils.evaluation.kinds`).
"""
from __future__ import annotations

from collections import Counter
from typing import Sequence

import numpy as np

from cel_utils.tasks.specs import Item, TaskSpec


def _constant(answer: str, accuracy: float, what: str) -> dict:
    return {"answer": answer, "accuracy": accuracy, "what": what}


def choice_floors(task: TaskSpec, items: Sequence[Item]) -> dict:
    """Chance and the majority class of a multiple-choice holdout; with one label set for every item (BoolQ's "no" /
    "yes"), the labels and each one's share among the gold answers."""
    answers = [task.answers(item.doc) for item in items]
    golds = np.array([gold for _, gold in answers])
    n_choices = {len(choices) for choices, _ in answers}
    shared = len({tuple(choices) for choices, _ in answers}) == 1
    labels = [c.strip() for c in answers[0][0]] if shared else [f"ending {k}" for k in range(max(n_choices))]
    shares = [float((golds == k).mean()) for k in range(len(labels))]
    best = int(np.argmax(shares))
    return {"n_items": len(items), "chance": float(np.mean([1 / len(choices) for choices, _ in answers])),
            "best_constant": _constant(labels[best], shares[best], "majority class"),
            "labels": labels, "labels_shared": shared, "gold_shares": shares}


def greedy_floors(task: TaskSpec, items: Sequence[Item]) -> dict:
    """An open answer: no chance level; the best constant answer is the most common gold answer."""
    counts = Counter(task.doc_to_target(item.doc).strip() for item in items)
    answer, count = counts.most_common(1)[0]
    return {"n_items": len(items), "chance": None, "best_constant": _constant(answer, count / len(items),
                                                                               "most common answer"),
            "labels": None, "labels_shared": False, "gold_shares": None}


def no_floors(task: TaskSpec, items: Sequence[Item]) -> dict:
    """Generation judged by running code: no chance level and no constant answer (each item asks for its own
    function), so the floor is 0."""
    return {"n_items": len(items), "chance": None, "best_constant": None, "labels": None, "labels_shared": False,
            "gold_shares": None, "note": "no constant answer: every item asks for its own function"}


def floor_of(floors: dict | None) -> float:
    """The highest trivial accuracy (chance, best constant answer), 0 where there is none; NaN without floors."""
    if not floors:
        return float("nan")
    values = [floors.get("chance"), (floors.get("best_constant") or {}).get("accuracy")]
    return max([v for v in values if v is not None], default=0.0)


def answer_shares(predictions: Sequence, n_answers: int) -> list[float] | None:
    """The share of items on which a multiple-choice model gave each answer (predictions are answer indices)."""
    picked = [p for p in predictions if isinstance(p, int)]
    if not picked or len(picked) != len(predictions):
        return None
    counts = np.bincount(np.asarray(picked), minlength=n_answers)
    return [float(c) / len(picked) for c in counts]


def changed_answers(before: Sequence, after: Sequence) -> dict[tuple[int, int], int]:
    """How many items moved from answer i to answer j (i != j), most frequent first."""
    moves = Counter((a, b) for a, b in zip(before, after) if isinstance(a, int) and isinstance(b, int) and a != b)
    return dict(moves.most_common())
