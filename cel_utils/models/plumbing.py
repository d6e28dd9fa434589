"""Model plumbing: where a family keeps its layers, and the three ways the package reaches inside a forward pass.

Everything that ablates, replays or differentiates through heads goes through this one module:

* :data:`ARCHITECTURES` says where each family keeps its decoder layers and, inside a layer, the attention
  output projection whose *input* holds the per-head outputs (TransformerLens's ``hook_z``); it is the one
  intervention site of the package;
* :func:`scaled_head_outputs` multiplies that input by per-feature factors (the ablation hook, and the gates of
  attribution patching);
* :func:`start_at_layer` and :func:`capture_layer_outputs` replay a forward from a kept residual stream, which
  is how the engine and generation reuse the layers below an ablation;
* :func:`base_model` and :func:`unembed` split the forward at the final hidden state, so that only the
  positions (and vocabulary rows) a scorer reads are unembedded.
"""
from __future__ import annotations

from contextlib import contextmanager
from typing import Any, Iterable, Iterator

import torch
from torch import nn

from cel_utils.models.heads import HeadGeometry

# model_type -> (path of the decoder-layer list from the CausalLM, path of the attention output projection
# inside one layer). GPT-2's projection is a Conv1D (weight stored as [in, out]); the others are nn.Linear.
ARCHITECTURES: dict[str, tuple[str, str]] = {
    "llama": ("model.layers", "self_attn.o_proj"),  # Llama-3.x, SmolLM2
    "mistral": ("model.layers", "self_attn.o_proj"),
    "qwen2": ("model.layers", "self_attn.o_proj"),  # Qwen2, Qwen2.5
    "qwen3": ("model.layers", "self_attn.o_proj"),
    "smollm3": ("model.layers", "self_attn.o_proj"),
    "gemma3_text": ("model.layers", "self_attn.o_proj"),  # Gemma-3 1B (text only)
    "gemma3": ("model.language_model.layers", "self_attn.o_proj"),  # Gemma-3 4B+ (multimodal wrapper)
    "gpt2": ("transformer.h", "attn.c_proj"),
}




def get_module(root: nn.Module, dotted: str) -> nn.Module:
    for part in dotted.split("."):
        root = getattr(root, part)
    return root


def architecture(model_or_config: Any) -> tuple[str, str]:
    config = getattr(model_or_config, "config", model_or_config)
    model_type = getattr(config, "model_type", None)
    if model_type not in ARCHITECTURES:
        raise ValueError(
            f"unsupported architecture {model_type!r}: cel_utils knows where the attention output projection "
            f"is for {sorted(ARCHITECTURES)}; add one line to cel_utils.models.plumbing.ARCHITECTURES for a new family"
        )
    return ARCHITECTURES[model_type]


def decoder_layers(model: nn.Module) -> nn.ModuleList:
    return get_module(model, architecture(model)[0])


def attention_output_projections(model: nn.Module) -> list[nn.Module]:
    """The module, per layer, whose input is the concatenation of the heads' outputs."""
    proj_path = architecture(model)[1]
    return [get_module(layer, proj_path) for layer in decoder_layers(model)]


def head_geometry(model: nn.Module) -> HeadGeometry:
    config = model.config.get_text_config()
    n_heads = getattr(config, "num_attention_heads", None) or config.n_head
    n_kv = getattr(config, "num_key_value_heads", None) or n_heads
    hidden = getattr(config, "hidden_size", None) or config.n_embd
    head_dim = getattr(config, "head_dim", None) or hidden // n_heads
    projections = attention_output_projections(model)
    in_features = _projection_in_features(projections[0])
    if in_features != n_heads * head_dim:
        raise ValueError(
            f"{config.model_type}: o_proj takes {in_features} inputs, not heads x head_dim = {n_heads} x {head_dim}"
        )
    return HeadGeometry(n_layers=len(projections), n_heads=n_heads, n_kv_heads=n_kv, head_dim=head_dim)


def _projection_in_features(module: nn.Module) -> int:
    if isinstance(module, nn.Linear):
        return module.in_features
    return module.weight.shape[0]  # transformers' Conv1D stores [in, out]




# --- Replaying kept states -------------------------------------------------------------------------------

class _Passthrough(nn.Module):
    """Stands in for a skipped layer: returns its input."""

    def forward(self, hidden_states: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        return hidden_states


class _Replay(nn.Module):
    """Stands in for the first layer: returns the kept residual stream after layer l-1."""

    def __init__(self, state: torch.Tensor):
        super().__init__()
        self.state = state

    def forward(self, hidden_states: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        return self.state


@contextmanager
def start_at_layer(model: nn.Module, layer: int, state: torch.Tensor | None) -> Iterator[None]:
    """Run the model's forward from ``layer`` on, with ``state`` as the residual stream entering it."""
    if layer == 0:
        yield
        return
    layers = decoder_layers(model)
    originals = [layers[i] for i in range(layer)]
    try:
        layers[0] = _Replay(state)
        for i in range(1, layer):
            layers[i] = _Passthrough()
        yield
    finally:
        for i, original in enumerate(originals):
            layers[i] = original


@contextmanager
def capture_layer_outputs(model: nn.Module, layers_wanted: Iterable[int]) -> Iterator[dict[int, torch.Tensor]]:
    kept: dict[int, torch.Tensor] = {}
    layers = decoder_layers(model)
    handles = []

    def make_hook(index: int):
        def hook(module, args, output):
            kept[index] = output[0] if isinstance(output, tuple) else output

        return hook

    try:
        for index in sorted(set(layers_wanted)):
            handles.append(layers[index].register_forward_hook(make_hook(index)))
        yield kept
    finally:
        for handle in handles:
            handle.remove()


def base_model(model: nn.Module) -> nn.Module:
    """The module that runs embeddings -> layers -> final norm (``model.model``, GPT-2's ``transformer``)."""
    return get_module(model, architecture(model)[0].rsplit(".", 1)[0])


# Attention kernels that take no custom 4D mask: the engine's packed answers (a block mask) run in sdpa instead.
MASKLESS_ATTENTION = ("flash_attention_2", "flash_attention_3")


@contextmanager
def attention_taking_masks(model: nn.Module) -> Iterator[None]:
    """Inside the block the model's attention accepts a custom 4D mask: a flash-attention kernel is swapped for
    sdpa (the same attention, computed another way), and restored afterwards."""
    current = model.config._attn_implementation
    if current not in MASKLESS_ATTENTION:
        yield
        return
    model.set_attn_implementation("sdpa")
    try:
        yield
    finally:
        model.set_attn_implementation(current)


def unembed(model: nn.Module, hidden: torch.Tensor, rows: torch.Tensor | None = None) -> torch.Tensor:
    """Logits from final (normed) hidden states, optionally for some vocabulary rows only."""
    head = model.get_output_embeddings()
    weight = head.weight if rows is None else head.weight[rows]
    bias = getattr(head, "bias", None)
    bias = None if bias is None else (bias if rows is None else bias[rows])
    logits = nn.functional.linear(hidden.to(weight.device), weight, bias)  # a spread model keeps the head elsewhere
    cap = getattr(model.config.get_text_config(), "final_logit_softcapping", None)
    if cap:
        logits = torch.tanh(logits / cap) * cap
    return logits


@contextmanager
def scaled_head_outputs(model: nn.Module, factors_by_layer: dict[int, torch.Tensor]) -> Iterator[None]:
    """Multiply the o_proj input of each listed layer by its factors inside the block (hooks always removed).

    Factors are ``[features]`` (every row alike) or ``[rows, features]`` (one head set per batch row); they are
    moved once to their projection's device, so a model spread over several devices works unchanged.
    """
    projections = attention_output_projections(model)
    handles = []

    def make_hook(factors: torch.Tensor):
        def hook(module: nn.Module, args: tuple) -> tuple:
            hidden = args[0]
            scale = factors
            if scale.dim() == 2:  # per row: [rows, features] -> broadcast over positions
                if scale.shape[0] != hidden.shape[0]:
                    raise ValueError(f"per-row head mask has {scale.shape[0]} rows but the batch has {hidden.shape[0]}")
                scale = scale[:, None, :]
            return (hidden * scale,) + tuple(args[1:])

        return hook

    try:
        for layer, factors in factors_by_layer.items():
            device = next(projections[layer].parameters()).device
            handles.append(projections[layer].register_forward_pre_hook(make_hook(factors.to(device))))
        yield
    finally:
        for handle in handles:
            handle.remove()


