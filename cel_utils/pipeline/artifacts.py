"""The JSON artifact of one CEL run (model, task, seed), written atomically.

One file holds everything later stages need: the configuration, data provenance, every stage-1 and
stage-2 score, the frozen set, the per-example correctness of the full and ablated models on the holdout
and library versions. It holds nothing that changes from one run of the same parameters to the next, so
a rerun (or a run resumed after a crash) writes the same bytes; the creation time, timings and store use
go to a small *run info* file beside it (:func:`run_info_path`). Files are written to a temporary name and
renamed, so a reader (or a crash) never sees half a file.
"""
from __future__ import annotations

import json
import platform
import re
from datetime import datetime, timezone
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Any, Mapping

from cel_utils.paths import atomic_write
from cel_utils.pipeline import schema
from cel_utils.pipeline.schema import SCHEMA_VERSION, RunArtifact

__all__ = ["SCHEMA_VERSION", "RunArtifact", "read_artifact", "load_artifacts", "write_json", "artifact_name",
           "run_info_path", "read_run_info", "library_versions", "bits", "utc_now", "slug"]


def library_versions() -> dict[str, str]:
    versions = {"python": platform.python_version()}
    for package in ("cel-book", "torch", "transformers", "datasets", "numpy", "scipy"):
        try:
            versions[package] = version(package)
        except PackageNotFoundError:
            versions[package] = "not installed"
    return versions


def slug(text: str) -> str:
    """A file-name-safe form of a model or task name."""
    return re.sub(r"[^A-Za-z0-9._-]+", "-", text).strip("-")


def artifact_name(model_name: str, task: str, seed: int) -> str:
    return f"{slug(model_name)}__{slug(task)}__seed{seed}.json"


def run_info_path(artifact: Path) -> Path:
    """``results/run-info/<artifact name>``: the volatile facts of a run, kept out of the artifact. A sub-folder,
    so that the ``*.json`` files of a results folder are artifacts only."""
    artifact = Path(artifact)
    return artifact.parent / "run-info" / artifact.name


def read_run_info(artifact: Path) -> dict:
    """The run info written beside an artifact, or {} when there is none (e.g. an artifact copied alone)."""
    try:
        return json.loads(run_info_path(artifact).read_text(encoding="utf-8"))
    except (FileNotFoundError, json.JSONDecodeError):
        return {}


def write_json(path: Path, payload: Mapping[str, Any]) -> Path:
    atomic_write(path, json.dumps(payload, indent=1, sort_keys=False, default=_jsonable) + "\n", durable=True)
    return Path(path)


def _jsonable(value: Any):
    if hasattr(value, "tolist"):
        return value.tolist()
    if isinstance(value, Path):
        return str(value)
    raise TypeError(f"cannot store {type(value).__name__} in a JSON artifact")


def read_artifact(path: Path) -> Any:
    """An artifact file in today's form (:func:`cel_utils.pipeline.schema.read`: checked, older versions migrated)."""
    return schema.read(path)


def load_artifacts(results_dir: Path) -> list[RunArtifact]:
    """Every artifact in a folder (sorted by file name), skipping nothing silently: a bad file raises."""
    return [read_artifact(path) for path in sorted(Path(results_dir).glob("*.json"))]


def bits(values) -> list[int]:
    """A boolean (or integer) vector as JSON's list of ints: how artifacts store per-item outcomes."""
    return [int(v) for v in values]


def utc_now() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="seconds")
