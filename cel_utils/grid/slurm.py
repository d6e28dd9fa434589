"""What a Slurm cluster needs to know about a grid's jobs, and how that becomes submitit's parameters.

Every option is optional except the time limit; a zero for GPUs, CPUs or memory leaves that request out (the
cluster's default applies). Without ``array_parallelism`` every cell is its own job, named after the cell
(``cel-<model>-<task>-s<seed>``, as ``squeue`` shows it); with it, the cells go in as one job array, at most that
many running at once (Slurm's ``--array=0-N%cap``), named ``cel-grid``: an array has one name, and each task's log
names its cell. Jobs are submitted with ``--requeue`` and catch submitit's warning signal (USR2, 90 s before the
time limit or at preemption): the job is requeued and its next start resumes from the evaluation store
(:mod:`cel_utils.grid.jobs`).
"""
from __future__ import annotations

import argparse
import shutil
from dataclasses import dataclass, field
from typing import Any

ARRAY_JOB_NAME = "cel-grid"


@dataclass
class SlurmOptions:
    """Resources and placement of each cell's Slurm job (the ``--slurm-*`` flags of ``cel grid``)."""

    partition: str | None = None
    account: str | None = None
    qos: str | None = None
    constraint: str | None = None  # node features, e.g. a GPU type: "a100|h100"
    gpus_per_node: int = 1
    cpus_per_task: int = 8
    mem_gb: int = 64
    timeout_min: int = 12 * 60
    setup: list[str] = field(default_factory=list)  # shell lines run in the job before the cell, e.g. module load
    array_parallelism: int | None = None  # one job array with at most this many cells running; None: one job per cell
    extra: dict[str, Any] = field(default_factory=dict)  # any other sbatch option, e.g. {"reservation": "x"}

    def validate(self) -> "SlurmOptions":
        """Raise ValueError naming the bad option (and its ``cel grid`` flag) before anything is submitted."""
        numbers = [("gpus_per_node", "--slurm-gpus", 0), ("cpus_per_task", "--slurm-cpus", 0),
                   ("mem_gb", "--slurm-mem-gb", 0), ("timeout_min", "--slurm-time-min", 1),
                   ("array_parallelism", "--slurm-array", 1)]
        for name, flag, least in numbers:
            value = getattr(self, name)
            if name == "array_parallelism" and value is None:
                continue
            if isinstance(value, bool) or not isinstance(value, int) or value < least:
                zero = " (0: the cluster's default)" if least == 0 else ""
                raise ValueError(f"Slurm {name} ({flag}) must be a whole number >= {least}{zero}, got {value!r}")
        for line in self.setup:
            if not isinstance(line, str) or not line.strip() or "\n" in line:
                raise ValueError(f"a Slurm setup line (--slurm-setup) must be one non-empty shell line, got {line!r}")
        for key in self.extra:
            if not isinstance(key, str) or not key or key.startswith("-") or "=" in key:
                raise ValueError(f"extra sbatch option {key!r} (--slurm-extra KEY=VALUE): give the option's long "
                                 "name without dashes, e.g. --slurm-extra reservation=gpu-week")
        return self


def parse_extra(items: list[str]) -> dict[str, str]:
    """``["reservation=x", "mail-type=END"]`` as a dict; ValueError for an item without ``=``."""
    extra = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise ValueError(f"--slurm-extra {item!r}: expected KEY=VALUE, e.g. --slurm-extra reservation=gpu-week")
        extra[key.strip().lstrip("-")] = value
    return extra


def job_name(cell_name: str) -> str:
    """``random-llama-tiny__boolq__seed0`` -> ``cel-random-llama-tiny-boolq-s0``."""
    return "cel-" + cell_name.replace("__seed", "-s").replace("__", "-")


def submitit_parameters(options: SlurmOptions, cluster: str) -> dict[str, Any]:
    """Parameters for ``submitit.AutoExecutor.update_parameters`` (``cluster``: ``slurm`` or ``local``)."""
    params: dict[str, Any] = {"timeout_min": options.timeout_min, "stderr_to_stdout": True}  # one log per job
    if cluster != "slurm":
        return params
    wanted = {"gpus_per_node": options.gpus_per_node, "cpus_per_task": options.cpus_per_task, "mem_gb": options.mem_gb}
    params.update({name: value for name, value in wanted.items() if value})
    named = {"slurm_partition": options.partition, "slurm_account": options.account, "slurm_qos": options.qos,
             "slurm_constraint": options.constraint}
    params.update({name: value for name, value in named.items() if value})
    if options.setup:
        params["slurm_setup"] = list(options.setup)
    if options.array_parallelism:
        params["slurm_array_parallelism"] = options.array_parallelism
    # --requeue: the cluster may requeue the job (preemption, node failure) even where its default says otherwise;
    # --export=ALL: the job sees the submitting shell's environment (CEL_*, HF_HOME) even where a site exports none
    params["slurm_additional_parameters"] = {"requeue": True, "export": "ALL", **options.extra}
    return params


def add_slurm_flags(parser: argparse.ArgumentParser) -> None:
    """The ``--slurm-*`` flags of ``cel grid`` and ``cel main``, one per :class:`SlurmOptions` field."""
    d = SlurmOptions()
    s = parser.add_argument_group(
        "Slurm (with --executor slurm; a job that is preempted or reaches its time limit is requeued and resumes from "
        "the evaluation store)")
    s.add_argument("--slurm-partition", help="partition (default: the cluster's)")
    s.add_argument("--slurm-account", help="account to charge (sbatch --account; default: yours)")
    s.add_argument("--slurm-qos", help="quality of service (sbatch --qos)")
    s.add_argument("--slurm-constraint", help="node features, e.g. a GPU type: 'a100|h100' (sbatch --constraint)")
    s.add_argument("--slurm-gpus", type=int, help=f"GPUs per job (default {d.gpus_per_node}; 0: none requested)")
    s.add_argument("--slurm-cpus", type=int, help=f"CPUs per job (default {d.cpus_per_task}; 0: the cluster's default)")
    s.add_argument("--slurm-mem-gb", type=int, help=f"memory per job in GB (default {d.mem_gb}; 0: the cluster's default)")
    s.add_argument("--slurm-time-min", type=int,
                   help=f"time limit per job in minutes (default {d.timeout_min}); 90 s before it the job is requeued "
                        "(at most 3 times) and its next start resumes")
    s.add_argument("--slurm-setup", action="append", metavar="LINE",
                   help="a shell line run in each job before the cell, e.g. 'module load cuda/12.1' (repeatable)")
    s.add_argument("--slurm-array", type=int, metavar="N",
                   help="submit the cells as one job array (cel-grid) running at most N at once (default: one job "
                        "per cell, named cel-<model>-<task>-s<seed>)")
    s.add_argument("--slurm-extra", action="append", metavar="KEY=VALUE",
                   help="any other sbatch option, e.g. reservation=gpu-week or mail-type=END (repeatable)")


def slurm_options_from_flags(args: argparse.Namespace) -> SlurmOptions:
    """The options the ``--slurm-*`` flags ask for; ValueError for flags given with another executor, a missing
    sbatch, or bad values."""
    given = [f"--{name.replace('_', '-')}" for name, value in vars(args).items()
             if name.startswith("slurm_") and value is not None]
    if given and args.executor != "slurm":
        raise ValueError(f"{' '.join(given)} only apply to --executor slurm (this run: --executor {args.executor})")
    if args.executor == "slurm" and shutil.which("sbatch") is None:
        raise ValueError("--executor slurm submits with sbatch, which is not on PATH: run on a Slurm login node "
                         "(scripts/slurm-cluster.sh start brings up a one-node test cluster on this machine)")
    sizes = {"gpus_per_node": args.slurm_gpus, "cpus_per_task": args.slurm_cpus, "mem_gb": args.slurm_mem_gb,
             "timeout_min": args.slurm_time_min}
    return SlurmOptions(partition=args.slurm_partition, account=args.slurm_account, qos=args.slurm_qos,
                        constraint=args.slurm_constraint, setup=args.slurm_setup or [],
                        array_parallelism=args.slurm_array, extra=parse_extra(args.slurm_extra or []),
                        **{name: value for name, value in sizes.items() if value is not None}).validate()
