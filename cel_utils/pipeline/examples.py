"""Holdout items the ablation flipped, with what each model answered: computed while the model is loaded and stored
in the artifact, so the run page can be re-rendered from the artifact alone."""
from __future__ import annotations

from typing import Iterable

import numpy as np

from cel_utils.evaluation.generation import generate
from cel_utils.evaluation.kinds import kind_of
from cel_utils.models.loading import LoadedModel
from cel_utils.search.algorithm import HoldoutResult
from cel_utils.tasks.prompts import GenRequest, build_requests, resolve_bos
from cel_utils.tasks.splits import TaskData

PROMPT_CHARS = 300  # the end of the prompt a page shows


def prompt_end(prompt: str) -> str:
    """The end of a prompt as a page shows it: the whole prompt, or its last PROMPT_CHARS characters after "..."."""
    return prompt if len(prompt) <= PROMPT_CHARS else "..." + prompt[-PROMPT_CHARS:]


def flips(full, ablated) -> dict[str, np.ndarray]:
    """Indices of items that went wrong -> right (help) and right -> wrong (harm) under the ablation."""
    return {"wrong_to_right": np.flatnonzero(~full.correct & ablated.correct),
            "right_to_wrong": np.flatnonzero(full.correct & ~ablated.correct)}


def greedy_answers(lm: LoadedModel, data: TaskData, indices: Iterable[int], heads=(), *, fmt: str = "plain",
                   bos: str = "auto", batch_size: int = 8, max_new_tokens: int = 12) -> list[str]:
    """Short greedy answers for some holdout items of a teacher-forced task (arithmetic), for display.

    The prompt is exactly the one the scorer used; generation stops at a newline.
    """
    items = [data.holdout[i] for i in indices]
    if not items:
        return []
    scored = build_requests(data.task, items, data.fewshot, lm.tokenizer, fmt, resolve_bos(lm.tokenizer, bos))
    requests = [GenRequest(item_id=r.item_id, context=r.context, prompt=r.prompt, stop="\n", tests=(), setup="", prefix="")
                for r in scored]
    return generate(lm, requests, heads, batch_size=batch_size, max_new_tokens=max_new_tokens)


def flip_examples(lm: LoadedModel, data: TaskData, holdout: HoldoutResult, *, fmt: str = "plain", bos: str = "auto",
                  batch_size: int = 8, n: int = 3) -> list[dict]:
    """Up to ``n`` flipped holdout items per direction, as text: the end of the prompt, the right answer and both
    models' answers (the chosen option, the generated code and its test status, or for a teacher-forced task a short
    greedy answer generated here for these items only)."""
    task, kind = data.task, kind_of(data.task)
    picked = [(direction, int(i)) for direction, idx in flips(holdout.full, holdout.ablated).items() for i in idx[:n]]
    predictions = {"full": holdout.full.predictions, "ablated": holdout.ablated.predictions}
    if kind.predicts or not picked:
        answers = {name: {i: values[i] if i < len(values) else None for _, i in picked}
                   for name, values in predictions.items()}
    else:  # scored teacher forced: nothing was generated, so generate what the page shows
        indices = [i for _, i in picked]
        answers = {name: dict(zip(indices, greedy_answers(lm, data, indices, heads, fmt=fmt, bos=bos, batch_size=batch_size)))
                   for name, heads in (("full", ()), ("ablated", holdout.heads))}
    out = []
    for direction, i in picked:
        doc = data.holdout[i].doc
        prompt = task.doc_to_text(doc)
        out.append({"direction": direction, "item": data.holdout[i].id,
                    "prompt_end": prompt_end(prompt),
                    "gold": kind.show_gold(task, doc), "full": kind.show(task, doc, answers["full"][i]),
                    "ablated": kind.show(task, doc, answers["ablated"][i])})
    return out
