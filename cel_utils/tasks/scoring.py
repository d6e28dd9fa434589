"""From log-likelihoods to per-example correctness, and the reference (naive) log-likelihood evaluator.

Every scorer ends in an :class:`Outcome`: one bool per example for each metric (the primary metric drives
the search; harm, help, flips and paired statistics all come from these vectors) and a signed margin per
example (how far the decision was from flipping), which the tests use to tell real disagreements from
float ties.

:func:`loglikelihoods_naive` is the straightforward path the paper ran: one full forward of the whole model
per (context, continuation) sequence, full-vocabulary logits, with the ablation hook on. The fast engine
(:mod:`cel_utils.evaluation.engine`) must reproduce its decisions.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterable

import numpy as np
import torch

from cel_utils.models.ablation import ablated
from cel_utils.models.heads import HeadId
from cel_utils.models.loading import LoadedModel
from cel_utils.tasks.prompts import Request
from cel_utils.tasks.specs import TaskSpec


@dataclass
class ContinuationStats:
    """Per request, per continuation: summed log-probability, whether every token was the argmax, and the
    smallest (target logit - best other logit) over its tokens (> 0 iff greedy). The fast engine leaves the last two
    empty (False, NaN) for a kind whose decision does not read them (``TaskKind.reads_greedy``)."""

    ll: np.ndarray
    greedy: np.ndarray
    greedy_margin: np.ndarray

    @classmethod
    def of(cls, stats: list[tuple[float, bool, float]]) -> ContinuationStats:
        """From one :func:`continuation_stats` tuple per continuation."""
        return cls(ll=np.array([s[0] for s in stats]), greedy=np.array([s[1] for s in stats]),
                   greedy_margin=np.array([s[2] for s in stats]))

    @classmethod
    def log_likelihoods_only(cls, ll: np.ndarray) -> ContinuationStats:
        """``ll`` with the greedy fields empty (False, NaN), for a kind whose decision does not read them."""
        return cls(ll=ll, greedy=np.zeros(len(ll), bool), greedy_margin=np.full(len(ll), np.nan))


@dataclass
class Outcome:
    item_ids: list[str]
    correct: np.ndarray  # primary metric, bool per item
    margin: np.ndarray  # > 0 means correct with room to spare; near 0 means a float tie
    metrics: dict[str, np.ndarray] = field(default_factory=dict)  # every metric's bool vector
    predictions: list = field(default_factory=list)  # chosen answer index, or generated code
    # Multiple choice: each answer's score under the primary metric, [items, answers] (what a calibration baseline
    # shifts); None for the other kinds.
    scores: np.ndarray | None = None

    @property
    def accuracy(self) -> float:
        return float(self.correct.mean()) if len(self.correct) else float("nan")

    def metric_means(self) -> dict[str, float]:
        return {name: float(values.mean()) for name, values in self.metrics.items()}


def decide_greedy(task: TaskSpec, requests: list[Request], stats: list[ContinuationStats], **_) -> Outcome:
    """Greedy match (arithmetic): correct iff every answer token is the argmax; the margin is the smallest
    (target logit - best other logit) over the answer's tokens."""
    correct = np.array([bool(stat.greedy[0]) for stat in stats], dtype=bool)
    return Outcome(item_ids=[r.item_id for r in requests], correct=correct,
                   margin=np.array([float(stat.greedy_margin[0]) for stat in stats]), metrics={"acc": correct},
                   predictions=[None] * len(requests))


def decide_choice(task: TaskSpec, requests: list[Request], stats: list[ContinuationStats], **_) -> Outcome:
    """Multiple choice (lm-eval's rule): the answer with the highest log-likelihood (``acc``), or the highest
    log-likelihood per character (``acc_norm``); the margin is gold's score minus the best other's."""
    metrics: dict[str, list[bool]] = {name: [] for name in task.all_metrics}
    margins, predictions, primaries = [], [], []
    for request, stat in zip(requests, stats):
        scores = {"acc": stat.ll, "acc_norm": stat.ll / np.asarray(request.choice_chars, dtype=np.float64)}
        for name in task.all_metrics:
            metrics[name].append(int(np.argmax(scores[name])) == request.gold)
        primary = scores[task.metric]
        others = np.delete(primary, request.gold)
        margins.append(float(primary[request.gold] - others.max()))
        predictions.append(int(np.argmax(primary)))
        primaries.append(primary)
    arrays = {name: np.array(values, dtype=bool) for name, values in metrics.items()}
    return Outcome(item_ids=[r.item_id for r in requests], correct=arrays[task.metric], margin=np.array(margins),
                   metrics=arrays, predictions=predictions,
                   scores=np.array(primaries) if primaries and len({len(x) for x in primaries}) == 1 else None)


def greedy_margin(task: TaskSpec, request: Request, logits_per_answer: list[torch.Tensor]) -> torch.Tensor:
    """:func:`decide_greedy`'s margin as a differentiable tensor, from the logits at the answer's positions."""
    (logits,) = logits_per_answer
    targets = torch.tensor(request.continuations[0], device=logits.device)
    target = logits.gather(-1, targets[:, None])[:, 0]
    others = logits.scatter(-1, targets[:, None], float("-inf")).max(dim=-1).values
    return (target - others).min()


def choice_margin(task: TaskSpec, request: Request, logits_per_answer: list[torch.Tensor]) -> torch.Tensor:
    """:func:`decide_choice`'s margin as a differentiable tensor, from each answer's logits."""
    scores = []
    for c, logits in enumerate(logits_per_answer):
        targets = torch.tensor(request.continuations[c], device=logits.device)
        ll = torch.log_softmax(logits, dim=-1).gather(-1, targets[:, None]).sum()
        scores.append(ll / request.choice_chars[c] if task.metric == "acc_norm" else ll)
    scores = torch.stack(scores)
    others = torch.cat([scores[:request.gold], scores[request.gold + 1:]])
    return scores[request.gold] - others.max()


def reference_loglik(task: TaskSpec, request: Request, logits_per_answer: list[torch.Tensor]) -> torch.Tensor:
    """The mean log-probability per token of a request's one continuation (a reference solution), differentiable."""
    (logits,) = logits_per_answer
    targets = torch.tensor(request.continuations[0], device=logits.device)
    return torch.log_softmax(logits, dim=-1).gather(-1, targets[:, None]).mean()


def relative_error_reduction(full_pct: float, ablated_pct: float) -> float:
    """gain / (100 - full), in percent, from accuracies in percent (the paper's Table 1: 70.40 -> 83.50 gives 44.26%);
    NaN when the full model is at 100% (no error left to reduce)."""
    if full_pct >= 100.0:
        return float("nan")
    return 100.0 * (ablated_pct - full_pct) / (100.0 - full_pct)


def at_least_float32(x: torch.Tensor) -> torch.Tensor:
    """``x`` in float32, or kept in a wider dtype: bf16 logits are scored in float32, a float64 model's in float64."""
    return x.to(torch.promote_types(x.dtype, torch.float32))


def continuation_loglikelihood(logits: torch.Tensor, targets: torch.Tensor) -> float:
    """The summed log-probability of ``targets`` [n] under ``logits`` [n, vocab], the positions that predict them."""
    logprobs = torch.log_softmax(at_least_float32(logits), dim=-1)
    return float(logprobs.gather(-1, targets[:, None])[:, 0].double().sum())


def continuation_stats(logits: torch.Tensor, targets: torch.Tensor) -> tuple[float, bool, float]:
    """The log-likelihood, whether every target token is the argmax, and the smallest margin by which it is. The
    greedy statistics cost a copy of the logits and a maximum over them, more than the log-softmax (6.1 s of 10.3 s of
    scoring in a HellaSwag call on Gemma's 262k rows; benchmarks/bench_scoring.py), so a kind whose decision does not
    read them takes :func:`continuation_loglikelihood` alone."""
    logits = at_least_float32(logits)
    target_logit = logits.gather(-1, targets[:, None])[:, 0]
    others = logits.scatter(-1, targets[:, None], float("-inf"))
    margin = target_logit - others.max(dim=-1).values
    return continuation_loglikelihood(logits, targets), bool((margin > 0).all()), float(margin.min())


def _batches(order: list[int], size: int) -> Iterable[list[int]]:
    for start in range(0, len(order), size):
        yield order[start:start + size]


@torch.no_grad()
def loglikelihoods_naive(lm: LoadedModel, requests: list[Request], heads: Iterable[HeadId] = (),
                         batch_size: int = 8) -> list[ContinuationStats]:
    """One full forward per (context, continuation) sequence, right-padded, full logits.

    Right padding needs no attention mask: with causal attention no real token ever sees a pad, so every
    real position computes exactly what it would alone. Position ids start at 0 for every row.
    """
    sequences = [(r, c) for r, request in enumerate(requests) for c in range(len(request.continuations))]
    full = [list(requests[r].context) + list(requests[r].continuations[c]) for r, c in sequences]
    order = sorted(range(len(sequences)), key=lambda i: -len(full[i]))
    results: dict[tuple[int, int], tuple[float, bool, float]] = {}
    pad = lm.tokenizer.pad_token_id
    with ablated(lm.model, heads, lm.geometry):
        for batch in _batches(order, batch_size):
            width = max(len(full[i]) - 1 for i in batch)
            ids = torch.full((len(batch), width), pad, dtype=torch.long)
            for row, i in enumerate(batch):
                ids[row, :len(full[i]) - 1] = torch.tensor(full[i][:-1])
            logits = lm.model(ids.to(lm.device)).logits
            for row, i in enumerate(batch):
                r, c = sequences[i]
                n_ctx, cont = len(requests[r].context), requests[r].continuations[c]
                positions = slice(n_ctx - 1, n_ctx - 1 + len(cont))
                results[(r, c)] = continuation_stats(logits[row, positions], torch.tensor(cont, device=lm.device))
    return [ContinuationStats.of([results[(r, c)] for c in range(len(request.continuations))])
            for r, request in enumerate(requests)]
