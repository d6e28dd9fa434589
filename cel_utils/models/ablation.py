"""Zero-ablation of attention heads at the input of the attention output projection.

Ablating head (l, h) multiplies the slice ``h*head_dim:(h+1)*head_dim`` of the o_proj input in layer l by
zero, at every position (prompt and generated tokens alike). Nothing else changes: multiplying the kept
slices by exactly 1.0 leaves them bit-identical.

Two forms share one hook:

* ``with ablated(model, heads): ...`` -- one head set for the whole batch (the simple API);
* ``with ablated_rows(model, masks): ...`` -- a bool tensor ``[rows, n_layers, n_heads]`` (True = ablate), one
  head set per batch row, which lets the engine stack many interventions into a single forward.

Hooks are removed when the block exits, also on exceptions. :func:`zero_heads_in_weights` is the weight
surgery equivalent (zero the matching o_proj weight columns), used by the exactness tests and the export.
"""
from __future__ import annotations

from contextlib import contextmanager
from typing import Iterable, Iterator

import torch
from torch import nn

from cel_utils.models.heads import HeadGeometry, HeadId, head_set
from cel_utils.models.plumbing import attention_output_projections, head_geometry, scaled_head_outputs


def head_mask(heads: Iterable[HeadId], geometry: HeadGeometry) -> torch.Tensor:
    """Bool ``[n_layers, n_heads]``, True where a head is ablated."""
    mask = torch.zeros(geometry.n_layers, geometry.n_heads, dtype=torch.bool)
    for head in head_set(heads):
        geometry.check(head)
        mask[head.layer, head.head] = True
    return mask


def _keep_factors(layer_mask: torch.Tensor, head_dim: int) -> torch.Tensor:
    """Expand a [..., n_heads] ablation mask to multiplicative factors (1.0 kept, 0.0 ablated) over the o_proj input
    features; :func:`cel_utils.models.plumbing.scaled_head_outputs` puts them in their projection's dtype and device."""
    return (~layer_mask).to(torch.float32).repeat_interleave(head_dim, dim=-1)


@contextmanager
def ablated(model: nn.Module, heads: Iterable[HeadId], geometry: HeadGeometry | None = None) -> Iterator[None]:
    """Zero-ablate ``heads`` for every row and position inside the block."""
    geometry = geometry or head_geometry(model)
    mask = head_mask(heads, geometry)
    factors = {layer: _keep_factors(mask[layer], geometry.head_dim)
               for layer in range(geometry.n_layers) if mask[layer].any()}
    with scaled_head_outputs(model, factors):
        yield


@contextmanager
def ablated_rows(model: nn.Module, masks: torch.Tensor, geometry: HeadGeometry | None = None) -> Iterator[None]:
    """Zero-ablate a different head set per batch row; ``masks`` is bool ``[rows, n_layers, n_heads]``."""
    geometry = geometry or head_geometry(model)
    expected = (geometry.n_layers, geometry.n_heads)
    if masks.dim() != 3 or tuple(masks.shape[1:]) != expected:
        raise ValueError(f"per-row head masks must have shape [rows, {expected[0]}, {expected[1]}], got {tuple(masks.shape)}")
    factors = {layer: _keep_factors(masks[:, layer], geometry.head_dim)
               for layer in range(geometry.n_layers) if masks[:, layer].any()}
    with scaled_head_outputs(model, factors):
        yield


@torch.no_grad()
def zero_heads_in_weights(model: nn.Module, heads: Iterable[HeadId], geometry: HeadGeometry | None = None) -> None:
    """Weight surgery: zero the o_proj weight columns that read the ablated heads (in place).

    Equivalent to :func:`ablated` for bias-free projections; with a bias (GPT-2's c_proj) the bias still
    adds after the zeroed heads, exactly as it does under the hook, so the two agree there as well.
    """
    geometry = geometry or head_geometry(model)
    projections = attention_output_projections(model)
    for head in head_set(heads):
        geometry.check(head)
        cols = slice(head.head * geometry.head_dim, (head.head + 1) * geometry.head_dim)
        weight = projections[head.layer].weight
        if isinstance(projections[head.layer], nn.Linear):
            weight[:, cols] = 0  # Linear: [out, in]
        else:
            weight[cols, :] = 0  # Conv1D: [in, out]
