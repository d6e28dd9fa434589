"""Attribution patching: a first-order estimate of every head's zero-ablation effect, per item, from one backward pass.

Put a gate ``g_h`` on every head's slice ``z_h`` of the o_proj input (the same site the ablation uses):
``z_h -> g_h z_h``. All gates at 1 is the full model; ``g_h = 0`` ablates head h. To first order,

    M(ablate h) - M(full)  ~  -dM/dg_h  =  -(dM/dz_h . z_h)   (summed over positions)

so one forward and one backward pass per batch give an estimate for *every* head at once, against one evaluation per
head for exact screening. Every batch row has its own gates, so the backward pass of the summed margins leaves each
item's own gradient in its rows: the estimate is per item (``Attribution.per_item``), and a resampled item set is a
mean over other rows, with no new pass.

``M`` is what the task's kind says to attribute (:mod:`cel_utils.evaluation.kinds`, ``attribution_margin``):

* greedy match (arithmetic): the decision margin, the smallest over answer tokens of (target logit - best other logit);
* multiple choice (BoolQ, HellaSwag): the decision margin, score(gold) - best score(other), the score being the
  answer's log-likelihood (per character for acc_norm);
* generation (MBPP), which is decided by running code and has no margin: the mean log-probability per token of the
  reference solution, teacher forced after the same prompt (a head whose removal makes the reference likelier is a
  candidate for a pass@1 gain).

All are piecewise smooth (a min or max picks one branch; autograd differentiates that branch). For the decision
margins, the exact effect of every head evaluated exactly is free (the outcomes carry margins), so the estimate can be
checked against it, and against the accuracy gain that the search actually ranks by.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from cel_utils.evaluation.kinds import kind_of
from cel_utils.progress import progress_bar
from cel_utils.models.plumbing import base_model, scaled_head_outputs, unembed

# Backward keeps every layer's activations: cap the tokens per pass (a few hundred MB for SmolLM2-135M).
TOKEN_BUDGET = 2048
# Forward-pass equivalents of one forward + backward over an item (a backward pass costs about two forwards).
FORWARD_BACKWARD_COST = 3.0


@dataclass
class Attribution:
    per_item: np.ndarray  # [items, layers, heads]: estimated change of each item's M when the head is zero-ablated
    full_margins: np.ndarray  # [items]: M of the full model, as computed here (checks against Outcome.margin)
    forward_equivalents: float  # cost, in forward passes of the full model over one item

    @property
    def estimate(self) -> np.ndarray:
        """[layers, heads]: the estimated change of the mean M over the items."""
        return self.per_item.mean(axis=0)


def _rows(request) -> tuple[list[list[int]], list[tuple[int, list[int], int]]]:
    """The request's distinct input rows (context + answer minus its last token, so one-token answers such as BoolQ's
    " yes" and " no" share one row, the context) and, per continuation, (its row, its targets, its first scored
    position)."""
    context = list(request.context)
    rows: list[list[int]] = []
    reads = []
    for cont in request.continuations:
        tokens = context + list(cont[:-1])
        if tokens not in rows:
            rows.append(tokens)
        reads.append((rows.index(tokens), list(cont), len(context) - 1))
    return rows, reads


def _batches(requests, budget: int) -> list[list[int]]:
    """Requests grouped so that all rows of a request share a batch, under a token budget."""
    order = sorted(range(len(requests)), key=lambda i: -max(map(len, _rows(requests[i])[0])))
    batches, current, width, rows = [], [], 0, 0
    for i in order:
        request_rows = _rows(requests[i])[0]
        new_width = max(width, max(map(len, request_rows)))
        if current and (rows + len(request_rows)) * new_width > budget:
            batches.append(current)
            current, width, rows = [], 0, 0
            new_width = max(map(len, request_rows))
        current.append(i)
        width, rows = new_width, rows + len(request_rows)
    if current:
        batches.append(current)
    return batches


def _target(evaluator):
    """What to attribute for the evaluator's task: its requests and the differentiable M of one request."""
    kind = kind_of(evaluator.task)
    requests = kind.attribution_requests(evaluator)
    return requests, kind.attribution_margin


def _batch_margins(evaluator, requests, margin, batch: list[int], gates: torch.Tensor) -> torch.Tensor:
    """M of each request in ``batch`` with every row's o_proj inputs scaled by its own ``gates`` [rows, layers, heads]
    (1: kept, 0: ablated); the requests' distinct rows (:func:`_rows`) in order, right padded (causal attention never
    sees a pad)."""
    lm, geometry = evaluator.lm, evaluator.lm.geometry
    layouts = [_rows(requests[i]) for i in batch]
    tokens = [row for rows, _ in layouts for row in rows]
    ids = torch.full((len(tokens), max(map(len, tokens))), lm.tokenizer.pad_token_id, dtype=torch.long)
    for r, row in enumerate(tokens):
        ids[r, :len(row)] = torch.tensor(row)
    factors = {layer: gates[:, layer].repeat_interleave(geometry.head_dim, dim=-1) for layer in range(geometry.n_layers)}
    with scaled_head_outputs(lm.model, factors):
        hidden = base_model(lm.model)(input_ids=ids.to(lm.device)).last_hidden_state
    margins, offset = [], 0
    for i, (rows, reads) in zip(batch, layouts):
        logits = [unembed(lm.model, hidden[offset + r, first:first + len(targets)]) for r, targets, first in reads]
        margins.append(margin(evaluator.task, requests[i],
                              [x.to(torch.promote_types(x.dtype, torch.float32)) for x in logits]))
        offset += len(rows)
    return torch.stack(margins)


def _row_counts(requests, batch: list[int]) -> list[int]:
    return [len(_rows(requests[i])[0]) for i in batch]


def gated_margins(evaluator, gates: torch.Tensor, token_budget: int = TOKEN_BUDGET) -> np.ndarray:
    """Per-item M with every head's o_proj input scaled by ``gates`` [layers, heads], the same for every item."""
    requests, margin = _target(evaluator)
    out = np.zeros(len(requests))
    with torch.no_grad():
        for batch in _batches(requests, token_budget):
            rows = sum(_row_counts(requests, batch))
            out[batch] = _batch_margins(evaluator, requests, margin, batch, gates.expand(rows, -1, -1)).double().cpu().numpy()
    return out


def head_attributions(evaluator, token_budget: int = TOKEN_BUDGET) -> Attribution:
    """Estimated zero-ablation effect of every head on every item's M, from one forward and backward pass per batch."""
    lm = evaluator.lm
    requests, margin = _target(evaluator)
    shape = (lm.geometry.n_layers, lm.geometry.n_heads)
    per_item, margins = np.zeros((len(requests), *shape)), np.zeros(len(requests))
    batches = _batches(requests, token_budget)
    progress = progress_bar(len(batches), f"{evaluator.task.name}: attribution (forward + backward)",
                            getattr(evaluator, "progress", False), unit="batch")
    for batch in batches:
        progress.update(1)
        counts = _row_counts(requests, batch)
        gates = torch.ones(sum(counts), *shape, dtype=lm.dtype, device=lm.device, requires_grad=True)
        batch_margins = _batch_margins(evaluator, requests, margin, batch, gates)
        batch_margins.sum().backward()  # each item's M depends only on its own rows' gates
        grads = gates.grad.double().cpu().numpy()
        ends = np.cumsum(counts)
        per_item[batch] = -np.stack([grads[end - n:end].sum(axis=0) for n, end in zip(counts, ends)])
        margins[batch] = batch_margins.detach().double().cpu().numpy()
    progress.close()
    return Attribution(per_item=per_item, full_margins=margins,
                       forward_equivalents=FORWARD_BACKWARD_COST * len(margins))
