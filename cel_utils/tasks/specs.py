"""Tasks as declarations: data source, prompt, target and metric, one small spec each (lm-eval style).

The prompts follow lm-evaluation-harness so numbers are comparable with what people already trust:

=========  =========================================================  ==========================================
task       prompt (``doc_to_text``)                                   scored as
=========  =========================================================  ==========================================
arithmetic ``{context}``                                              greedy match of ``{completion}`` (leading
                                                                      space, no extra delimiter), teacher forced
boolq      ``{passage}\\nQuestion: {question}?\\nAnswer:``             log-likelihood of `` no`` vs `` yes`` (acc)
hellaswag  ``{activity_label}: {ctx_a} {ctx_b.capitalize()}``, cleaned  log-likelihood of ``" " + ending``; acc and
                                                                      acc_norm (divided by ending length in chars)
mbpp       3-shot "You are an expert Python programmer..." ``[BEGIN]``  greedy generation until ``[DONE]``, pass@1 by
                                                                      running the 3 asserts in the sandbox
=========  =========================================================  ==========================================
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Callable

from cel_utils.tasks.arithmetic_gen import ARITHMETIC_CONFIGS
from cel_utils.tasks.data import Source


@dataclass(frozen=True)
class Item:
    """One example: a stable id (used in artifacts and caches) and the dataset row."""

    id: str
    doc: dict


@dataclass(frozen=True)
class TaskSpec:
    name: str
    source: Source
    kind: str  # "greedy" (all target tokens argmax) | "choice" (highest log-likelihood) | "generate" (run code)
    metric: str  # the primary metric: "acc", "acc_norm" or "pass@1"
    fields: dict[str, type]  # required fields of a row and their types, checked before any work starts
    doc_to_text: Callable[[dict], str]
    doc_to_target: Callable[[dict], str]  # the answer as a few-shot exemplar shows it (after the delimiter)
    holdout_split: str
    discovery_split: str | None  # None: discovery is drawn from the holdout split's pool (arithmetic)
    paper_sizes: tuple[int, int]  # (discovery, holdout) of the paper's Table 3
    configs: tuple[str | None, ...] = (None,)
    doc_to_choices: Callable[[dict], list[str]] | None = None  # answers, without the delimiter
    target_delimiter: str = ""  # between prompt and answer (lm-eval's; arithmetic's answers carry their space)
    doc_to_gold: Callable[[dict], int] | None = None
    validate: Callable[[dict], None] | None = None  # extra per-row checks beyond field types
    fewshot_split: str | None = None  # a dedicated exemplar split (MBPP "prompt"); else unused items
    fewshot_ids: tuple = ()  # fixed exemplars by id in that split (lm-eval's MBPP: task_ids 2, 3, 4)
    default_fewshot: int = 0
    metrics: tuple[str, ...] = field(default=())  # all reported metrics; defaults to (metric,)
    stop: str | None = None  # generation stops at this string (plain format)
    # The chat-template variant of a generation task (lm-eval's *_instruct): its own wording, an assistant
    # prefix the model continues from, and the string that closes the answer.
    chat_doc_to_text: Callable[[dict], str] | None = None
    chat_doc_to_target: Callable[[dict], str] | None = None
    chat_prefix: str = ""
    chat_stop: str | None = None
    # The cheapest fix of a response bias, the baseline an ablation's gain is compared with (cel_utils.stats.calibration):
    # "answer" -> one additive offset per answer (BoolQ's no / yes); "length" -> one per answer-length bucket
    # (HellaSwag's endings); None -> no baseline (greedy match and generation have no answers to shift).
    calibration: str | None = None
    # lm-eval's knobs that the four built-in tasks leave at their defaults (cel_utils.tasks.lmeval sets them):
    fewshot_delimiter: str = "\n\n"  # between exemplars, and between the last exemplar and the item
    description: str | Callable[[dict], str] = ""  # text before the first exemplar (of the item's prompt)
    doc_to_exemplar: Callable[[dict], str] | None = None  # an exemplar's whole text; None: text + delimiter + target
    fewshot_first_n: bool = False  # exemplars from fewshot_split without fewshot_ids: the first n (else a seeded draw)
    # what moves from the end of a context into the answer before the pair is tokenized (prompts.encode_pair): spaces
    # for the built-in tasks (no context of theirs ends in other whitespace but MBPP's, whose requests are fixed), any
    # whitespace (None) for lm-eval's tasks, as lm-eval 0.4.13 does
    moved_whitespace: str | None = " "
    # A generation task decided otherwise than by running the item's test_list (kinds.py): (task, requests,
    # completions, timeout_s=...) -> Outcome. None: MBPP's pass@1 in the sandbox.
    score_generations: Callable | None = None
    # Where the declaration came from (an lm-eval task: its version, YAML and config hash), for the data provenance.
    declaration: dict | None = None

    @property
    def all_metrics(self) -> tuple[str, ...]:
        return self.metrics or (self.metric,)

    def exemplar(self, doc: dict) -> str:
        """A few-shot exemplar as a plain prompt shows it: the text, the target delimiter and the answer."""
        if self.doc_to_exemplar is not None:
            return self.doc_to_exemplar(doc)
        return self.doc_to_text(doc) + self.target_delimiter + self.doc_to_target(doc)

    def answers(self, doc: dict) -> tuple[list[str], int]:
        """The answers whose log-likelihoods are scored, and the index of the right one: the choices of a
        multiple-choice task, or the one target of a greedy-match task."""
        if self.doc_to_choices is None:
            return [self.doc_to_target(doc)], 0
        return self.doc_to_choices(doc), self.doc_to_gold(doc)


# --- HellaSwag: lm-eval's preprocessing -----------------------------------------------------------------

def hellaswag_clean(text: str) -> str:
    text = text.strip().replace(" [title]", ". ")
    text = re.sub(r"\[.*?\]", "", text)
    return text.replace("  ", " ")


def _hellaswag_query(doc: dict) -> str:
    return hellaswag_clean(doc["activity_label"] + ": " + doc["ctx_a"] + " " + doc["ctx_b"].capitalize())


def _hellaswag_gold(doc: dict) -> int:
    return int(doc["label"])


def _hellaswag_validate(doc: dict) -> None:
    if len(doc["endings"]) != 4:
        raise ValueError(f"has {len(doc['endings'])} endings, HellaSwag needs 4")
    if doc["label"] not in {"0", "1", "2", "3"}:
        raise ValueError(f"label {doc['label']!r} is out of range: HellaSwag labels are the strings '0'..'3'")


# --- MBPP --------------------------------------------------------------------------------------------------

def mbpp_text(doc: dict) -> str:
    tests = "\n".join(doc["test_list"][:3])
    return f"You are an expert Python programmer, and here is your task: {doc['text']} Your code should pass these tests:\n\n{tests}\n[BEGIN]\n"


def mbpp_chat_text(doc: dict) -> str:
    """lm-eval's ``mbpp_instruct`` wording, for the chat-template variant."""
    tests = "\n".join(doc["test_list"][:3])
    return f"You are an expert Python programmer, and here is your task:\n{doc['text']}\nYour code should pass these tests:\n{tests}"


def _mbpp_validate(doc: dict) -> None:
    if len(doc["test_list"]) < 1 or not all(isinstance(t, str) for t in doc["test_list"]):
        raise ValueError("test_list must be a non-empty list of assert strings")


MBPP_STOP = "[DONE]"

ARITHMETIC_SOURCE = Source("EleutherAI/arithmetic", "arithmetic")


def _arithmetic(name: str, configs: tuple[str, ...]) -> TaskSpec:
    return TaskSpec(
        name=name, source=ARITHMETIC_SOURCE, configs=configs, kind="greedy", metric="acc",
        fields={"context": str, "completion": str},
        doc_to_text=lambda doc: doc["context"], doc_to_target=lambda doc: doc["completion"],
        holdout_split="validation", discovery_split=None, paper_sizes=(2000, 1000),
    )


TASKS: dict[str, TaskSpec] = {
    "arithmetic": _arithmetic("arithmetic", ARITHMETIC_CONFIGS),
    **{config: _arithmetic(config, (config,)) for config in ARITHMETIC_CONFIGS},
    "boolq": TaskSpec(
        name="boolq", source=Source("google/boolq", "boolq"), kind="choice", metric="acc",
        fields={"question": str, "passage": str, "answer": bool},
        doc_to_text=lambda doc: f"{doc['passage']}\nQuestion: {doc['question']}?\nAnswer:",
        doc_to_target=lambda doc: "yes" if doc["answer"] else "no", target_delimiter=" ",
        doc_to_choices=lambda doc: ["no", "yes"], doc_to_gold=lambda doc: int(doc["answer"]),
        holdout_split="validation", discovery_split="train", paper_sizes=(2000, 3270), calibration="answer",
    ),
    "hellaswag": TaskSpec(
        name="hellaswag", source=Source("Rowan/hellaswag", "hellaswag"), kind="choice", metric="acc_norm",
        metrics=("acc_norm", "acc"),
        fields={"activity_label": str, "ctx_a": str, "ctx_b": str, "endings": list, "label": str},
        doc_to_text=_hellaswag_query,
        doc_to_target=lambda doc: hellaswag_clean(doc["endings"][_hellaswag_gold(doc)]), target_delimiter=" ",
        doc_to_choices=lambda doc: [hellaswag_clean(ending) for ending in doc["endings"]],
        doc_to_gold=_hellaswag_gold, validate=_hellaswag_validate,
        holdout_split="validation", discovery_split="train", paper_sizes=(2000, 10042), calibration="length",
    ),
    "mbpp": TaskSpec(
        name="mbpp", source=Source("google-research-datasets/mbpp", "mbpp"), configs=("full",), kind="generate",
        metric="pass@1", fields={"task_id": int, "text": str, "code": str, "test_list": list, "test_setup_code": str},
        doc_to_text=mbpp_text, doc_to_target=lambda doc: f"{doc['code']}\n{MBPP_STOP}", validate=_mbpp_validate,
        holdout_split="test", discovery_split="train", paper_sizes=(374, 500),
        fewshot_split="prompt", fewshot_ids=(2, 3, 4), default_fewshot=3, stop=MBPP_STOP,
        chat_doc_to_text=mbpp_chat_text, chat_doc_to_target=lambda doc: f"```python\n{doc['code']}\n```",
        chat_prefix="```python\n", chat_stop="```",
    ),
}


def validate_item(task: TaskSpec, item: Item, where: str = "the data") -> None:
    """Raise a ValueError naming the row, the problem and the fix when a row does not fit the task."""
    fix = f"fix or remove that row in {where}"
    for name, expected in task.fields.items():
        if item.doc.get(name) is None:  # absent, or null (a JSON loader fills absent fields with null)
            needed = ", ".join(f"{field} ({kind.__name__})" for field, kind in task.fields.items())
            raise ValueError(f"{task.name} row {item.id}: missing field {name!r} (rows need {needed}); {fix}")
        value = item.doc[name]
        if not isinstance(value, expected) or (expected is int and isinstance(value, bool)):
            raise ValueError(f"{task.name} row {item.id}: field {name!r} should be {expected.__name__}, "
                             f"got {type(value).__name__} {value!r:.60}; {fix}")
    if task.validate is not None:
        try:
            task.validate(item.doc)
        except ValueError as error:
            raise ValueError(f"{task.name} row {item.id}: {error}; {fix}") from None
