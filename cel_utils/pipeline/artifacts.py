"""The JSON artifact of one CEL run (model, task, seed), written atomically.

One file holds everything later stages need: the configuration, data provenance, every stage-1 and
stage-2 score, the frozen set, the per-example correctness of the full and ablated models on the holdout
and library versions. It holds nothing that changes from one run of the same parameters to the next, so
a rerun (or a run resumed after a crash) writes the same bytes; the creation time, timings and store use
go to a small *run info* file beside it (:func:`run_info_path`). Files are written to a temporary name and
renamed, so a reader (or a crash) never sees half a file.

Reading (:func:`read_artifact`, :func:`from_json`) gives any version's file in today's form, checked against the
schema's types (:mod:`cel_utils.pipeline.schema`): older files are upgraded in one place, :func:`migrate_v1`.
"""
from __future__ import annotations

import json
import platform
import re
import types
import typing
from datetime import datetime, timezone
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Any, Mapping, NotRequired

from cel_utils.paths import atomic_write
from cel_utils.pipeline.schema import (RUN, SCHEMA_VERSION, STRATEGIES, TRANSFER, RunArtifact, StrategiesArtifact,
                                       TransferArtifact)
from cel_utils.pipeline.stats_schema import Reliability

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
    """An artifact file in today's form, through :func:`from_json` (checked, older versions migrated); a broken file is
    an error that names it."""
    path = Path(path)
    try:
        payload = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as error:
        raise ValueError(f"{path} is not a valid CEL artifact (broken JSON: {error})") from None
    return from_json(payload, str(path))


def load_artifacts(results_dir: Path) -> list[RunArtifact]:
    """Every artifact in a folder (sorted by file name), skipping nothing silently: a bad file raises."""
    return [read_artifact(path) for path in sorted(Path(results_dir).glob("*.json"))]


def bits(values) -> list[int]:
    """A boolean (or integer) vector as JSON's list of ints: how artifacts store per-item outcomes."""
    return [int(v) for v in values]


def utc_now() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="seconds")


# --- reading: any version, in today's form, checked against the schema ---------------------------------------

SCHEMAS: dict[str, type] = {RUN: RunArtifact, TRANSFER: TransferArtifact, STRATEGIES: StrategiesArtifact}


def migrate_v1(payload: dict) -> dict:
    """A version-1 artifact in today's form: the one place that knows what older files lack. Sections added while the
    version stayed 1 become None (absent); settings added since take the value their absence meant."""
    payload = dict(payload, schema_version=SCHEMA_VERSION)
    if payload.get("kind") == STRATEGIES:  # the screens' agreement and attribution came later
        payload.setdefault("screening", None)
        payload.setdefault("attribution_skipped", None)
    if payload.get("kind", RUN) != RUN:
        return payload  # a transfer matrix: the same fields in both versions
    payload.setdefault("kind", RUN)
    for section in ("precision", "prompt", "discovery_flips", "floors", "control", "reliability", "sandbox"):
        payload.setdefault(section, None)
    payload.setdefault("stage1_method", {"method": "exact"})
    config = payload["config"] = dict(payload["config"])
    config.setdefault("ablation", "zero")  # before mean-ablation every run zero-ablated
    data = payload["data"] = dict(payload["data"])
    data.setdefault("n_discovery", config.get("n_discovery"))
    holdout = payload["holdout"] = dict(payload["holdout"])
    for key in ("item_ids", "full_correct", "ablated_correct", "full_metric_vectors", "ablated_metric_vectors",
                "full_predictions", "ablated_predictions"):
        holdout.setdefault(key, None)
    holdout.setdefault("examples", [])
    if payload["reliability"] is not None:
        reliability = payload["reliability"] = dict(payload["reliability"])
        for part in Reliability.__required_keys__:
            reliability.setdefault(part, None)
    return payload


MIGRATIONS = {1: migrate_v1}


def from_json(payload: dict, source: str = "artifact") -> Any:
    """A parsed artifact in today's form, checked against its schema; ``source`` names it in errors."""
    version = payload.get("schema_version") if isinstance(payload, dict) else None
    if version in MIGRATIONS:
        payload = MIGRATIONS[version](payload)
    elif version != SCHEMA_VERSION:
        raise ValueError(f"{source}: schema_version {version!r}, this cel_utils reads {SCHEMA_VERSION} (and "
                         f"{', '.join(map(str, MIGRATIONS))}); write it again with this version's `cel` command")
    schema = SCHEMAS.get(payload.get("kind", RUN))
    if schema is not None:
        missing = missing_keys(payload, schema)
        if missing:
            raise ValueError(f"{source} is not a complete {payload.get('kind')} artifact: it lacks "
                             f"{', '.join(missing[:5])}{' ...' if len(missing) > 5 else ''}")
    return payload


def missing_keys(value: Any, schema: Any, where: str = "") -> list[str]:
    """The required keys of ``schema`` (a TypedDict, nested ones included) that ``value`` lacks, as dotted paths."""
    schema = _strip_none(schema)
    if typing.is_typeddict(schema) and isinstance(value, dict):
        hints = typing.get_type_hints(schema)
        missing = [f"{where}{key}" for key in schema.__required_keys__ if key not in value]
        for key, hint in hints.items():
            if key in value and value[key] is not None:
                missing += missing_keys(value[key], hint, f"{where}{key}.")
        return missing
    if typing.get_origin(schema) is list and isinstance(value, list) and value:
        (item,) = typing.get_args(schema)
        if typing.is_typeddict(_strip_none(item)):
            return missing_keys(value[0], item, where.rstrip(".") + "[0].")  # rows are written alike: the first tells
    return []


def _strip_none(hint: Any) -> Any:
    """``X | None`` -> ``X`` (and ``NotRequired[X]`` -> ``X``); other hints as they are."""
    if typing.get_origin(hint) is NotRequired:
        hint = typing.get_args(hint)[0]
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    if typing.get_origin(hint) in (typing.Union, types.UnionType) and len(args) == 1:
        return args[0]
    return hint
