"""Model plumbing: where a family keeps its layers, and the three ways the package reaches inside a forward pass.

Everything that ablates, replays or differentiates through heads goes through this one module:

* :data:`ARCHITECTURES` says where each family keeps its decoder layers and, inside a layer, the attention
  output projection whose *input* holds the per-head outputs (TransformerLens's ``hook_z``); it is the one
  intervention site of the package;
* :func:`scaled_head_outputs` multiplies that input by per-feature factors and adds offsets (the ablation hook, zero
  or mean, and the gates of attribution patching);
* :func:`start_at_layer` and :func:`capture_layer_outputs` replay a forward from a kept residual stream, which
  is how the engine and generation reuse the layers below an ablation;
* :func:`base_model` and :func:`unembed` split the forward at the final hidden state, so that only the
  positions (and vocabulary rows) a scorer reads are unembedded.

What a model computes in and where its inputs go are read from the model itself (:func:`input_dtype_device`), never
from a copy taken when it was loaded, and the tensors handed to a layer (head factors and gates, a custom attention
mask) are checked against what that layer actually receives: a model cast with ``.double()`` or moved after loading
gets inputs made for it, or a clear error, never a silently wrong number.
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


def input_dtype_device(model: nn.Module) -> tuple[torch.dtype, torch.device]:
    """The dtype the model computes in and the device its inputs go to: its input embeddings', read each time.

    A model spread over devices (``device_map``) takes its inputs where its embeddings are; each layer moves them on.
    """
    weight = model.get_input_embeddings().weight
    dtype = weight.dtype if weight.is_floating_point() else getattr(model, "dtype", torch.float32)
    return dtype, weight.device


def attention_modules(model: nn.Module) -> list[nn.Module]:
    """Each layer's attention module (the parent of its output projection)."""
    attention_path = architecture(model)[1].rsplit(".", 1)[0]
    return [get_module(layer, attention_path) for layer in decoder_layers(model)]


# The sliding windows of a model's attention: None (every layer attends to the whole row), an int (every layer slides
# by that window), or per layer type (``config.layer_types``) its window, None for a full-attention type.
AttentionWindows = int | dict[str, int | None] | None


def attention_windows(model: nn.Module) -> AttentionWindows:
    """Which sliding windows the model's layers attend through (Gemma 3: five sliding layers per full one; Mistral: all
    sliding); what a custom attention mask must reproduce, since the model applies none to it."""
    config = model.config.get_text_config()
    window = getattr(config, "sliding_window", None) if getattr(config, "use_sliding_window", True) else None
    if not window:
        return None
    types = set(getattr(config, "layer_types", None) or ())
    if types and "sliding_attention" not in types:  # a window is configured but no layer slides (Qwen2's default)
        return None
    if len(types) > 1:
        return {kind: window if kind == "sliding_attention" else None for kind in sorted(types)}
    return window


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
def attention_with_mask(model: nn.Module, mask: torch.Tensor | None) -> Iterator[None]:
    """Inside the block the model's attention takes ``mask``, a custom additive 4D mask (None: nothing changes).

    A flash-attention kernel, which takes no custom mask, is swapped for sdpa (the same attention, computed another
    way) and restored afterwards. Every layer's attention checks that a floating mask arrives in its queries' dtype and
    on their device: PyTorch's CPU sdpa accepts a float32 mask for float64 queries and silently computes wrong
    attention with it (torch 2.13: outputs off by up to 3.5 at 40 to 200 positions, on AVX2 and AVX-512 CPUs alike).
    """
    if mask is None:
        yield
        return
    current = model.config._attn_implementation
    swapped = current in MASKLESS_ATTENTION
    handles = [module.register_forward_pre_hook(_mask_check(layer), with_kwargs=True)
               for layer, module in enumerate(attention_modules(model))]
    if swapped:
        model.set_attn_implementation("sdpa")
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()
        if swapped:
            model.set_attn_implementation(current)


def _mask_check(layer: int):
    def hook(module: nn.Module, args: tuple, kwargs: dict) -> None:
        mask = kwargs.get("attention_mask")
        hidden = kwargs.get("hidden_states", args[0] if args else None)
        if not isinstance(mask, torch.Tensor) or not mask.is_floating_point() or hidden is None:
            return
        if (mask.dtype, mask.device) != (hidden.dtype, hidden.device):
            raise ValueError(
                f"layer {layer}'s attention was handed a {mask.dtype} mask on {mask.device} for {hidden.dtype} queries "
                f"on {hidden.device}: PyTorch may compute wrong attention from such a mask without an error. Build the "
                "mask in the dtype and on the device the model computes in, as read from the model itself "
                "(cel_utils.models.plumbing.input_dtype_device, LoadedModel.dtype and .device)")

    return hook


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
def scaled_head_outputs(model: nn.Module, factors_by_layer: dict[int, torch.Tensor],
                        offsets_by_layer: dict[int, torch.Tensor] | None = None) -> Iterator[None]:
    """Multiply the o_proj input of each listed layer by its factors inside the block, then add its offsets if given
    (hooks always removed): ``z -> z * factors + offsets``, which is zero-ablation with factors 0 and no offsets, and
    mean-ablation with factors 0 and the mean as offset (:mod:`cel_utils.models.ablation`).

    Factors and offsets are ``[features]`` (every row alike) or ``[rows, features]`` (one head set per batch row). They
    are put in the dtype and on the device of their projection's weight once (a model spread over several devices works
    unchanged; gates keep their gradient through the cast), and an input arriving in another dtype is refused: a
    product of two dtypes would silently compute in the wider one. Without offsets the hook computes exactly what it
    computed before offsets existed (one product, nothing added).
    """
    projections = attention_output_projections(model)
    offsets_by_layer = offsets_by_layer or {}
    handles = []

    def per_row(layer: int, values: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        if values.dim() == 2:  # per row: [rows, features] -> broadcast over positions
            if values.shape[0] != hidden.shape[0]:
                raise ValueError(f"per-row head mask has {values.shape[0]} rows but the batch has {hidden.shape[0]}")
            return values[:, None, :]
        return values

    def make_hook(layer: int, factors: torch.Tensor, offsets: torch.Tensor | None, quantized: bool):
        def hook(module: nn.Module, args: tuple) -> tuple:
            hidden = args[0]
            scale = factors.to(hidden.dtype) if quantized else factors
            if hidden.dtype != scale.dtype:
                raise ValueError(f"layer {layer}'s o_proj input is {hidden.dtype} but its weight is {scale.dtype}: the "
                                 "model computes in more than one dtype; cast it whole (model.to(dtype)) before "
                                 "ablating heads")
            out = hidden * per_row(layer, scale, hidden)
            if offsets is not None:
                out = out + per_row(layer, offsets.to(hidden.dtype) if quantized else offsets, hidden)
            return (out,) + tuple(args[1:])

        return hook

    try:
        for layer, factors in factors_by_layer.items():
            weight = projections[layer].weight
            # a quantized weight (int8) says nothing about the dtype its input comes in: cast to the input's there
            quantized = not weight.is_floating_point()
            dtype = factors.dtype if quantized else weight.dtype
            factors = factors.to(device=weight.device, dtype=dtype)
            offsets = offsets_by_layer.get(layer)
            offsets = None if offsets is None else offsets.to(device=weight.device, dtype=dtype)
            handles.append(projections[layer].register_forward_pre_hook(make_hook(layer, factors, offsets, quantized)))
        yield
    finally:
        for handle in handles:
            handle.remove()
