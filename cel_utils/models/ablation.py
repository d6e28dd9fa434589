"""Ablation of attention heads at the input of the attention output projection: zero (the paper's) or mean.

Ablating head (l, h) multiplies the slice ``h*head_dim:(h+1)*head_dim`` of the o_proj input in layer l by
zero, at every position (prompt and generated tokens alike). Nothing else changes: multiplying the kept
slices by exactly 1.0 leaves them bit-identical.

A zero vector is a state the model never produced, so zero-ablation may hurt or help through that alone. The field's
standard control is *mean-ablation*: the slice is replaced by its mean over a reference set of tokens (here the
discovery items', :mod:`cel_utils.evaluation.means`). Inside ``with replaced_by_means(model, means)``, every ablation
of ``model`` below replaces instead of zeroing (``z -> 0 * z + mean``); outside it, nothing changes. The means are
set on the model for a block, not passed down every call, so that the engine, the shared prefix, decoding and the
naive path all ablate the same way without a parameter threaded through each of them.

Two forms share one hook:

* ``with ablated(model, heads): ...`` -- one head set for the whole batch (the simple API);
* ``with ablated_rows(model, masks): ...`` -- a bool tensor ``[rows, n_layers, n_heads]`` (True = ablate), one
  head set per batch row, which lets the engine stack many interventions into a single forward.

Hooks are removed when the block exits, also on exceptions. :func:`zero_heads_in_weights` is the weight
surgery equivalent (zero the matching o_proj weight columns), used by the exactness tests and the export;
:func:`mean_heads_in_weights` is mean-ablation's (zero the columns and fold the means into the projection's bias).
"""
from __future__ import annotations

from contextlib import contextmanager
from contextvars import ContextVar
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


# The means each model's ablations replace heads by, set for a block by replaced_by_means (keyed by the module's id:
# a model is replaced only while its block is open, so an id cannot outlive its module here).
_MEANS: ContextVar[dict[int, torch.Tensor]] = ContextVar("cel_ablation_means", default={})


@contextmanager
def replaced_by_means(model: nn.Module, means: torch.Tensor | None,
                      geometry: HeadGeometry | None = None) -> Iterator[None]:
    """Inside the block, every ablation of ``model`` replaces a head's slice by ``means`` (float ``[n_layers, n_heads *
    head_dim]``, each layer's mean o_proj input) instead of zeroing it. ``means`` None: zero-ablation, nothing set."""
    if means is None:
        yield
        return
    geometry = geometry or head_geometry(model)
    expected = (geometry.n_layers, geometry.n_heads * geometry.head_dim)
    if tuple(means.shape) != expected:
        raise ValueError(f"mean-ablation needs one mean o_proj input per layer, shape {list(expected)}, got "
                         f"{list(means.shape)}: compute them for this model (cel_utils.evaluation.means)")
    token = _MEANS.set({**_MEANS.get(), id(model): means})
    try:
        yield
    finally:
        _MEANS.reset(token)


def replacement_means(model: nn.Module) -> torch.Tensor | None:
    """The means ``model``'s ablations replace heads by now (None: they zero them)."""
    return _MEANS.get().get(id(model))


def _offsets(model: nn.Module, factors: dict[int, torch.Tensor]) -> dict[int, torch.Tensor] | None:
    """What mean-ablation adds after the factors zeroed the ablated slices: each ablated feature's mean."""
    means = replacement_means(model)
    if means is None:
        return None
    return {layer: (1.0 - keep) * means[layer].to(torch.float32) for layer, keep in factors.items()}


@contextmanager
def ablated(model: nn.Module, heads: Iterable[HeadId], geometry: HeadGeometry | None = None) -> Iterator[None]:
    """Ablate ``heads`` for every row and position inside the block (zero, or the means of
    :func:`replaced_by_means`)."""
    geometry = geometry or head_geometry(model)
    mask = head_mask(heads, geometry)
    factors = {layer: _keep_factors(mask[layer], geometry.head_dim)
               for layer in range(geometry.n_layers) if mask[layer].any()}
    with scaled_head_outputs(model, factors, _offsets(model, factors)):
        yield


@contextmanager
def ablated_rows(model: nn.Module, masks: torch.Tensor, geometry: HeadGeometry | None = None) -> Iterator[None]:
    """Ablate a different head set per batch row; ``masks`` is bool ``[rows, n_layers, n_heads]``."""
    geometry = geometry or head_geometry(model)
    expected = (geometry.n_layers, geometry.n_heads)
    if masks.dim() != 3 or tuple(masks.shape[1:]) != expected:
        raise ValueError(f"per-row head masks must have shape [rows, {expected[0]}, {expected[1]}], got {tuple(masks.shape)}")
    factors = {layer: _keep_factors(masks[:, layer], geometry.head_dim)
               for layer in range(geometry.n_layers) if masks[:, layer].any()}
    with scaled_head_outputs(model, factors, _offsets(model, factors)):
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


@torch.no_grad()
def mean_heads_in_weights(model: nn.Module, heads: Iterable[HeadId], means: torch.Tensor,
                          geometry: HeadGeometry | None = None) -> None:
    """Weight surgery for mean-ablation (in place): zero the columns that read the heads, as
    :func:`zero_heads_in_weights` does, and fold ``W[:, slice] @ mean[slice]`` into the projection's bias (created if it
    has none), which is what the replaced slice contributed. Equal to :func:`ablated` under :func:`replaced_by_means`
    up to float rounding (a sum taken in another order)."""
    geometry = geometry or head_geometry(model)
    projections = attention_output_projections(model)
    for head in head_set(heads):
        geometry.check(head)
        projection = projections[head.layer]
        if not isinstance(projection, nn.Linear):
            raise ValueError("mean_heads_in_weights folds means into an nn.Linear's bias; this projection is a "
                             f"{type(projection).__name__}")
        cols = slice(head.head * geometry.head_dim, (head.head + 1) * geometry.head_dim)
        mean = means[head.layer, cols].to(projection.weight.dtype)
        folded = projection.weight[:, cols] @ mean
        if projection.bias is None:
            projection.bias = nn.Parameter(torch.zeros_like(folded), requires_grad=False)
        projection.bias += folded
        projection.weight[:, cols] = 0
