"""Finished evaluations on disk, so that a killed run resumes where it stopped and ends bit for bit the same.

What is kept is what a decision needs, not the decision: per batch of items and intervention, the
continuation statistics of every request (log-likelihood tasks; exact float64 values) or the generated
completions (MBPP). The scorer runs again on them, so a changed decision rule needs no new forward pass.

Keys. A *context* is everything that changes the numbers apart from the items and the intervention: the
evaluator and its version (``cel_utils.evaluation.engine.ENGINE_VERSION``; a test fails when the code it stands for,
``store_sources``, changes without it), the model's weights (``LoadedModel.fingerprint``; a GGUF model's by its
dequantized checkpoint), dtype, device type, attention kernel, the torch and transformers versions, task, prompt
format, few-shot exemplars (and for generation ``max_new_tokens`` and the eos token ids decoding stops at).
Inside a context a *batch* is named by a hash of its requests -- item ids and token ids, so the split, the prompt
and the exemplars are all in it -- and an intervention by its head label (``L3.H1+L12.H0``; ``(none)`` for the
full model). How the work was cut into forwards (stack size,
token budget) is not in the key: a run with the same parameters cuts it the same way, and the evaluators
store whole forwards ("chunks") at a time, so a resumed run recomputes exactly the forwards that are missing.

Layout::

    <root>/<context>/context.json            what the context hash stands for (for people; never read back)
    <root>/<context>/<batch>/<chunk>.rec     the interventions of one finished forward on one batch

One file per (batch, chunk), not per intervention: a stacked forward costs tens of milliseconds, one small
file write a fraction of one.

Atomicity and corruption. A record is written to a temporary file and renamed over its name
(``os.replace``), so a run killed at any moment leaves the whole record or none. There is no fsync: a killed
process needs none, and a file damaged by a power loss is caught like any other damage: a record starts
with the sha256 of its payload, and one that fails the check, does not parse or does not fit its batch is
deleted with a warning and recomputed, never trusted.
"""
from __future__ import annotations

import hashlib
import json
import os
import tempfile
import warnings
from pathlib import Path
from typing import Iterable, Sequence

import numpy as np

from cel_utils.paths import atomic_write, cache_dir
from cel_utils.tasks.scoring import ContinuationStats

STORE_VERSION = 1
MAGIC = b"CEL-EVAL-RECORD 1\n"
_DIGEST_HEX = 64  # sha256
_VALUE_BYTES = 8 + 8 + 1  # per continuation: log-likelihood and margin (float64), greedy (uint8)


def default_root() -> Path:
    """The store in the user's cache: ``$CEL_CACHE_DIR/evals``, else ``~/.cache/cel-book/evals``."""
    return cache_dir() / "evals"


def digest(value) -> str:
    """A short stable hash of JSON-able data."""
    return hashlib.sha256(json.dumps(value, sort_keys=True, separators=(",", ":")).encode()).hexdigest()[:24]


class EvalStore:
    """A directory of stored evaluations; :meth:`context` gives the part one evaluator reads and writes."""

    def __init__(self, root: str | os.PathLike | None = None):
        chosen = root not in (None, "")
        self.root = Path(root).expanduser() if chosen else default_root()
        try:
            self.root.mkdir(parents=True, exist_ok=True)
            with tempfile.NamedTemporaryFile(dir=self.root, prefix=".write-test."):
                pass
        except OSError as error:
            fix = "pass a writable directory" if chosen else "set $CEL_CACHE_DIR to a writable directory"
            raise PermissionError(f"the evaluation store {str(self.root)!r} is not writable ({error.strerror}): {fix}, "
                                  "or turn the store off (RunConfig(cache=False))") from None
        self.read = 0  # (intervention, batch) evaluations served from the store, over every context
        self.computed = 0  # (intervention, batch) evaluations computed and written

    def context(self, fields: dict) -> "StoreContext":
        return StoreContext(self, fields)

    def counts(self) -> dict:
        return {"root": str(self.root), "read": self.read, "computed": self.computed}


class StoreContext:
    """Records of one evaluator context (see the module docstring for what goes into it)."""

    def __init__(self, store: EvalStore, fields: dict):
        self.store, self.fields = store, {"store_version": STORE_VERSION, **fields}
        self.dir = store.root / digest(self.fields)
        self.dir.mkdir(parents=True, exist_ok=True)
        description = self.dir / "context.json"
        if not description.exists():
            atomic_write(description, json.dumps(self.fields, indent=1, sort_keys=True) + "\n")

    def served(self, n: int) -> None:
        """Count ``n`` evaluations an evaluator took from the store instead of computing them."""
        self.store.read += n

    # Log-likelihood tasks: per intervention, the ContinuationStats of every request of the batch.

    def load_stats(self, batch: str, counts: Sequence[int]) -> dict[str, list[ContinuationStats]]:
        """Stored interventions of a batch; ``counts`` is the number of continuations of each request."""
        out = {}
        bounds = np.cumsum([0, *counts])
        for path, header, blob in self._records(batch):
            labels, total = header.get("labels"), int(bounds[-1])
            if header.get("kind") != "stats" or header.get("counts") != list(counts) or len(blob) != len(labels) * total * _VALUE_BYTES:
                self._discard(path, "it does not fit this batch")
                continue
            m = len(labels)
            ll = np.frombuffer(blob, dtype="<f8", count=m * total).reshape(m, total)
            margin = np.frombuffer(blob, dtype="<f8", count=m * total, offset=8 * m * total).reshape(m, total)
            greedy = np.frombuffer(blob, dtype=np.uint8, offset=16 * m * total).reshape(m, total).astype(bool)
            for j, label in enumerate(labels):
                out.setdefault(label, [ContinuationStats(ll=ll[j, a:b].copy(), greedy=greedy[j, a:b],
                                                         greedy_margin=margin[j, a:b].copy())
                                       for a, b in zip(bounds[:-1], bounds[1:])])
        return out

    def save_stats(self, batch: str, counts: Sequence[int], records: dict[str, list[ContinuationStats]]) -> None:
        if not records:
            return
        labels = sorted(records)
        ll = [np.concatenate([s.ll for s in records[label]]) for label in labels]
        margin = [np.concatenate([s.greedy_margin for s in records[label]]) for label in labels]
        greedy = [np.concatenate([s.greedy for s in records[label]]) for label in labels]
        blob = (np.asarray(ll, dtype="<f8").tobytes() + np.asarray(margin, dtype="<f8").tobytes()
                + np.asarray(greedy, dtype=np.uint8).tobytes())
        self._write(batch, {"kind": "stats", "labels": labels, "counts": list(counts)}, blob)

    # Generation tasks: per intervention, the completion of every request.

    def load_completions(self, batch: str, n: int) -> dict[str, list[str]]:
        out = {}
        for path, header, _ in self._records(batch):
            completions = header.get("completions")
            if (header.get("kind") != "completions" or not isinstance(completions, list)
                    or len(completions) != len(header["labels"])
                    or any(len(c) != n or not all(isinstance(s, str) for s in c) for c in completions)):
                self._discard(path, "it does not fit this item set")
                continue
            for label, texts in zip(header["labels"], completions):
                out.setdefault(label, list(texts))
        return out

    def save_completions(self, batch: str, records: dict[str, list[str]]) -> None:
        if not records:
            return
        labels = sorted(records)
        self._write(batch, {"kind": "completions", "labels": labels, "completions": [records[label] for label in labels]}, b"")

    # Files -----------------------------------------------------------------------------------------------

    def _write(self, batch: str, header: dict, blob: bytes) -> None:
        folder = self.dir / batch
        folder.mkdir(exist_ok=True)
        payload = json.dumps(header, separators=(",", ":")).encode() + b"\n" + blob
        record = MAGIC + hashlib.sha256(payload).hexdigest().encode() + b"\n" + payload
        atomic_write(folder / f"{digest(header['labels'])}.rec", record)
        self.store.computed += len(header["labels"])

    def _records(self, batch: str) -> Iterable[tuple[Path, dict, bytes]]:
        """Every intact record of a batch, in file-name order (the first record of a label wins)."""
        folder = self.dir / batch
        if not folder.is_dir():
            return
        for path in sorted(folder.glob("*.rec")):
            try:
                data = path.read_bytes()
            except FileNotFoundError:  # replaced or discarded by a concurrent run meanwhile
                continue
            head = len(MAGIC) + _DIGEST_HEX + 1
            payload = data[head:]
            if (not data.startswith(MAGIC) or data[head - 1:head] != b"\n"
                    or hashlib.sha256(payload).hexdigest().encode() != data[len(MAGIC):head - 1]):
                self._discard(path, "its checksum does not match (a truncated or damaged file)")
                continue
            header_end = payload.find(b"\n")
            try:
                header = json.loads(payload[:header_end])
            except ValueError:
                header = None
            if not isinstance(header, dict) or not isinstance(header.get("labels"), list):
                self._discard(path, "its header does not parse")
                continue
            yield path, header, payload[header_end + 1:]

    def _discard(self, path: Path, why: str) -> None:
        warnings.warn(f"evaluation store: ignoring and deleting {path} because {why}; it will be recomputed",
                      RuntimeWarning, stacklevel=3)
        path.unlink(missing_ok=True)


def request_digest(request) -> bytes:
    """What a request's stored numbers depend on: its item id and token ids (prompt, exemplars, answers)."""
    parts = [request.item_id, list(request.context)]
    if hasattr(request, "continuations"):
        parts.append([list(c) for c in request.continuations])
    else:  # a generation request: where it stops also changes the completion
        parts += [request.stop, request.prefix]
    return hashlib.sha256(json.dumps(parts, separators=(",", ":")).encode()).digest()


def batch_key(digests: Iterable[bytes]) -> str:
    """The name of a batch: a hash of its requests' digests, in batch order."""
    return hashlib.sha256(b"".join(digests)).hexdigest()[:24]
