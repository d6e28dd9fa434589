"""The means that mean-ablation replaces heads by: each layer's o_proj input averaged over the discovery items' tokens.

Mean-ablation (:func:`cel_utils.models.ablation.replaced_by_means`) is the field's standard control for zero-ablation:
a zero vector is a state the model never produced, while a head's mean output is one it produces on average. The
reference set is the run's *discovery* items, never the holdout: every token of every discovery prompt as the model
reads it (the few-shot exemplars included), weighted alike, one clean forward of the full model. The result is one
float32 vector per layer, ``[n_layers, n_heads * head_dim]``, and every head's mean is its slice of it.

The means depend only on the model, its dtype and device, the attention kernel, the library versions and the
discovery prompts' tokens, so they are computed once per (model, task, seed) and kept in the cache
(``<cache>/means/<key>.pt``) like the evaluation store's records; their sha256 names them in the store's keys and the
artifact.
"""
from __future__ import annotations

import hashlib
import io
import json
from dataclasses import dataclass
from typing import Sequence

import torch

from cel_utils.models.loading import LoadedModel
from cel_utils.models.plumbing import attention_output_projections, base_model
from cel_utils.paths import atomic_write, cache_dir

MEANS_VERSION = "1"  # bump when what the means are, or how they are computed, changes
MEANS_BATCH_ROWS = 8  # fixed, not the run's batch_size: a float's last bits depend on the batch it was summed in


@dataclass(frozen=True)
class HeadMeans:
    """Each layer's mean o_proj input over ``n_tokens`` tokens of ``n_items`` prompts, and its sha256 (of the bytes)."""

    values: torch.Tensor  # float32 [n_layers, n_heads * head_dim], on the CPU
    n_items: int
    n_tokens: int

    @property
    def sha256(self) -> str:
        return hashlib.sha256(self.values.contiguous().numpy().tobytes()).hexdigest()

    def to_json(self) -> dict:
        return {"items": "discovery", "n_items": self.n_items, "n_tokens": self.n_tokens, "sha256": self.sha256,
                "what": "each layer's o_proj input averaged over every token of the discovery prompts"}


@torch.no_grad()
def compute_means(lm: LoadedModel, contexts: Sequence[Sequence[int]],
                  batch_size: int = MEANS_BATCH_ROWS) -> HeadMeans:
    """One clean forward over ``contexts`` (token ids), summing every layer's o_proj input over the real tokens.

    Rows are right-padded with no attention mask: under causal attention no real token sees a pad, so each real
    position computes what it would alone (as the naive scorer does), and the pads are left out of the sums."""
    if not contexts:
        raise ValueError("mean-ablation needs at least one discovery prompt to average over")
    projections = attention_output_projections(lm.model)
    geometry = lm.geometry
    sums = torch.zeros(geometry.n_layers, geometry.n_heads * geometry.head_dim, dtype=torch.float64)
    valid: list[torch.Tensor] = []

    def make_hook(layer: int):
        def hook(module, args):
            hidden = args[0].detach().to(device="cpu", dtype=torch.float64)
            sums[layer] += (hidden * valid[0][:, :, None]).sum(dim=(0, 1))

        return hook

    handles = [projection.register_forward_pre_hook(make_hook(layer)) for layer, projection in enumerate(projections)]
    order = sorted(range(len(contexts)), key=lambda i: -len(contexts[i]))
    pad = lm.tokenizer.pad_token_id if lm.tokenizer.pad_token_id is not None else 0
    try:
        for start in range(0, len(order), batch_size):
            batch = [list(contexts[i]) for i in order[start:start + batch_size]]
            width = max(map(len, batch))
            ids = torch.full((len(batch), width), pad, dtype=torch.long)
            mask = torch.zeros((len(batch), width), dtype=torch.float64)
            for row, tokens in enumerate(batch):
                ids[row, :len(tokens)] = torch.tensor(tokens)
                mask[row, :len(tokens)] = 1.0
            valid[:] = [mask]
            base_model(lm.model)(input_ids=ids.to(lm.device))  # no unembedding: only the layers are read
    finally:
        for handle in handles:
            handle.remove()
    n_tokens = sum(map(len, contexts))
    return HeadMeans((sums / n_tokens).to(torch.float32), len(contexts), n_tokens)


def means_key(lm: LoadedModel, contexts: Sequence[Sequence[int]]) -> str:
    """What the means depend on, hashed: the name of their cache file."""
    import transformers

    parts = {"version": MEANS_VERSION, "model": lm.fingerprint, "dtype": str(lm.dtype), "device": lm.device.type,
             "attn_implementation": getattr(lm.model.config, "_attn_implementation", None),
             "torch": torch.__version__, "transformers": transformers.__version__,
             "contexts": hashlib.sha256(json.dumps([list(c) for c in contexts]).encode()).hexdigest()}
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()[:32]


def discovery_means(lm: LoadedModel, contexts: Sequence[Sequence[int]], cache: bool = True) -> HeadMeans:
    """:func:`compute_means` read from the cache when computed before (``cache``: keep and reuse them)."""
    path = cache_dir() / "means" / f"{means_key(lm, contexts)}.pt"
    if cache and path.is_file():
        try:
            stored = torch.load(path, map_location="cpu", weights_only=True)
            return HeadMeans(stored["values"], int(stored["n_items"]), int(stored["n_tokens"]))
        except Exception:  # noqa: BLE001 - a damaged cache entry is recomputed
            pass
    means = compute_means(lm, contexts)
    if cache:
        buffer = io.BytesIO()
        torch.save({"values": means.values, "n_items": means.n_items, "n_tokens": means.n_tokens}, buffer)
        atomic_write(path, buffer.getvalue())
    return means
