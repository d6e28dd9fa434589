"""A token prefix that many rows share (few-shot exemplars, a chat template's system turn), computed once per head set.

Below a head set's lowest ablated layer, the prefix's keys and values are the full model's, so one clean pass over the
prefix provides them and the residual stream from which an ablated pass starts; above it, one stacked pass per
starting layer computes them for every head set (the engine's below-layer reuse). Causal attention makes a row that
continues from these keys and values (positions continuing from the prefix) compute what it would have computed with
the prefix written out in full. MBPP's decoding (:mod:`cel_utils.evaluation.generation`) and the engine's
log-likelihood forwards (:mod:`cel_utils.evaluation.engine`) both use it.
"""
from __future__ import annotations

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


def prefix_states(lm: LoadedModel, prefix: Sequence[int], heads, masks: torch.Tensor | None, n_rows: int,
                  fast_lm: LoadedModel | None = None):
    """Keys and values of ``prefix`` for every row: ``states[row][layer] = (keys, values)``.

    Computed once per distinct head set, and only from that set's lowest ablated layer on: below it the
    prefix's keys and values are the full model's, so one clean pass provides them and the residual stream
    that the ablated pass starts from (the engine's below-layer reuse, see :mod:`cel_utils.evaluation.engine`).
    With ``fast_lm`` (the guarded precision's bfloat16 copy) the clean pass is ``lm``'s and the ablated passes
    ``fast_lm``'s, and every state comes in ``fast_lm``'s dtype.
    """
    if masks is None:
        sets, index = head_mask(heads, lm.geometry)[None], torch.zeros(n_rows, dtype=torch.long)
    else:
        sets, index = torch.unique(masks.flatten(1), dim=0, return_inverse=True)
        sets = sets.view(-1, *masks.shape[1:])
    n_layers = lm.geometry.n_layers
    first = [int(s.any(dim=1).nonzero()[0, 0]) if s.any() else n_layers for s in sets]
    base, ids = base_model(lm.model), torch.tensor([list(prefix)], device=lm.device)

    def kv(cache, layer: int, row: int):
        return cache.layers[layer].keys[row], cache.layers[layer].values[row]

    clean = DynamicCache(config=lm.model.config)
    # Keep only the residual streams an ablated pass resumes from (as the engine does), not every layer's.
    with capture_layer_outputs(lm.model, {f - 1 for f in first if 0 < f < n_layers}) as kept:
        base(input_ids=ids, cache=clean, use_cache=True)
    fast = fast_lm or lm
    per_set = [[tuple(t.to(fast.dtype) for t in kv(clean, layer, 0)) for layer in range(n_layers)] for _ in first]
    for start in sorted(set(first) - {n_layers}):
        group = [u for u, f in enumerate(first) if f == start]
        cache = DynamicCache(config=fast.model.config)
        state = kept[start - 1].to(fast.dtype).expand(len(group), -1, -1) if start else None
        with ablated_rows(fast.model, sets[group].to(lm.device), lm.geometry), start_at_layer(fast.model, start, state):
            base_model(fast.model)(input_ids=ids.expand(len(group), -1), cache=cache, use_cache=True)
        for row, u in enumerate(group):
            per_set[u][start:] = [kv(cache, layer, row) for layer in range(start, n_layers)]
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
