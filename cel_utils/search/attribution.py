"""Attribution patching: a first-order estimate of every head's zero-ablation effect, per item, from one backward pass.

Put a gate ``g_h`` on every head's slice ``z_h`` of the o_proj input (the same site the ablation uses):
``z_h -> g_h z_h``. All gates at 1 is the full model; ``g_h = 0`` ablates head h. To first order,

    M(ablate h) - M(full)  ~  -dM/dg_h  =  -(dM/dz_h . z_h)   (summed over positions)

so one forward and one backward pass per batch give an estimate for *every* head at once, against one evaluation per
head for exact screening. An item is one batch row, laid out as the engine lays it out (HellaSwag's endings packed
after one copy of the context, :mod:`cel_utils.evaluation.layout`), with its own gates, so the backward pass of the
summed margins leaves each item's own gradient in its row: the estimate is per item (``Attribution.per_item``), and a
resampled item set is a mean over other rows, with no new pass.

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

from cel_utils.evaluation.batching import length_batches
from cel_utils.evaluation.kinds import kind_of
from cel_utils.evaluation.layout import Row, layout, row_inputs
from cel_utils.models.plumbing import attention_windows, attention_with_mask, base_model, scaled_head_outputs, unembed
from cel_utils.progress import progress_bar
from cel_utils.tasks.scoring import at_least_float32

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


def _row(request) -> Row:
    """The request as one row, laid out as the engine lays it out (:mod:`cel_utils.evaluation.layout`): one-token
    answers (BoolQ's " yes" and " no") read at the context's last position, several longer ones (HellaSwag's
    endings) packed after one copy of the context."""
    return layout(request, shortcut=all(len(c) == 1 for c in request.continuations))


def _batches(rows: list[Row], budget: int) -> list[list[int]]:
    """Rows grouped longest first under a token budget (rows x the batch's widest)."""
    order = sorted(range(len(rows)), key=lambda i: -len(rows[i].tokens))
    spans = length_batches([len(rows[i].tokens) for i in order], len(rows), budget, max_padding=1.0)
    return [order[start:stop] for start, stop in spans]


def _target(evaluator):
    """What to attribute for the evaluator's task: its requests and the differentiable M of one request."""
    kind = kind_of(evaluator.task)
    requests = kind.attribution_requests(evaluator)
    return requests, kind.attribution_margin


def _batch_margins(evaluator, requests, margin, rows: list[Row], batch: list[int], gates: torch.Tensor
                   ) -> torch.Tensor:
    """M of each request in ``batch`` with its row's o_proj inputs scaled by its own ``gates`` [rows, layers, heads]
    (1: kept, 0: ablated); rows right padded (no real position attends to a pad)."""
    lm, geometry = evaluator.lm, evaluator.lm.geometry
    ids, positions, attn = row_inputs([rows[i] for i in batch], lm.tokenizer.pad_token_id, lm.dtype, lm.device,
                                      attention_windows(lm.model))
    factors = {layer: gates[:, layer].repeat_interleave(geometry.head_dim, dim=-1) for layer in range(geometry.n_layers)}
    # Under mean-ablation a gate interpolates between the head's output and its mean (g z + (1 - g) mean), so that
    # g = 0 is the evaluator's own ablation and the gradient is that of moving towards it.
    means = getattr(evaluator, "means", None)
    offsets = None if means is None else {layer: (1 - factors[layer]) * means.values[layer].to(lm.device)
                                          for layer in factors}
    with attention_with_mask(lm.model, attn), scaled_head_outputs(lm.model, factors, offsets):
        hidden = base_model(lm.model)(input_ids=ids, position_ids=positions, attention_mask=attn).last_hidden_state
    margins = []
    for r, i in enumerate(batch):
        logits = [unembed(lm.model, hidden[r, read]) for read, _ in rows[i].scored]
        margins.append(margin(evaluator.task, requests[i],
                              [at_least_float32(x) for x in logits]))
    return torch.stack(margins)


def gated_margins(evaluator, gates: torch.Tensor, token_budget: int = TOKEN_BUDGET) -> np.ndarray:
    """Per-item M with every head's o_proj input scaled by ``gates`` [layers, heads], the same for every item."""
    requests, margin = _target(evaluator)
    rows = [_row(r) for r in requests]
    out = np.zeros(len(requests))
    with torch.no_grad():
        for batch in _batches(rows, token_budget):
            out[batch] = _batch_margins(evaluator, requests, margin, rows, batch,
                                        gates.expand(len(batch), -1, -1)).double().cpu().numpy()
    return out


def head_attributions(evaluator, token_budget: int = TOKEN_BUDGET) -> Attribution:
    """Estimated zero-ablation effect of every head on every item's M, from one forward and backward pass per batch."""
    lm = evaluator.lm
    requests, margin = _target(evaluator)
    shape = (lm.geometry.n_layers, lm.geometry.n_heads)
    per_item, margins = np.zeros((len(requests), *shape)), np.zeros(len(requests))
    rows = [_row(r) for r in requests]
    batches = _batches(rows, token_budget)
    progress = progress_bar(len(batches), f"{evaluator.task.name}: attribution (forward + backward)",
                            getattr(evaluator, "progress", False), unit="batch")
    for batch in batches:
        progress.update(1)
        gates = torch.ones(len(batch), *shape, dtype=lm.dtype, device=lm.device, requires_grad=True)
        batch_margins = _batch_margins(evaluator, requests, margin, rows, batch, gates)
        batch_margins.sum().backward()  # each item's M depends only on its own row's gates
        per_item[batch] = -gates.grad.double().cpu().numpy()
        margins[batch] = batch_margins.detach().double().cpu().numpy()
    progress.close()
    return Attribution(per_item=per_item, full_margins=margins,
                       forward_equivalents=FORWARD_BACKWARD_COST * len(margins))
