"""The transfer matrix of one model: every frozen set of its runs scored on the holdout items of its other tasks.

A run freezes a head set on task A and scores it on A's holdout. That says nothing about what the deletion costs
elsewhere: a set that "enhances" A by breaking B is no capability gain (the toy model's Theorem 4.3 is exactly such a
trade, see book/theory.md). Here, for one (model, seed), each run's frozen set is evaluated with the ablation on the
holdout items of every other task the model ran, by the evaluator, store and settings of *that* task's run (its
artifact's configuration), and compared, item by item, with the full model's outcomes already stored in that
artifact. Row = the task the set was found on, column = the task it is tested on; the diagonal is each run's own
holdout result. Each cell carries the paired test, its power and verdict (:mod:`cel_utils.stats`), as a run does.

An off-diagonal cell may use a seeded random subset of the target's holdout (``transfer_items``,
:class:`cel_utils.config.TransferConfig`, set per task family by the presets); its power is then that of the subset.

The matrix is one JSON file, ``<results_dir>/transfer/<model>__seed<N>.json``, written atomically at the end: a step
that fails leaves no file (and any earlier one as it was). Every finished evaluation is in the store, so a step that
was stopped resumes; a step whose inputs (the runs' artifacts, the transfer sizes) are unchanged is skipped.
"""
from __future__ import annotations

import hashlib
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Literal, Mapping

import numpy as np

from cel_utils.config import TransferConfig, field_names
from cel_utils.presets import task_sort_key
from cel_utils.models.heads import parse_head
from cel_utils.pipeline.artifacts import (SCHEMA_VERSION, artifact_name, bits, library_versions, read_artifact,
                                          run_info_path, slug, utc_now, write_json)
from cel_utils.pipeline.schema import RunArtifact, TransferArtifact
from cel_utils.stats.power import discordant, power_json, verdict
from cel_utils.stats.significance import CI_STREAM, paired_test

KIND = "cel-transfer"
SUBDIR = TransferConfig.ARTIFACT_SUBDIR
_TRANSFER_ITEMS_STREAM = 211  # the subset of a target's holdout is drawn from np.random.default_rng([seed, 211])
# What a target's configuration may differ in from its run's: where things are and how fast they go, never its numbers.
_MACHINE_SETTINGS = ("results_dir", "data_dir", "batch_size", "token_budget", "device_map", "cache")
_GIVABLE = ("transfer_items", *_MACHINE_SETTINGS)  # what a target's configuration may be given
TRANSFER_SETTINGS = tuple(name for name in _GIVABLE if name != "results_dir")  # what `cel transfer` takes as flags


def transfer_path(results_dir: str | Path, model_name: str, seed: int) -> Path:
    """``<results_dir>/transfer/<model>__seed<N>.json``."""
    return Path(results_dir) / SUBDIR / f"{slug(model_name)}__seed{seed}.json"


def transfer_item_indices(n_holdout: int, n_items: int | None, seed: int) -> np.ndarray:
    """Which holdout items of a target the other tasks' sets are scored on (sorted): all of them, or a seeded random
    subset of ``n_items`` (a random sample, not the first items: a validation split in dataset order is not one)."""
    if n_items is None or n_items >= n_holdout:
        return np.arange(n_holdout)
    return np.sort(np.random.default_rng([seed, _TRANSFER_ITEMS_STREAM]).choice(n_holdout, n_items, replace=False))


def find_runs(results_dir: str | Path, model_name: str, seed: int, tasks: Iterable[str] | None = None) -> dict[str, Path]:
    """{task: artifact path} of the model's runs with this seed; every task in ``tasks`` must have one (a clear error
    names the missing artifact and the command that makes it). Without ``tasks``: every such artifact found."""
    results_dir = Path(results_dir)
    if tasks is None:
        prefix, suffix = f"{slug(model_name)}__", f"__seed{seed}.json"
        found = {}
        for path in sorted(results_dir.glob(f"{prefix}*{suffix}")):
            found[read_artifact(path)["task"]["name"]] = path
        return found
    found = {task: results_dir / artifact_name(model_name, task, seed) for task in tasks}
    missing = [path.name for path in found.values() if not path.is_file()]
    if missing:
        raise FileNotFoundError(f"the transfer matrix of {model_name} (seed {seed}) needs the run artifact(s) "
                                f"{', '.join(missing)} in {results_dir}, which do not exist: run those cells first "
                                f"(`cel grid --models <model> --tasks <tasks> --seeds {seed}`), or leave their tasks out")
    return found


def target_config(artifact: RunArtifact, given: Mapping | None = None) -> TransferConfig:
    """The configuration the transfer evaluates a target task with: its run's, as the artifact stores it, plus the
    transfer's own settings (the run's preset row, then ``given``). Only settings that change no number
    (:data:`_MACHINE_SETTINGS`) and ``transfer_items`` may be given; anything else would score the sets with another
    evaluator than the full model's stored outcomes came from."""
    given = dict(given or {})
    stored = {name: value for name, value in artifact["config"].items() if name in field_names(TransferConfig)}
    differing = sorted(name for name, value in given.items()
                       if name not in _GIVABLE and name in stored and stored[name] != value)
    if differing:
        raise ValueError(f"{artifact['task']['name']}: {differing} differ(s) from the run's "
                         f"({', '.join(f'{n}={stored[n]!r}' for n in differing)}): the transfer scores the sets as the "
                         "run scored its full model; rerun the grid with those settings instead")
    allowed = {name: value for name, value in given.items() if name in _GIVABLE}
    return TransferConfig.from_dict({**stored, **allowed})


def _digest(path: Path) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


@dataclass
class TransferResult:
    path: Path
    status: str  # "ok" or "skipped" (up to date)
    seconds: float = 0.0
    n_evaluations: int = 0  # (set, target) pairs scored off the diagonal


def cell_json(source: str, target: str, heads: list[str], label: str, full_correct, ablated_correct, seed: int,
              n_holdout: int, indices: np.ndarray | None = None, calibration: dict | None = None,
              floors: dict | None = None) -> dict:
    """One cell of the matrix: the paired test of the ablated against the full model on the target's items, its
    power and verdict, as for a run (a diagonal cell keeps the run's calibration baseline and floors: the run's own
    verdict). The verdict is that of the cell alone; the page adjusts the off-diagonal cells as one family."""
    full, ablated = np.asarray(full_correct, bool), np.asarray(ablated_correct, bool)
    test = paired_test(full, ablated, seed=[seed, CI_STREAM]).to_json()
    power = power_json(len(full), discordant(full, ablated))
    judged = verdict(test, power, calibration, floors=floors, accuracies=(float(full.mean()), float(ablated.mean())))
    return {"source": source, "target": target, "diagonal": source == target, "heads": heads, "heads_label": label,
            "n_items": int(len(full)), "n_holdout": n_holdout,
            "item_indices": None if indices is None else bits(indices),  # None: the whole holdout
            "full_accuracy": float(full.mean()), "ablated_accuracy": float(ablated.mean()),
            "gain_points": test["gain_points"], "help": test["help"], "harm": test["harm"],
            "significance": test, "power": power, "verdict": judged,
            "full_correct": bits(full), "ablated_correct": bits(ablated)}


def run_transfer(results_dir: str | Path, model: str, seed: int, tasks: Iterable[str] | None = None, *,
                 given: Mapping | None = None, lm=None, progress: bool | str = "log", force: bool = False,
                 say=print) -> TransferResult:
    """Compute (or find up to date) the transfer matrix of ``model`` (a spec or display name) at ``seed`` over ``tasks``
    (default: every task it has an artifact for) from the runs' artifacts in ``results_dir``; write it atomically."""
    from cel_utils.evaluation.store import EvalStore
    from cel_utils.models.loading import display_name
    from cel_utils.pipeline.protocol import holdout_config, load_for, make_evaluator
    from cel_utils.tasks.splits import load_task_data

    start = time.perf_counter()
    name = display_name(model)
    paths = find_runs(results_dir, name, seed, tasks)
    if not paths:
        raise FileNotFoundError(f"no run artifact of {name} with seed {seed} in {results_dir}: run the grid first")
    runs = {task: read_artifact(path) for task, path in paths.items()}

    order = sorted(runs, key=task_sort_key)  # the book's task order: rows and columns read alike
    # checked as a run's are (bad sizes, an unreadable data mirror, an unwritable store: before any model loads)
    configs = {task: target_config(runs[task], {**(given or {}), "results_dir": str(results_dir)}).validate()
               for task in order}
    inputs = {"runs": {task: {"artifact": paths[task].name, "sha256": _digest(paths[task])} for task in order},
              "transfer_items": {task: configs[task].transfer_items for task in order}}
    out = transfer_path(results_dir, name, seed)
    if out.exists() and not force:
        try:
            if read_artifact(out).get("inputs") == inputs:
                return TransferResult(out, "skipped")
        except ValueError:
            pass  # a broken file is recomputed
    fingerprints = {runs[t]["model"]["fingerprint"] for t in order}
    if len(fingerprints) > 1:
        raise ValueError(f"the runs of {name} (seed {seed}) used different weights ({sorted(fingerprints)}): rerun them "
                         "with one model before comparing them")
    cells: dict[tuple[str, str], dict] = {}
    n_evaluations = 0
    store = None
    for target in order:
        art, config = runs[target], configs[target]
        h = art["holdout"]
        if h["full_correct"] is None:
            raise ValueError(f"{paths[target].name} stores no per-item holdout outcomes (an artifact older than the "
                             "paired test): rerun its cell")
        cal = (art["reliability"] or {}).get("calibration")
        cells[target, target] = cell_json(target, target, h["heads"], h["heads_label"], h["full_correct"],
                                          h["ablated_correct"], seed, h["n_items"], calibration=cal,
                                          floors=art["floors"])
        sources = [s for s in order if s != target]
        if not sources:
            continue
        if lm is None:
            lm = load_for(config)
        _check_same_model(lm, art, name)
        data = load_task_data(config.task, config.n_discovery, config.n_holdout, seed=config.seed,
                              num_fewshot=config.num_fewshot, data_dir=config.data_dir)
        if [item.id for item in data.holdout] != h["item_ids"]:
            raise ValueError(f"{target}: the holdout items drawn now are not those of {paths[target].name} (the data "
                             "or its source changed since the run): rerun the grid for this task first")
        indices = transfer_item_indices(len(data.holdout), config.transfer_items, seed)
        if config.cache and store is None:
            store = EvalStore()
        evaluator = make_evaluator(lm, data, [data.holdout[i] for i in indices], holdout_config(config, lm.device),
                                   progress, store)
        sets = [[parse_head(x) for x in runs[s]["holdout"]["heads"]] for s in sources]
        say(f"transfer: {name} on {target}: {len(sources)} other task(s)' frozen sets on {len(indices)} of "
            f"{len(data.holdout)} holdout items")
        outcomes = evaluator.evaluate(sets, desc=f"transfer: {len(sources)} sets from the other tasks")
        n_evaluations += len(sources)
        full = np.asarray(h["full_correct"], bool)[indices]
        whole = len(indices) == len(data.holdout)
        for source, outcome in zip(sources, outcomes):
            s = runs[source]["holdout"]
            cells[source, target] = cell_json(source, target, s["heads"], s["heads_label"], full, outcome.correct, seed,
                                              h["n_items"], None if whole else indices)
    payload = {"schema_version": SCHEMA_VERSION, "kind": KIND, "model": {"name": name, **{
                   k: runs[order[0]]["model"][k] for k in ("spec", "fingerprint", "dtype", "geometry")}},
               "seed": seed, "tasks": order, "inputs": inputs,
               "metrics": {task: runs[task]["task"]["metric"] for task in order},
               "cells": [cells[source, target] for source in order for target in order],
               "versions": library_versions()}
    seconds = time.perf_counter() - start
    write_json(run_info_path(out), {"artifact": out.name, "created": utc_now(), "seconds": seconds,
                                    "evaluations": n_evaluations, "store": store.counts() if store else None})
    write_json(out, payload)
    return TransferResult(out, "ok", seconds, n_evaluations)


def _transfer_one(results_dir: Path, model: str, seed: int, tasks: list[str], given: Mapping | None) -> tuple[str, str]:
    """One (model, seed) step for :func:`run_transfers`, in this process or a worker: ("ok", line) or ("failed", why)."""
    try:
        result = run_transfer(results_dir, model, seed, tasks, given=given)
    except (ValueError, FileNotFoundError) as error:
        return "failed", f"{model} (seed {seed}): {error}"
    what = "up to date" if result.status == "skipped" else f"{result.n_evaluations} set(s) scored, {result.seconds:.0f} s"
    return "ok", f"{model} (seed {seed}) over {', '.join(tasks)}: {what} -> {result.path}"


def run_transfers(results_dir: str | Path, selection: Iterable[tuple[str, int, list[str] | None]],
                  given: Mapping | None = None, jobs: int = 1, say=print) -> int:
    """The transfer step for each (model spec, seed, tasks) of ``selection`` (tasks None: every task the model has an
    artifact of with that seed), ``jobs`` of them at once in worker processes (two models' steps on 2 cores: the
    throughput of two processes, as the grid's cells). 0 when every matrix was written or up to date, else 1 (a step
    that fails does not stop the others). A model with fewer than two tasks has no matrix."""
    from cel_utils.models.loading import display_name

    results_dir, todo = Path(results_dir), []
    for model, seed, tasks in selection:
        if tasks is None:
            tasks = list(find_runs(results_dir, display_name(model), seed))
        if len(tasks) < 2:
            say(f"transfer: {model} (seed {seed}) has {len(tasks)} task(s) with a result: no matrix")
        else:
            todo.append((results_dir, model, seed, list(tasks), dict(given or {})))
    if jobs > 1 and len(todo) > 1:
        import multiprocessing
        from concurrent.futures import ProcessPoolExecutor

        with ProcessPoolExecutor(max_workers=min(jobs, len(todo)), mp_context=multiprocessing.get_context("spawn")) as pool:
            outcomes = list(pool.map(_transfer_one, *zip(*todo)))
    else:
        outcomes = [_transfer_one(*step) for step in todo]
    for status, line in outcomes:
        say(f"transfer: FAILED {line}" if status == "failed" else f"transfer: {line}")
    return int(any(status == "failed" for status, _ in outcomes))


def _check_same_model(lm, artifact: RunArtifact, name: str) -> None:
    stored = artifact["model"]
    dtype = str(lm.dtype).removeprefix("torch.")
    if lm.fingerprint != stored["fingerprint"] or dtype != stored["dtype"]:
        raise ValueError(f"{name}: the model loaded now (fingerprint {lm.fingerprint}, {dtype}) is not the one the "
                         f"{artifact['task']['name']} run used ({stored['fingerprint']}, {stored['dtype']}): rerun the "
                         "grid, or load the model as the run did")


def read_transfer(path: str | Path) -> TransferArtifact:
    """A transfer matrix written by :func:`run_transfer` (a run's artifact or a broken file is an error)."""
    payload = read_artifact(Path(path))
    if payload.get("kind") != KIND:
        raise ValueError(f"{path} is not a transfer matrix (kind {payload.get('kind')!r})")
    return payload


def load_transfers(results_dir: str | Path) -> list[TransferArtifact]:
    """Every transfer matrix under ``<results_dir>/transfer/`` (sorted by file name); a bad file raises."""
    folder = Path(results_dir) / SUBDIR
    return [read_transfer(path) for path in sorted(folder.glob("*.json"))] if folder.is_dir() else []


def matrix(transfer: TransferArtifact,
           field: Literal["gain_points", "full_accuracy", "ablated_accuracy"] = "gain_points") -> np.ndarray:
    """The cells' ``field`` as a tasks x tasks array (row = found on, column = tested on)."""
    tasks = transfer["tasks"]
    out = np.full((len(tasks), len(tasks)), np.nan)
    for cell in transfer["cells"]:
        out[tasks.index(cell["source"]), tasks.index(cell["target"])] = cell[field]
    return out
