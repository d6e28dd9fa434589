"""Attribution patching: a first-order estimate of every head's zero-ablation effect from one backward pass.

Put a gate ``g_h`` on every head's slice ``z_h`` of the o_proj input (the same site the ablation uses):
``z_h -> g_h z_h``. All gates at 1 is the full model; ``g_h = 0`` ablates head h. To first order,

    M(ablate h) - M(full)  ~  -dM/dg_h  =  -(dM/dz_h . z_h)   (summed over positions)

so one forward and one backward pass per batch give an estimate for *every* head at once, against one
evaluation per head for exact screening.

``M`` is the task's decision margin, the one its kind's decision (:mod:`cel_utils.evaluation.kinds`) stores in ``Outcome.margin``
(an item is correct iff its margin is positive):

* greedy-match tasks (arithmetic): the smallest, over answer tokens, of (target logit - best other logit);
* multiple choice (BoolQ, HellaSwag): score(gold) - best score(other), the score being the answer's
  log-likelihood, divided by its length in characters for acc_norm.

Both are piecewise smooth (a min or max picks one branch; autograd differentiates that branch). The exact
effect on the same margin is free for every head screened exactly (the outcomes carry margins), so the
estimate can be checked against it, and against the accuracy gain that the search actually ranks by.

MBPP is decided by running generated code and has no margin; it is skipped (:class:`NotImplementedError`).
The teacher-forced log-likelihood of the reference solution would be a possible proxy; it is not implemented.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from cel_utils.evaluation.kinds import kind_of
from cel_utils.models.plumbing import base_model, scaled_head_outputs, unembed

# Backward keeps every layer's activations: cap the tokens per pass (a few hundred MB for SmolLM2-135M).
TOKEN_BUDGET = 2048
# Forward-pass equivalents of one forward + backward over an item (a backward pass costs about two forwards).
FORWARD_BACKWARD_COST = 3.0


@dataclass
class Attribution:
    estimate: np.ndarray  # [layers, heads]: estimated mean change of the margin when the head is zero-ablated
    full_margins: np.ndarray  # [items]: the full model's margins, as computed here (checks against Outcome.margin)
    forward_equivalents: float  # cost, in forward passes of the full model over one item


def _rows(request) -> list[tuple[list[int], list[int], int]]:
    """Per continuation: input tokens (context + answer minus its last token), targets, first scored position."""
    context = list(request.context)
    return [(context + list(cont[:-1]), list(cont), len(context) - 1) for cont in request.continuations]


def _batches(requests, budget: int) -> list[list[int]]:
    """Requests grouped so that all continuations of a request share a batch, under a token budget."""
    order = sorted(range(len(requests)), key=lambda i: -max(len(t) for t, _, _ in _rows(requests[i])))
    batches, current, width, rows = [], [], 0, 0
    for i in order:
        request_rows = _rows(requests[i])
        new_width = max(width, max(len(t) for t, _, _ in request_rows))
        if current and (rows + len(request_rows)) * new_width > budget:
            batches.append(current)
            current, width, rows = [], 0, 0
            new_width = max(len(t) for t, _, _ in request_rows)
        current.append(i)
        width, rows = new_width, rows + len(request_rows)
    if current:
        batches.append(current)
    return batches


def gated_margins(evaluator, gates: torch.Tensor, token_budget: int = TOKEN_BUDGET) -> np.ndarray:
    """Per-item margins with every head's o_proj input scaled by ``gates`` [layers, heads] (1: kept, 0: ablated).

    When ``gates`` requires grad, the gradient of the summed margins is accumulated into ``gates.grad``, one
    backward pass per batch.
    """
    lm, task, requests = evaluator.lm, evaluator.task, evaluator.requests
    margin = kind_of(task).margin
    if margin is None:
        raise NotImplementedError(f"{task.name} is scored by running generated code: it has no differentiable margin")
    geometry, device = lm.geometry, lm.device
    margins = np.zeros(len(requests))
    pad = lm.tokenizer.pad_token_id
    for batch in _batches(requests, token_budget):
        rows = [(i, *row) for i in batch for row in _rows(requests[i])]
        width = max(len(tokens) for _, tokens, _, _ in rows)
        ids = torch.full((len(rows), width), pad, dtype=torch.long)
        for r, (_, tokens, _, _) in enumerate(rows):
            ids[r, :len(tokens)] = torch.tensor(tokens)  # right padding: causal attention never sees a pad
        with torch.set_grad_enabled(gates.requires_grad):
            factors = {layer: gates[layer].repeat_interleave(geometry.head_dim) for layer in range(geometry.n_layers)}
            with scaled_head_outputs(lm.model, factors):
                hidden = base_model(lm.model)(input_ids=ids.to(device)).last_hidden_state
            per_request: dict[int, list[torch.Tensor]] = {}
            for r, (i, _, targets, first) in enumerate(rows):
                logits = unembed(lm.model, hidden[r, first:first + len(targets)])
                per_request.setdefault(i, []).append(logits.to(torch.promote_types(logits.dtype, torch.float32)))
            batch_margins = torch.stack([margin(task, requests[i], per_request[i]) for i in batch])
            if gates.requires_grad:
                batch_margins.sum().backward()
        margins[batch] = batch_margins.detach().double().cpu().numpy()
    return margins


def head_attributions(evaluator, token_budget: int = TOKEN_BUDGET) -> Attribution:
    """Estimated zero-ablation effect of every head on the mean margin over the evaluator's items."""
    lm = evaluator.lm
    gates = torch.ones(lm.geometry.n_layers, lm.geometry.n_heads, dtype=lm.dtype, device=lm.device, requires_grad=True)
    margins = gated_margins(evaluator, gates, token_budget)
    estimate = -gates.grad.double().cpu().numpy() / len(margins)
    return Attribution(estimate=estimate, full_margins=margins,
                       forward_equivalents=FORWARD_BACKWARD_COST * len(margins))
