"""Grid cells as submitit jobs, on this machine (``submitit-local``) or on a Slurm cluster (``slurm``).

Each cell runs as a :class:`CellJob`. Slurm ends a job in three ways before it finishes, and none of them reaches
``book/runs/`` (the notebook executes into ``results/.running/`` and moves only when it ran through):

* preemption or the time limit, announced by submitit's warning signal (USR2): submitit calls
  :meth:`CellJob.checkpoint` and requeues the job; its next start runs the cell again, reading every finished
  evaluation back from the store (:mod:`cel_utils.evaluation.store`), so it ends with the same artifact;
* ``scancel``, or a preemption that only sends SIGTERM: the notebook's kernel dies with the job, and the job exits
  without a result rather than report that death as the run's failure; Slurm's accounting (``sacct``) tells the
  submitting process how it ended (CANCELLED, PREEMPTED, ...), which it reports; running the grid again resumes;
* a cell that fails by itself: its result says why, as for the other executors.
"""
from __future__ import annotations

import os
import signal
import socket
import sys
import threading
import time
from pathlib import Path
from typing import Callable

import submitit

from cel_utils.grid.cells import Cell, CellResult, _stat, failed_result, result_line, run_cell, up_to_date
from cel_utils.grid.slurm import ARRAY_JOB_NAME, SlurmOptions, job_name, submitit_parameters


class CellJob(submitit.helpers.Checkpointable):
    """One cell as a submitit job; requeued by submitit after preemption or a time-out (see the module docstring)."""

    def __init__(self, cell: Cell, skip_existing: bool = False) -> None:
        self.cell = cell
        self.skip_existing = skip_existing

    def __call__(self) -> CellResult:
        terminated = _watch_sigterm()
        try:
            job = submitit.JobEnvironment().job_id
        except RuntimeError:  # called outside a submitit job
            job = "none"
        print(f"cel: cell {self.cell.name} on {socket.gethostname()} (job {job}); the notebook's output follows",
              flush=True)
        result = run_cell(self.cell, self.skip_existing, stream=True)  # the notebook's output, into the job's log
        if terminated.is_set() and result.status == "failed":
            # Slurm is ending the job (scancel, preemption): the kernel died with it, which is not the run's failure.
            print(f"cel: cell {self.cell.name} stopped by SIGTERM (cancelled or preempted); no result: Slurm's "
                  "accounting says how the job ended, and running the cell again resumes from the evaluation store",
                  flush=True)
            sys.stderr.flush()
            os._exit(143)  # no result file: the submitting process asks Slurm why the job ended
        print(result_line(result), flush=True)
        return result

    def checkpoint(self) -> submitit.helpers.DelayedSubmission:
        print(f"cel: cell {self.cell.name} interrupted (preemption or time limit): requeued; its next start reads "
              "the finished evaluations back from the store", flush=True)
        return submitit.helpers.DelayedSubmission(self)


def _watch_sigterm() -> threading.Event:
    """An event set when this process gets SIGTERM; the handler before (submitit's, which logs it) still runs."""
    event = threading.Event()
    previous = signal.getsignal(signal.SIGTERM)

    def handler(signum, frame):
        event.set()
        if callable(previous):
            previous(signum, frame)

    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, handler)
    return event


def run_submitit(cells: list[Cell], executor: str, skip_existing: bool, options: SlurmOptions, log_dir,
                 poll_s: float, done: Callable[[CellResult], None], say: Callable[[str], None]) -> None:
    """Submit one job per cell (or one job array), report each cell through ``done`` as its job ends."""
    todo = []
    for cell in cells:
        if skip_existing and up_to_date(cell) is not None:
            done(run_cell(cell, skip_existing=True))  # up to date: reported at once, no job queued for it
        else:
            todo.append(cell)
    if not todo:
        return
    cluster = "local" if executor == "submitit-local" else "slurm"
    folder = Path(log_dir or Path(todo[0].results_dir) / "submitit")
    executor_ = submitit.AutoExecutor(folder=folder / "%j", cluster=cluster)
    executor_.update_parameters(**submitit_parameters(options, cluster))
    before = {cell.name: _stat(cell.artifact) for cell in todo}
    started = time.perf_counter()
    jobs = _submit(executor_, todo, skip_existing, bool(cluster == "slurm" and options.array_parallelism), done, before)
    for job, cell in jobs.values():
        say(f"submitted {cell.name}: {cluster} job {job.job_id}, log {job.paths.stdout}")
    try:
        for job in submitit.helpers.as_completed([job for job, _ in jobs.values()], poll_frequency=poll_s):
            cell = jobs[job.job_id][1]
            try:
                done(job.result())
            except Exception as error:  # noqa: BLE001 - the job ended without the cell's result
                done(failed_result(cell, _ended_early(job, error), before[cell.name], time.perf_counter() - started))
    except KeyboardInterrupt:
        if cluster == "slurm":  # Slurm jobs outlive this process
            say(f"stopped waiting; the jobs go on (`scancel {' '.join(sorted(jobs))}` cancels them); once they have "
                "ended, the same command with --skip-existing submits only the cells that did not finish")
        raise


def _submit(executor, cells: list[Cell], skip_existing: bool, array: bool, done: Callable, before: dict) -> dict:
    """{job id: (job, cell)} for the submitted jobs; a refused submission (sbatch's error) fails its cells at once."""
    jobs = {}
    try:
        if array and len(cells) > 1:
            executor.update_parameters(name=ARRAY_JOB_NAME)
            with executor.batch():
                submitted = [executor.submit(CellJob(cell, skip_existing)) for cell in cells]
            jobs.update((job.job_id, (job, cell)) for job, cell in zip(submitted, cells))
            return jobs
        for cell in cells:
            executor.update_parameters(name=job_name(cell.name))
            job = executor.submit(CellJob(cell, skip_existing))
            jobs[job.job_id] = (job, cell)
    except Exception as error:  # noqa: BLE001 - sbatch refused (bad account, partition, ...)
        refused = RuntimeError(f"submission refused: {_informative_line(error)}")
        submitted_names = {cell.name for _, cell in jobs.values()}
        for cell in cells:
            if cell.name not in submitted_names:
                done(failed_result(cell, refused, before[cell.name]))
    return jobs


def _ended_early(job, error: Exception) -> RuntimeError:
    if isinstance(error, submitit.core.utils.UncompletedJobError):
        what = f"ended with state {job.state} before the cell finished"
    else:  # the job's Python failed before or after run_cell (which never raises): environment, unpickling
        what = f"failed outside the cell's run: {_informative_line(error)}"
    return RuntimeError(f"job {job.job_id} {what}; its log: {job.paths.stdout}; running the cell again resumes "
                        "from the evaluation store")


def _informative_line(error: BaseException) -> str:
    """sbatch's own error line where there is one, else the last line (a traceback's exception)."""
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    return next((line for line in lines if "sbatch: error" in line), lines[-1] if lines else type(error).__name__)
