"""The one switch on a task's kind, as lm-eval's ``output_type``: everything that differs between kinds is here.

A :class:`cel_utils.tasks.specs.TaskSpec` names its kind (``greedy``, ``choice`` or ``generate``); the evaluators,
the engine, attribution patching, the guarded precision, the run (its precision, its sandbox record), its examples and
the explorer look the kind up here instead of branching on its name.

========  ===============================  ===============================  ===========  ===========================
kind      requests                         decision                         store        attributed (screen)
========  ===============================  ===============================  ===========  ===========================
greedy    prompt + target, teacher forced  every target token the argmax    statistics   smallest logit margin
choice    prompt + each answer             highest (normalised) likelihood  statistics   gold - best other
generate  prompt to continue greedily      the code passes its tests        completions  reference's log-likelihood
========  ===============================  ===============================  ===========  ===========================
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Mapping

import numpy as np

from cel_utils.evaluation.generation import score_generations
from cel_utils.tasks.floors import choice_floors, greedy_floors, no_floors
from cel_utils.tasks.prompts import build_gen_requests, build_requests, reference_requests
from cel_utils.tasks.scoring import (ContinuationStats, choice_margin, decide_choice, decide_greedy, greedy_margin,
                                     reference_loglik)
from cel_utils.tasks.specs import TaskSpec


def _clip(text: str, limit: int) -> str:
    return text if len(text) <= limit else text[:limit] + "..."


@dataclass(frozen=True)
class ItemDecision:
    """One item's decision from its statistics (cel_utils.tasks.scoring.ContinuationStats), for the guarded precision
    (cel_utils.evaluation.guarded): what the outcome takes from it, how far it is from changing (>= 0; it can only
    differ in another precision where this is within that precision's error), and a bound on how far that distance
    moved between two computations of the same item (two precisions)."""

    decision: Callable[[TaskSpec, Any, ContinuationStats], tuple]  # (task, request, stats)
    margin: Callable[[TaskSpec, Any, ContinuationStats], float]  # (task, request, stats)
    margin_error: Callable[[TaskSpec, Any, ContinuationStats, ContinuationStats], float]  # (task, request, low, high)


@dataclass(frozen=True)
class TypedPrompt:
    """A prompt the user types into the explorer for a task of this kind: the box its answers go in, the item's
    document made of them, and how the task reads that document."""

    box: str  # the answers box's name
    hint: str  # what goes in it
    # (text, *, options, gold, target, tests) -> the document (each kind takes what it needs: the options and the right
    # one's index, the target, or assert lines); a ValueError names what is missing
    document: Callable[..., dict]
    # the task's functions that read the document's own fields instead (empty: it is read like a dataset row)
    reads: Mapping[str, Callable[[dict], Any]]


@dataclass(frozen=True)
class TaskKind:
    name: str
    # True: scored from teacher-forced log-likelihoods (the engine's stacked forwards; the store keeps per-answer
    # statistics). False: scored by generating text (decoding; the store keeps the completions).
    loglikelihood: bool
    build_requests: Callable  # (task, items, fewshot, tokenizer, fmt, bos) -> requests
    decide: Callable  # (task, requests, statistics or completions, timeout_s=..., memory_mb=...) -> Outcome
    # What attribution patching screens by: the requests it scores (evaluator -> requests) and a differentiable number
    # of one request from its answers' logits: the decision margin, or for generation, where the decision (running
    # code) has no gradient, the reference solution's mean log-probability per token.
    attribution_requests: Callable
    attribution_margin: Callable
    # True: the decision compares the answers' scores with each other, so with plain accuracy and one-token answers
    # only those vocabulary rows need unembedding (the softmax normaliser is shared).
    compares_answers: bool
    # True: an Outcome's predictions say what the model answered (the chosen option, the generated code); False for
    # teacher-forced greedy match, for whose pages a short answer is generated.
    predicts: bool
    show: Callable[[TaskSpec, dict, Any], str]  # how a prediction reads on a run page (task, doc, prediction)
    show_gold: Callable[[TaskSpec, dict], str]  # how the right answer reads there
    # The trivial accuracies on a list of items: chance and the best constant answer (cel_utils.tasks.floors).
    floors: Callable[[TaskSpec, list], dict]
    # What an Outcome's margin measures, in words, when it is a continuous score of the gold answer (None: the margin
    # only says right or wrong, as for code that passed or failed).
    margin_unit: Callable[[TaskSpec], str | None]
    typed_prompt: TypedPrompt  # a prompt typed into the explorer (cel_utils.explore)
    # True: deciding may run model-written code (MBPP's pass@1, in cel_utils.sandbox), so a run records the layers the
    # sandbox has where it runs.
    runs_code: bool = False
    # True: precision auto computes this kind guarded where bf16 is native (cel_utils.evaluation.precision):
    # guarded was measured faster than fp32 for multiple choice only (book/speed.md).
    auto_guarded: bool = False
    # True: the decision reads whether each target token was the argmax (teacher-forced greedy match), so the engine
    # computes it (ContinuationStats.greedy and .greedy_margin); elsewhere it leaves them empty, which saves a copy of
    # every scored position's logits and a maximum over them.
    reads_greedy: bool = False
    # One item's decision from its statistics, as the guarded precision reads it; None where the store keeps
    # completions, which cel_utils.evaluation.guarded_generation guards by their decoding instead.
    item_decision: ItemDecision | None = None


def _show_greedy(task: TaskSpec, doc: dict, answer: Any) -> str:
    return repr(answer)  # a short greedy answer generated for the page (the score is teacher forced)


def _show_choice(task: TaskSpec, doc: dict, index: Any) -> str:
    return "(not stored)" if index is None else f"[{index}] {_clip(task.doc_to_choices(doc)[index].strip(), 120)}"


def _show_generation(task: TaskSpec, doc: dict, prediction: Any) -> str:
    prediction = prediction or {}
    return f"[{prediction.get('status', '?')}]\n{_clip(prediction.get('completion', '(not stored)'), 600)}"


def _decide_generation(task: TaskSpec, requests: list, completions: list[str], **kwargs):
    """pass@1 by running each item's tests in the sandbox (MBPP), or the task's own scorer (an lm-eval task's filters
    and metric, cel_utils.tasks.lmeval)."""
    return (task.score_generations or score_generations)(task, requests, completions, **kwargs)


def _own_requests(evaluator) -> list:
    return evaluator.requests


def _reference_requests(evaluator) -> list:
    return reference_requests(evaluator.task, evaluator.items, evaluator.fewshot, evaluator.lm.tokenizer, evaluator.fmt,
                              evaluator.bos)


def _choice_margin_unit(task: TaskSpec) -> str:
    per = " per character" if task.metric == "acc_norm" else ""
    return f"nats{per} (the gold answer's log-likelihood{per} minus the best other answer's)"


# --- one item's decision, for the guarded precision --------------------------------------------------------------

def _greedy_decision(task: TaskSpec, request, stats: ContinuationStats) -> tuple:
    return (bool(stats.greedy[0]),)


def _greedy_item_margin(task: TaskSpec, request, stats: ContinuationStats) -> float:
    """The smallest per-token margin of the target (target logit minus the best other), whose sign is the decision."""
    return abs(float(stats.greedy_margin[0]))


def _greedy_margin_error(task: TaskSpec, request, low: ContinuationStats, high: ContinuationStats) -> float:
    return abs(float(low.greedy_margin[0]) - float(high.greedy_margin[0]))


def _choice_scores(task: TaskSpec, request, stats: ContinuationStats) -> list[np.ndarray]:
    """The answers' scores under the task's primary metric (as :func:`cel_utils.tasks.scoring.decide_choice`).

    Only the primary one: it makes every decision the search, the holdout and the statistics use. Guarding HellaSwag's
    secondary ``acc`` too (unnormalised sums over ~20 tokens, bf16 errors up to 1.6 on 32 items x 13 interventions,
    against 0.02 for ``acc_norm``) sent every pair to fp32."""
    chars = np.asarray(request.choice_chars, dtype=np.float64)
    return [stats.ll if task.metric == "acc" else stats.ll / chars]


def _choice_decision(task: TaskSpec, request, stats: ContinuationStats) -> tuple:
    """The chosen answer under each metric."""
    return tuple(int(np.argmax(scores)) for scores in _choice_scores(task, request, stats))


def _choice_item_margin(task: TaskSpec, request, stats: ContinuationStats) -> float:
    """The gap between the chosen answer's score and the runner-up's."""
    gaps = []
    for scores in _choice_scores(task, request, stats):
        top = np.sort(scores)[::-1]
        gaps.append(top[0] - top[1])
    return float(min(gaps))


def _choice_margin_error(task: TaskSpec, request, low: ContinuationStats, high: ContinuationStats) -> float:
    """The spread of the answers' score errors (the largest minus the smallest: a shift shared by all answers, such as
    the softmax normaliser, costs nothing)."""
    errors = (a - b for a, b in zip(_choice_scores(task, request, low), _choice_scores(task, request, high)))
    return float(max(np.ptp(error) for error in errors))


# --- a prompt typed into the explorer ------------------------------------------------------------------------------

def _choice_document(text: str, *, options, gold: int, **_) -> dict:
    options = [o for o in options if o.strip()]
    if len(options) < 2:
        raise ValueError("a multiple-choice prompt needs at least two options, one per line")
    if not 0 <= gold < len(options):
        raise ValueError(f"the right option is numbered 0..{len(options) - 1}, got {gold}")
    return {"text": text, "choices": list(options), "gold": int(gold)}


def _greedy_document(text: str, *, target: str, **_) -> dict:
    if not target:
        raise ValueError("a greedy-match prompt needs the expected answer (its target), e.g. ' 42'")
    return {"text": text, "target": target}


def _generation_document(text: str, *, tests, **_) -> dict:
    tests = [t for t in tests if t.strip()]
    if not tests:
        raise ValueError("an MBPP prompt needs at least one test, an assert per line")
    return {"text": text, "test_list": list(tests), "test_setup_code": "", "code": "", "task_id": -1}


def _text(doc: dict) -> str:
    return doc["text"]


KINDS: dict[str, TaskKind] = {
    "greedy": TaskKind("greedy", True, build_requests, decide_greedy, _own_requests, greedy_margin, False, False,
                       _show_greedy, lambda task, doc: repr(task.doc_to_target(doc)), greedy_floors,
                       lambda task: "logits (the smallest gap between a gold token's logit and the best other's)",
                       reads_greedy=True,
                       item_decision=ItemDecision(_greedy_decision, _greedy_item_margin, _greedy_margin_error),
                       typed_prompt=TypedPrompt("answer", "the expected answer, e.g. ' 42'", _greedy_document,
                                                {"doc_to_text": _text, "doc_to_target": lambda doc: doc["target"]})),
    "choice": TaskKind("choice", True, build_requests, decide_choice, _own_requests, choice_margin, True, True,
                       _show_choice, lambda task, doc: _show_choice(task, doc, task.doc_to_gold(doc)), choice_floors,
                       _choice_margin_unit, auto_guarded=True,
                       item_decision=ItemDecision(_choice_decision, _choice_item_margin, _choice_margin_error),
                       typed_prompt=TypedPrompt("options", "one option per line", _choice_document,
                                                {"doc_to_text": _text, "doc_to_choices": lambda doc: doc["choices"],
                                                 "doc_to_gold": lambda doc: doc["gold"],
                                                 "doc_to_target": lambda doc: doc["choices"][doc["gold"]]})),
    "generate": TaskKind("generate", False, build_gen_requests, _decide_generation, _reference_requests,
                         reference_loglik, False, True, _show_generation,
                         lambda task, doc: _clip(doc["code"] if "code" in doc else task.doc_to_target(doc), 400),
                         no_floors,
                         lambda task: None, runs_code=True,
                         # the typed text is the task's description: the prompt wraps it as for any item
                         typed_prompt=TypedPrompt("tests", "one assert per line", _generation_document, {})),
}


def kind_of(task: TaskSpec) -> TaskKind:
    if task.kind not in KINDS:
        raise ValueError(f"task {task.name!r} has unknown kind {task.kind!r}: known kinds are {', '.join(KINDS)}")
    return KINDS[task.kind]
