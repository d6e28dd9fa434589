"""The one switch on a task's kind, as lm-eval's ``output_type``: everything that differs between kinds is here.

A :class:`cel_utils.tasks.specs.TaskSpec` names its kind (``greedy``, ``choice`` or ``generate``); the evaluators,
the engine, attribution patching and the run's examples look the kind up here instead of branching on its name.

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
from typing import Any, Callable

from cel_utils.evaluation.generation import score_generations
from cel_utils.tasks.prompts import build_gen_requests, build_requests, reference_requests
from cel_utils.tasks.scoring import choice_margin, decide_choice, decide_greedy, greedy_margin, reference_loglik
from cel_utils.tasks.specs import TaskSpec


def _clip(text: str, limit: int) -> str:
    return text if len(text) <= limit else text[:limit] + "..."


@dataclass(frozen=True)
class TaskKind:
    name: str
    # True: scored from teacher-forced log-likelihoods (the engine's stacked forwards; the store keeps per-answer
    # statistics). False: scored by generating text (decoding; the store keeps the completions).
    loglikelihood: bool
    build_requests: Callable  # (task, items, fewshot, tokenizer, fmt, bos) -> requests
    decide: Callable  # (task, requests, statistics or completions, timeout_s=...) -> Outcome
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


def _show_greedy(task: TaskSpec, doc: dict, answer: Any) -> str:
    return repr(answer)  # a short greedy answer generated for the page (the score is teacher forced)


def _show_choice(task: TaskSpec, doc: dict, index: Any) -> str:
    return "(not stored)" if index is None else f"[{index}] {_clip(task.doc_to_choices(doc)[index].strip(), 120)}"


def _show_generation(task: TaskSpec, doc: dict, prediction: Any) -> str:
    prediction = prediction or {}
    return f"[{prediction.get('status', '?')}]\n{_clip(prediction.get('completion', '(not stored)'), 600)}"


def _own_requests(evaluator) -> list:
    return evaluator.requests


def _reference_requests(evaluator) -> list:
    return reference_requests(evaluator.task, evaluator.items, evaluator.fewshot, evaluator.lm.tokenizer, evaluator.fmt,
                              evaluator.bos)


KINDS: dict[str, TaskKind] = {
    "greedy": TaskKind("greedy", True, build_requests, decide_greedy, _own_requests, greedy_margin, False, False,
                       _show_greedy, lambda task, doc: repr(task.doc_to_target(doc))),
    "choice": TaskKind("choice", True, build_requests, decide_choice, _own_requests, choice_margin, True, True,
                       _show_choice, lambda task, doc: _show_choice(task, doc, task.doc_to_gold(doc))),
    "generate": TaskKind("generate", False, build_gen_requests, score_generations, _reference_requests, reference_loglik,
                         False, True, _show_generation, lambda task, doc: _clip(doc.get("code", ""), 400)),
}


def kind_of(task: TaskSpec) -> TaskKind:
    if task.kind not in KINDS:
        raise ValueError(f"task {task.name!r} has unknown kind {task.kind!r}: known kinds are {', '.join(KINDS)}")
    return KINDS[task.kind]
