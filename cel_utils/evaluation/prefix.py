"""A token prefix that many rows share (few-shot exemplars, a chat template's system turn), computed once per head set.

Below a head set's lowest ablated layer, the prefix's keys and values are the full model's, so one clean pass over the
prefix provides them and the residual stream from which an ablated pass starts; above it, one stacked pass per
starting layer computes them for every head set (the engine's below-layer reuse). Causal attention makes a row that
continues from these keys and values (positions continuing from the prefix) compute what it would have computed with
the prefix written out in full. MBPP's decoding (:mod:`cel_utils.evaluation.generation`) and the engine's
log-likelihood forwards (:mod:`cel_utils.evaluation.engine`) both use it.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch
from transformers import DynamicCache

from cel_utils.models.ablation import ablated_rows, head_mask
from cel_utils.models.loading import LoadedModel
from cel_utils.models.plumbing import base_model, capture_layer_outputs, start_at_layer

MIN_SHARED_PREFIX = 32  # shorter shared prefixes are not worth a separate forward


def shared_prefix_length(contexts: Sequence[Sequence[int]]) -> int:
    """Tokens all contexts start with, leaving every row at least one token of its own."""
    shortest = min(len(c) for c in contexts)
    n = 0
    while n < shortest - 1 and all(c[n] == contexts[0][n] for c in contexts):
        n += 1
    return n


def sliding_window(lm: LoadedModel) -> int | None:
    """The model's sliding attention window, if it has one (a prefix longer than it cannot be reused this way)."""
    config = lm.model.config.get_text_config()
    return getattr(config, "sliding_window", None) if getattr(config, "use_sliding_window", True) else None


@dataclass
class CleanPrefix:
    """The full model's pass over a prefix: its keys and values at every layer (one row), and the residual stream after
    every layer but the last (what an ablated pass starting at any layer resumes from). The residual streams are the
    larger part: layers x prefix tokens x hidden size (SmolLM2-135M, a 100-token prefix: 7 MB in fp32; an 8B model
    with a 600-token prefix: 0.16 GB in bf16), held for one call."""

    kv: list[tuple[torch.Tensor, torch.Tensor]]
    kept: dict[int, torch.Tensor]


def clean_prefix(lm: LoadedModel, prefix: Sequence[int]) -> CleanPrefix:
    """One clean pass over ``prefix``, kept for every head set of a call: it does not depend on the heads, and running
    it again for every stacked forward took two fifths of a 3-shot arithmetic_1dc evaluation's fp32 time (32 items x 29
    interventions: 45 s -> 26 s; book/speed.md)."""
    n_layers = lm.geometry.n_layers
    cache = DynamicCache(config=lm.model.config)
    with capture_layer_outputs(lm.model, range(n_layers - 1)) as kept:
        base_model(lm.model)(input_ids=torch.tensor([list(prefix)], device=lm.device), cache=cache, use_cache=True)
    return CleanPrefix([(cache.layers[layer].keys[0], cache.layers[layer].values[0]) for layer in range(n_layers)],
                       dict(kept))


def prefix_states(lm: LoadedModel, prefix: Sequence[int], heads, masks: torch.Tensor | None, n_rows: int,
                  clean: CleanPrefix):
    """Keys and values of ``prefix`` for every row: ``states[row][layer] = (keys, values)``.

    Computed once per distinct head set, and only from that set's lowest ablated layer on: below it the
    prefix's keys and values are the full model's, so the clean pass (``clean``, made once per call by
    :func:`clean_prefix`) provides them and the residual stream that the ablated pass starts from (the engine's
    below-layer reuse, see :mod:`cel_utils.evaluation.engine`). ``lm`` runs the ablated passes: the model itself, or
    the guarded precision's bfloat16 copy above a float32 clean pass (the engine's ``above``), and every state comes in
    ``lm``'s dtype.
    """
    if masks is None:
        sets, index = head_mask(heads, lm.geometry)[None], torch.zeros(n_rows, dtype=torch.long)
    else:
        sets, index = torch.unique(masks.flatten(1), dim=0, return_inverse=True)
        sets = sets.view(-1, *masks.shape[1:])
    n_layers = lm.geometry.n_layers
    first = [int(s.any(dim=1).nonzero()[0, 0]) if s.any() else n_layers for s in sets]
    ids = torch.tensor([list(prefix)], device=lm.device)
    per_set = [[tuple(t.to(lm.dtype) for t in clean.kv[layer]) for layer in range(n_layers)] for _ in first]
    for start in sorted(set(first) - {n_layers}):
        group = [u for u, f in enumerate(first) if f == start]
        cache = DynamicCache(config=lm.model.config)
        state = clean.kept[start - 1].to(lm.dtype).expand(len(group), -1, -1) if start else None
        with ablated_rows(lm.model, sets[group].to(lm.device), lm.geometry), start_at_layer(lm.model, start, state):
            base_model(lm.model)(input_ids=ids.expand(len(group), -1), cache=cache, use_cache=True)
        for row, u in enumerate(group):
            per_set[u][start:] = [(cache.layers[layer].keys[row], cache.layers[layer].values[row])
                                  for layer in range(start, n_layers)]
    return [per_set[u] for u in index.tolist()]


def prefix_cache(lm: LoadedModel, states: list, repeats: int) -> DynamicCache:
    """A growing KV cache holding ``states`` (one per head set, from :func:`prefix_states`), each repeated for
    ``repeats`` consecutive rows: the rows of one stacked forward that continue after the prefix."""
    cache = DynamicCache(config=lm.model.config)
    for layer_index, layer in enumerate(cache.layers):
        keys = torch.stack([state[layer_index][0] for state in states]).repeat_interleave(repeats, dim=0)
        values = torch.stack([state[layer_index][1] for state in states]).repeat_interleave(repeats, dim=0)
        layer.lazy_initialization(keys, values)
        layer.keys, layer.values = keys, values
    return cache
