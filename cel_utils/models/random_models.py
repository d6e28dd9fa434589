"""Random-weight models built from configs, for tests and timing (no download, no checkpoint).

``random_model("llama")`` (:mod:`cel_utils.models.loading`, which wraps :func:`build_random_model`) gives a tiny
model of that family in milliseconds; ``size="3b"`` gives the
geometry of the paper's 3B models, for timing on a GPU. The tokenizer is the default model's, so prompts
are real text; its vocabulary sets the embedding size.
"""
from __future__ import annotations

import torch

# Family -> config class name and the few fields that differ; sizes are filled in by random_model.
FAMILIES: dict[str, dict] = {
    "llama": {"cls": "LlamaConfig"},
    "mistral": {"cls": "MistralConfig"},
    "qwen2": {"cls": "Qwen2Config"},
    "qwen3": {"cls": "Qwen3Config"},
    "smollm3": {"cls": "SmolLM3Config"},
    "gemma3_text": {"cls": "Gemma3TextConfig", "query_pre_attn_scalar": 16},
    # Gemma 3 270M's layout in small: one KV head, heads x head_dim wider than the hidden size, tied embeddings, and
    # sliding-window layers (here two of every three, the real model five of six) whose window of 16 tokens is shorter
    # than every task's prompt, so that it bites wherever the engine builds its own attention mask.
    "gemma3": {"cls": "Gemma3TextConfig", "query_pre_attn_scalar": 16, "sliding_window": 16, "sliding_window_pattern": 3,
               "tie_word_embeddings": True, "geometry": {"tiny": dict(kv_heads=1, hidden=48)}},
    "gpt2": {"cls": "GPT2Config"},
}

SIZES = {
    # tiny: 3 layers x 4 query heads over 2 KV heads, head_dim 16
    "tiny": dict(layers=3, heads=4, kv_heads=2, head_dim=16, hidden=64, ffn=128),
    # the paper's 3B class (Llama-3.2-3B: 28 layers x 24 heads, 8 KV heads, head_dim 128)
    "3b": dict(layers=28, heads=24, kv_heads=8, head_dim=128, hidden=3072, ffn=8192),
}


def random_config(family: str, size: str = "tiny", vocab_size: int = 49152):
    import transformers

    if family not in FAMILIES:
        raise ValueError(f"unknown family {family!r}: choose from {sorted(FAMILIES)}")
    if size not in SIZES:
        raise ValueError(f"unknown size {size!r}: choose from {sorted(SIZES)}")
    spec = dict(FAMILIES[family])
    config_cls = getattr(transformers, spec.pop("cls"))
    s = {**SIZES[size], **spec.pop("geometry", {}).get(size, {})}
    if family == "gpt2":
        return config_cls(vocab_size=vocab_size, n_layer=s["layers"], n_head=s["heads"], n_embd=s["heads"] * s["head_dim"],
                          n_positions=2048, n_inner=s["ffn"], bos_token_id=1, eos_token_id=2, pad_token_id=2, **spec)
    return config_cls(vocab_size=vocab_size, num_hidden_layers=s["layers"], num_attention_heads=s["heads"],
                      num_key_value_heads=s["kv_heads"], head_dim=s["head_dim"], hidden_size=s["hidden"],
                      intermediate_size=s["ffn"], max_position_embeddings=4096,
                      **{"tie_word_embeddings": False, "pad_token_id": 2, "bos_token_id": 1, "eos_token_id": 2, **spec})


def build_random_model(family: str, size: str, *, vocab_size: int, seed: int, device: torch.device,
                       dtype: torch.dtype, attn_implementation: str = "sdpa") -> torch.nn.Module:
    """A randomly initialised causal LM of ``family`` in eval mode, gradients off (wrapped by
    :func:`cel_utils.models.loading.random_model`)."""
    from transformers import AutoModelForCausalLM

    config = random_config(family, size, vocab_size=vocab_size)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation=attn_implementation).to(device).eval()
    model.requires_grad_(False)
    return model
