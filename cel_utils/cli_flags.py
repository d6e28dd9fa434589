"""The command line's flags, by group (which cells, run settings, execution, paths, the book), and each command's set
of them: :mod:`cel_utils.cli` builds its subcommands from these and runs them.
"""
from __future__ import annotations

import argparse

from cel_utils.config import (BOOK_MODELS, BOOK_SEED, DEFAULT_MODEL, PRESET_TASKS, RunConfig, StrategiesConfig,
                              TransferConfig, add_setting_flags, setting_help)
from cel_utils.presets import PRESET_NAMES


def selection_arguments(parser: argparse.ArgumentParser, title: str, tasks_required: bool = False,
                        models: tuple[str, ...] = (DEFAULT_MODEL,), seed: int = 0) -> None:
    """Which (model, task, seed) cells, with which preset: shared by ``grid``/``main`` and ``strategies``; ``models``
    and ``seed`` are the defaults (``main``'s are the book's, :data:`cel_utils.presets.BOOK_MODELS` and ``BOOK_SEED``)."""
    g = parser.add_argument_group(title)
    g.add_argument("--models", nargs="+", default=list(models), metavar="MODEL",
                   help=setting_help("model").replace("model spec", "model specs") + f" (default: {' '.join(models)})")
    tasks_default = "" if tasks_required else " (default: the preset's, " + "; ".join(
        f"{name}: {' '.join(tasks)}" for name, tasks in PRESET_TASKS.items()) + ")"
    g.add_argument("--tasks", nargs="+", metavar="TASK", required=tasks_required,
                   help=setting_help("task").replace("task:", "tasks:") + tasks_default)
    g.add_argument("--seeds", nargs="+", type=int, default=[seed], metavar="SEED",
                   help=setting_help("seed") + f" (default: {seed})")
    # auto, not RunConfig's none: a grid sizes its runs for where they run (see RunConfig.preset, cel_utils/config.py)
    g.add_argument("--preset", choices=PRESET_NAMES, default="auto",
                   help="per-task sizes and search settings (cel_utils.config.PRESETS): cpu, paper (Table 3 sizes, "
                        "p=10, k=3), quick (minutes on a laptop), smoke (tiny, for tests), none (RunConfig's defaults); "
                        "auto (default): paper where CUDA is available, else cpu, decided where each cell runs")


def settings_arguments(parser: argparse.ArgumentParser, config_class: type = RunConfig) -> None:
    add_setting_flags(parser.add_argument_group("run settings (each replaces the preset's value for every task)"),
                      config_class)


def execution_arguments(parser: argparse.ArgumentParser) -> None:
    from cel_utils.grid import EXECUTORS
    from cel_utils.grid.slurm import add_slurm_flags

    x = parser.add_argument_group("execution")
    x.add_argument("--executor", choices=EXECUTORS, default="local",
                   help="local (default: in this process, or --jobs worker processes), submitit-local (one submitit "
                        "job per cell on this machine), slurm (one Slurm job per cell, or one job array)")
    x.add_argument("--jobs", type=int, default=1, help="cells run at once by the local executor, and (main) models' "
                                                       "transfer steps at once after them (default 1)")
    x.add_argument("--skip-existing", action="store_true",
                   help="skip cells whose artifact and page exist and were made with the same result-changing settings")
    x.add_argument("--notebook", default=None, help="the run notebook (default: notebooks/cel_run.ipynb)")
    x.add_argument("--submitit-dir", help="submitit's job folder, with each job's log (default: <results-dir>/submitit)")
    add_slurm_flags(parser)


def slurm_options(args):
    """The Slurm options the flags ask for; ValueError for flags that do not fit the executor or bad values."""
    from cel_utils.grid.slurm import slurm_options_from_flags

    if args.jobs != 1 and args.executor != "local":
        raise ValueError(f"--jobs is for --executor local; with --executor {args.executor} every cell is its own job "
                         "(cap how many run at once with --slurm-array N)")
    if args.submitit_dir and args.executor == "local":
        raise ValueError("--submitit-dir is for --executor submitit-local or slurm")
    return slurm_options_from_flags(args)


def grid_arguments(parser: argparse.ArgumentParser) -> None:
    selection_arguments(parser, "grid")
    settings_arguments(parser)
    execution_arguments(parser)


def main_arguments(parser: argparse.ArgumentParser) -> None:
    """``grid``'s, with the book's models and seed as defaults: the seed no preset decision has seen (presets.py); and
    the transfer step's setting."""
    selection_arguments(parser, "grid", models=BOOK_MODELS, seed=BOOK_SEED)
    settings_arguments(parser, TransferConfig)  # RunConfig's flags go to the grid, transfer_items to the transfer
    execution_arguments(parser)


def path_arguments(parser: argparse.ArgumentParser) -> None:
    p = parser.add_argument_group("paths")
    p.add_argument("--root", default=".", help="the book root, holding _config.yml (default: .)")
    p.add_argument("--runs-dir", help="executed run notebooks, the book's run pages (default: <root>/book/runs)")
    p.add_argument("--results-dir", help=setting_help("results_dir") + " (default: <root>/results)")


def book_arguments(parser: argparse.ArgumentParser) -> None:
    b = parser.add_argument_group("book")
    b.add_argument("--theory", choices=("reuse", "run", "skip"), default="reuse",
                   help="theory notebooks: reuse (default: execute when missing or out of date), run (always), skip")
    b.add_argument("--no-build", action="store_true", help="generate the pages, skip jupyter-book")


def strategies_arguments(parser: argparse.ArgumentParser) -> None:
    selection_arguments(parser, "what to compare (sizes and p, k as for the grid: the same items as the run pages of "
                                "the same preset)", tasks_required=True)
    settings_arguments(parser, StrategiesConfig)
    parser.add_argument("--notebook", help="the strategies notebook (default: notebooks/cel_strategies.ipynb)")


def transfer_arguments(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("which matrices (from the run artifacts in --results-dir)")
    g.add_argument("--models", nargs="+", default=list(BOOK_MODELS), metavar="MODEL",
                   help=f"model specs (default: the book's, {' '.join(BOOK_MODELS)})")
    g.add_argument("--tasks", nargs="+", metavar="TASK",
                   help="the tasks (rows and columns; each needs its run's artifact; default: every task the model ran)")
    g.add_argument("--seeds", nargs="+", type=int, default=[BOOK_SEED], metavar="SEED",
                   help=f"{setting_help('seed')} (default: {BOOK_SEED})")
    g.add_argument("--jobs", type=int, default=1, help="matrices computed at once, one worker process each (default 1)")
    s = parser.add_argument_group("settings (every other one is the run's, from its artifact)")
    from cel_utils.pipeline.transfer import TRANSFER_SETTINGS

    add_setting_flags(s, TransferConfig, only=TRANSFER_SETTINGS)


def export_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--artifact", required=True, help="a run's JSON artifact (results/<model>__<task>__seed<N>.json)")
    parser.add_argument("--out", required=True, help="the folder to write the checkpoint to")
    parser.add_argument("--device", default="cpu", help="where to load the model (default: cpu)")
    parser.add_argument("--overwrite", action="store_true", help="write into a non-empty folder")
    parser.add_argument("--force", action="store_true", help="export even if the model's weights changed since the run")
    parser.add_argument("--no-verify", action="store_true", help="skip the logit check in a clean process")
    parser.add_argument("--tolerance", type=float, default=1e-4, help="largest allowed logit difference (default 1e-4)")


def list_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--lmeval", metavar="PART", default=None,
                        help="list lm-evaluation-harness's tasks, groups and tags whose name contains PART (\"\" for "
                             "all; with $CEL_LMEVAL_INCLUDE's folders), each runnable task as lmeval:<name>")
