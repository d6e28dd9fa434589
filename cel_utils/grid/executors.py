"""Run every cell of a grid: in this process, in worker processes, or as submitit jobs (locally or on Slurm).

``local`` runs cells one after the other, or ``jobs`` at a time in worker processes (each papermill run starts its own
kernel; the longest expected runs start first, :func:`start_order`); ``submitit-local`` and ``slurm`` submit one
submitit job per cell (like the paper: one job per model-task), or one Slurm job array, the first on this machine, the
second to a Slurm cluster (:mod:`cel_utils.grid.jobs`, options in :mod:`cel_utils.grid.slurm`). A failure is recorded
in its cell's result and the others go on; results come back in grid order.
"""
from __future__ import annotations

import os
from typing import Callable

from cel_utils.checks import check_int
from cel_utils.presets import expected_minutes
from cel_utils.grid.cells import Cell, CellResult, _stat, failed_result, result_line, run_cell
from cel_utils.grid.slurm import SlurmOptions

EXECUTORS = ("local", "submitit-local", "slurm")


def run_grid(cells: list[Cell], executor: str = "local", *, jobs: int = 1, skip_existing: bool = False,
             slurm: SlurmOptions | None = None, log_dir: str | os.PathLike | None = None, progress: bool = True,
             poll_s: float = 2.0, on_result: Callable[[CellResult], None] | None = None) -> list[CellResult]:
    """Run every cell; a failure is recorded in its result and the others go on. Results are in grid order."""
    from tqdm.auto import tqdm

    if executor not in EXECUTORS:
        raise ValueError(f"unknown executor {executor!r}: choose from {EXECUTORS}")
    check_int("jobs", jobs)
    options = (slurm or SlurmOptions()).validate()
    results: dict[str, CellResult] = {}
    bar = tqdm(total=len(cells), desc="CEL grid", unit="run", disable=not progress)

    def done(result: CellResult) -> None:
        results[result.name] = result
        bar.update(1)
        bar.set_postfix_str(f"{result.name}: {result.status}")
        if progress:
            bar.write(result_line(result))
        if on_result is not None:
            on_result(result)

    try:
        if executor == "local" and jobs == 1:
            for cell in cells:
                done(run_cell(cell, skip_existing, stream=progress))
        elif executor == "local":
            _run_pool(cells, jobs, skip_existing, progress, done)
        else:
            from cel_utils.grid.jobs import run_submitit

            run_submitit(cells, executor, skip_existing, options, log_dir, poll_s, done,
                         bar.write if progress else lambda text: None)
    finally:
        bar.close()
    return [results[cell.name] for cell in cells if cell.name in results]


def visible_gpus() -> list[str]:
    """The GPUs this process may use, as CUDA_VISIBLE_DEVICES names them (none on a machine without CUDA)."""
    import torch

    if not torch.cuda.is_available():
        return []
    named = [g for g in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if g.strip()]
    return named[:torch.cuda.device_count()] if named else [str(i) for i in range(torch.cuda.device_count())]


def claim_gpu(queue) -> None:
    """Worker initializer: take one GPU from ``queue`` and see only it (the cell's kernel inherits the variable)."""
    os.environ["CUDA_VISIBLE_DEVICES"] = queue.get()


def start_order(cells: list[Cell]) -> list[Cell]:
    """The order in which worker processes take cells: the longest expected run first, cells never measured after
    them, each group in grid order.

    Longest-processing-time-first scheduling: workers take the next cell as they free up, so a long run started last
    would run alone at the end while the other workers idle. In grid order `make book` ran arithmetic (its shortest
    run) beside BoolQ (its longest) and MBPP alone at the end.
    """
    return sorted(cells, key=lambda cell: -(expected_minutes(cell.parameters["preset"], cell.parameters["task"],
                                                             cell.parameters["model"]) or 0))


def prepare_models(cells: list[Cell]) -> None:
    """Dequantize each GGUF model of the grid once, before its workers start: workers that load it at the same moment
    would each dequantize it (the default model: 28 s alone, about a minute each for two at once on 2 cores)."""
    from cel_utils.models.loading import locate

    for spec in sorted({cell.parameters["model"] for cell in cells}):
        try:
            locate(spec)  # a GGUF file: its cached checkpoint; any other spec: nothing is read
        except (OSError, ValueError):
            pass  # a bad spec fails in its own cell, with its own message


def _run_pool(cells: list[Cell], jobs: int, skip_existing: bool, stream: bool, done: Callable) -> None:
    """``jobs`` worker processes; with GPUs, each worker gets its own (round robin when there are more workers)."""
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor, as_completed

    prepare_models(cells)
    context, gpus, setup = multiprocessing.get_context("spawn"), visible_gpus(), {}
    if gpus:
        queue = context.Queue()
        for worker in range(jobs):
            queue.put(gpus[worker % len(gpus)])
        setup = {"initializer": claim_gpu, "initargs": (queue,)}
    with ProcessPoolExecutor(max_workers=jobs, mp_context=context, **setup) as pool:
        futures = {pool.submit(run_cell, cell, skip_existing, stream): (cell, _stat(cell.artifact))
                   for cell in start_order(cells)}
        for future in as_completed(futures):
            try:
                done(future.result())
            except Exception as error:  # noqa: BLE001 - the worker process died
                cell, before = futures[future]
                done(failed_result(cell, error, before))
