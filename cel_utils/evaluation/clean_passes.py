"""Clean passes kept from one call of the engine to the next, where a later call starts from the same states.

The engine runs each batch's full model once (its *clean pass*), keeps the residual stream below each intervention's
first ablated layer and starts the intervention from there (:mod:`cel_utils.evaluation.engine`). Within a call that
pass is shared by every intervention; across calls it was run again, and in the ``cpu`` preset's runs the later calls
are small: stage 2 scores three pairs of the pool's heads on the items stage 1 scored 21 interventions on, and the
control scores the frozen set (mean-ablated) on the holdout items the holdout call has just scored it on (zero-ablated).
A clean pass of a batch costs a whole forward, where an intervention from layer l costs its layers from l up, so that
pass was about a third of stage 2's time and most of the control's (from the run info of the main job).

:class:`CleanPasses` keeps, per model and batch input, the states a clean pass kept, and hands them to a later call
that needs no others: the states the later call's own clean pass would have computed from the same inputs, so every
number keeps its bits (tests/test_clean_passes.py; the default model's BoolQ, HellaSwag and arithmetic_1dc artifacts
were byte-identical with and without it). What it holds is bounded (``max_bytes``): a state that does not fit is not
kept, and a call that needs it runs its clean pass as before. A run shares one among its evaluators and empties it
after the screen, after the search and after the control (:func:`cel_utils.pipeline.protocol.run_cel`). The guarded
precision's rechecks after its fast pass read them too (:func:`cel_utils.evaluation.guarded.pair_stats`): the fast pass
runs fp32's clean pass on fp32's model, so its kept states are those a recheck would compute.
"""
from __future__ import annotations

import hashlib
from typing import Iterable

import torch

from cel_utils.models.loading import LoadedModel

# What one run's kept clean passes may hold. The cpu preset's largest need is stage 1's states for stage 2 on the
# default model's BoolQ: 20 layers x 45 MB (128 items); a holdout's one layer is 15-180 MB.
CLEAN_PASS_BYTES = 1 << 30


class CleanPasses:
    """The states clean passes kept, by model and batch input, for later calls of the engine (module docstring)."""

    def __init__(self, max_bytes: int = CLEAN_PASS_BYTES):
        self.max_bytes = max_bytes
        self.entries: dict[str, dict[int, torch.Tensor]] = {}
        self.models: dict[int, torch.nn.Module] = {}  # held, so that no other model takes a named one's id
        self.bytes = 0
        self.reused = 0  # clean passes a call did not run, as kept states served it
        self.declined = 0  # states not kept because they did not fit

    def key(self, lm: LoadedModel, ids: torch.Tensor, positions: torch.Tensor | None, attn,
            prefix: Iterable[int]) -> str:
        """A batch's name: a hash of the model (its identity, dtype and device) and of everything its clean pass reads
        (the tokens, positions, additive mask or masks, and the shared prefix before them), so equal names mean equal
        inputs to the same model."""
        self.models[id(lm.model)] = lm.model
        digest = hashlib.sha256(repr((id(lm.model), str(lm.dtype), str(lm.device), tuple(prefix))).encode())
        masks = attn if isinstance(attn, dict) else {"": attn}
        for part in [ids, positions, *(masks[name] for name in sorted(masks))]:
            digest.update(b"-" if part is None else repr((part.dtype, tuple(part.shape))).encode())
            if part is not None:
                digest.update(part.detach().contiguous().cpu().view(torch.uint8).numpy().tobytes())
        return digest.hexdigest()

    def get(self, key: str, layers: Iterable[int]) -> dict[int, torch.Tensor] | None:
        """The kept states after each of ``layers`` for the batch ``key``, or None unless every one is held."""
        held = self.entries.get(key, {})
        layers = set(layers)
        if not layers <= held.keys():
            return None
        self.reused += bool(layers)  # with none wanted, no pass is needed: nothing was reused
        return {layer: held[layer] for layer in layers}

    def put(self, key: str, kept: dict[int, torch.Tensor]) -> None:
        """Keep a clean pass's states for batch ``key``, each while it fits under ``max_bytes``."""
        held = self.entries.setdefault(key, {})
        for layer, state in sorted(kept.items()):
            size = state.numel() * state.element_size()
            if layer in held:
                continue
            if self.bytes + size > self.max_bytes:
                self.declined += 1
                continue
            held[layer] = state
            self.bytes += size

    def clear(self) -> None:
        """Let go of every kept state (the calls that could reuse them are over)."""
        self.entries.clear()
        self.models.clear()
        self.bytes = 0

    def close(self) -> None:
        """Let go of every kept state and keep none from now on (no later call will reuse them)."""
        self.clear()
        self.max_bytes = 0
