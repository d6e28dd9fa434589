"""The sandbox's results on disk, one JSON file per key, and SANDBOX_VERSION, the part of the key that names the
sandbox's own code (what a key holds, and what is never cached: see the package docstring, cel_utils.sandbox)."""
from __future__ import annotations

import hashlib
import json
import os
import sys
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import asdict, fields
from pathlib import Path
from typing import Any

from cel_utils.paths import atomic_write, cache_dir
from cel_utils.sandbox.result import STATUSES, ExecResult


def source_version(folder: str | os.PathLike[str] = Path(__file__).parent) -> str:
    """A hash of the sandbox's code: every module in `folder` (this package: how programs are run, isolated, judged
    and cached). Part of the cache key, so any change to any of them recomputes every result."""
    digest = hashlib.sha256()
    for path in sorted(Path(folder).glob("*.py")):
        data = path.read_bytes()  # name and length first, so no two sets of files hash alike
        digest.update(f"{path.name}\0{len(data)}\0".encode() + data)
    return digest.hexdigest()[:16]


SANDBOX_VERSION = source_version()  # derived, never hand-kept: no change can be forgotten
_PYTHON = [sys.implementation.name, *sys.version_info]  # what ran the results (the child is sys.executable too)


class ExecCache:
    """Results on disk, one JSON file per key. Entries are written atomically and carry a checksum, so a
    truncated or corrupted entry reads as a miss and is recomputed."""

    def __init__(self, root: str | os.PathLike[str] | None = None) -> None:
        self.root = Path(root) if root is not None else cache_dir() / "exec"

    @staticmethod
    def key(program: str, tests: Sequence[str], setup: str, timeout_s: float, memory_mb: int,
            protections: Sequence[str]) -> str:
        """The entry's name; `protections`: the layers a sandbox gets here (cel_utils.sandbox.isolation_report)."""
        blob = json.dumps([SANDBOX_VERSION, _PYTHON, sorted(protections), program, list(tests), setup,
                           float(timeout_s), int(memory_mb)])
        return hashlib.sha256(blob.encode()).hexdigest()

    def _path(self, key: str) -> Path:
        return self.root / key[:2] / f"{key}.json"

    def get(self, key: str) -> ExecResult | None:
        try:
            entry = json.loads(self._path(key).read_text())
            result = entry["result"]
            if entry["key"] != key or entry["sha256"] != _digest(result):
                return None
            result["protections"] = tuple(result["protections"])
            out = ExecResult(**result)
        except (OSError, ValueError, KeyError, TypeError):
            return None
        types_ok = all(isinstance(getattr(out, f.name), t) for f, t in zip(fields(ExecResult), _FIELD_TYPES))
        consistent = out.status in STATUSES and out.passed == (out.status == "passed")
        return out if types_ok and consistent else None

    def put(self, key: str, result: ExecResult) -> None:
        path = self._path(key)
        record = asdict(result)
        try:  # readers see the old entry or the new one, never half of one
            atomic_write(path, json.dumps({"key": key, "sha256": _digest(record), "result": record}))
        except OSError as exc:
            warnings.warn(f"sandbox cache: could not write {path}: {exc}", stacklevel=2)


_FIELD_TYPES = (str, bool, (int, type(None)), (float, int), str, str, tuple, (float, int, type(None)))


def _digest(record: Mapping[str, Any]) -> str:
    canonical = json.dumps({**record, "protections": list(record["protections"])}, sort_keys=True)
    return hashlib.sha256(canonical.encode()).hexdigest()
