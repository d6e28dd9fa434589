"""Command line: ``cel`` (or ``python -m cel_utils``) ``{grid,main,book,aggregate,toc,strategies,export,list}``.

    grid       run the per-run notebook for every (model, task, seed) with papermill
    main       grid of the book's models and seed (cel_utils.presets.BOOK_MODELS, BOOK_SEED), transfer, then book
    transfer   each model's frozen sets scored on its other tasks' holdouts (the transfer matrix), from the artifacts
    book       theory notebooks + aggregate + toc + `jupyter-book build . -W -n --keep-going`
    aggregate  turn the JSON artifacts into the results page (book/results.md)
    toc        print the committed table of contents and the executed notebooks its globs pick up
    strategies the search strategies compared on (model, task, seed) cells (not part of main: costly on a CPU)
    export     write a run's frozen ablation as a standard Hugging Face checkpoint
    list       the tasks, presets and model families this version knows (--lmeval PART: lm-evaluation-harness's)

Every run setting is a flag of `grid`, `main` and `strategies`, declared once in cel_utils.config.RunConfig; a flag
not given leaves the setting to the preset. Every command exits non-zero when something failed, after doing
everything it could (a failed grid cell does not stop the others; `main` still builds the book from the cells that
succeeded); bad input exits 2 before anything runs.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from cel_utils.cli_flags import (book_arguments, export_arguments, grid_arguments, list_arguments, main_arguments,
                                 path_arguments, slurm_options, strategies_arguments, transfer_arguments)
from cel_utils.config import PRESET_TASKS, RunConfig, StrategiesConfig, TransferConfig, given_settings
from cel_utils.presets import default_tasks


def _paths(args):
    from cel_utils.book.build import BookPaths

    return BookPaths(root=Path(args.root), runs_dir=args.runs_dir, results_dir=args.results_dir)


def _plan(args, config_class: type = RunConfig, **where):
    """The cells the selection and settings flags ask for, or None after printing why they cannot run."""
    from cel_utils import grid

    paths = _paths(args)
    where = {"runs_dir": paths.runs_dir, "results_dir": paths.results_dir, "cwd": paths.root, **where}
    try:
        tasks = args.tasks or default_tasks(args.preset, where.get("cuda"))  # `auto`: for where the cells run
        return grid.plan(args.models, tasks, args.seeds, args.preset,
                         config_class=config_class, **where, **given_settings(args, config_class))
    except ValueError as error:
        print(f"error: {error}", file=sys.stderr)
        return None


def cmd_grid(args) -> int:
    from cel_utils import grid

    try:
        slurm = slurm_options(args)
    except ValueError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    # Slurm jobs run on other machines: those asking for a GPU have CUDA there, whatever the submitting node has.
    cuda = slurm.gpus_per_node > 0 if args.executor == "slurm" else None
    cells = _plan(args, notebook=args.notebook or grid.DEFAULT_NOTEBOOK, cuda=cuda)
    if cells is None:
        return 2
    paths = _paths(args)
    print(f"CEL grid: {len(cells)} cell(s), preset {args.preset!r}, executor {args.executor!r}; pages -> "
          f"{paths.runs_dir}, artifacts -> {paths.results_dir}", flush=True)
    results = grid.run_grid(cells, args.executor, jobs=args.jobs, skip_existing=args.skip_existing, slurm=slurm,
                            log_dir=args.submitit_dir)
    print(grid.summary_text(results), flush=True)
    return 1 if any(r.status == "failed" for r in results) else 0


def cmd_aggregate(args) -> int:
    from cel_utils.book.results_page import write_results_page

    paths = _paths(args)
    page = write_results_page(paths.results_dir, paths.results_page, paths.runs_dir, paths.paper_table)
    print(f"results page: {page}")
    return 0


def cmd_toc(args) -> int:
    from cel_utils.book.build import toc_summary

    try:
        print(toc_summary(_paths(args)))
    except ValueError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    return 0


def cmd_book(args) -> int:
    from cel_utils.book import build
    from cel_utils.book.key_results import add_key_results
    from cel_utils.book.titles import retitle

    paths = _paths(args)
    status = 0
    theory = build.execute_theory(paths, args.theory)
    for name in theory.executed:
        print(f"theory: executed {name}")
    for name, error in theory.failed.items():
        print(f"theory: FAILED {name}: {error} (notebook kept in {paths.failed_dir})", file=sys.stderr)
        status = 1
    for page in build.run_pages(paths):
        retitle(page)
    add_key_results(paths.results_dir, build.run_pages(paths))  # each run among all of them (cel_utils.book.claims)
    cmd_aggregate(args)
    if cmd_toc(args) != 0:
        return 2
    if args.no_build:
        return status
    print("building: " + " ".join(build.jupyter_book_command(paths.root)), flush=True)
    built = build.build_html(paths)
    if built.returncode != 0:
        print(f"jupyter-book build failed (exit {built.returncode}); see the warnings above", file=sys.stderr)
        return 1
    print(f"book: {paths.index_html}")
    return status


def _transfer_settings(args) -> dict:
    """The settings flags given that the transfer step takes (those that change no number, and transfer_items)."""
    from cel_utils.pipeline.transfer import TRANSFER_SETTINGS

    return {name: value for name, value in given_settings(args, TransferConfig).items() if name in TRANSFER_SETTINGS}


def _say(line: str) -> None:
    print(line, flush=True)


def cmd_transfer(args) -> int:
    paths = _paths(args)
    selection = [(model, seed, args.tasks) for model in args.models for seed in args.seeds]
    try:
        given = _transfer_settings(args)
    except ValueError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    from cel_utils.pipeline.transfer import run_transfers

    return run_transfers(paths.results_dir, selection, given, jobs=args.jobs, say=_say)


def cmd_main(args) -> int:
    grid_status = cmd_grid(args)
    if grid_status == 2:
        return 2
    # The transfer step runs after every cell: it needs all of a model's artifacts, and its evaluations go to the same
    # store the cells used. Its rows and columns are every task the model has an artifact of, as the results page
    # shows them all. Slurm cells ran on other machines, and the transfer would too: `cel transfer` there.
    selection = [] if args.executor == "slurm" else [(m, s, None) for m in args.models for s in args.seeds]
    if args.executor == "slurm":
        print("transfer: not run here (the cells ran on the cluster): `cel transfer` on a node with the results and the "
              "store, then `cel book`", flush=True)
    from cel_utils.pipeline.transfer import run_transfers

    transfer_status = run_transfers(_paths(args).results_dir, selection, _transfer_settings(args), jobs=args.jobs,
                                    say=_say)
    book_status = cmd_book(args)
    return max(grid_status, transfer_status, book_status)


def cmd_strategies(args) -> int:
    """Execute notebooks/cel_strategies.ipynb with papermill for every (model, task, seed), as grid cells: a page
    reaches book/strategies/ only when its notebook ran through (see cel_utils.grid.cells)."""
    from cel_utils import grid

    paths = _paths(args)
    # the grid's planning, so the same preset and settings give the same items as the run pages
    cells = _plan(args, StrategiesConfig, notebook=args.notebook or grid.STRATEGIES_NOTEBOOK,
                  runs_dir=paths.root / "book" / "strategies")
    if cells is None:
        return 2
    status = 0
    for cell in cells:
        cell.retitle = False  # the strategies page keeps its own title
        print(f"strategies: {cell.name} -> {cell.page}", flush=True)
        result = grid.run_cell(cell, stream=True)  # its stages and progress lines, as it runs
        print(grid.result_line(result), file=sys.stderr if result.status == "failed" else sys.stdout, flush=True)
        status = 1 if result.status == "failed" else status
    print(f"summaries in {paths.results_dir / 'strategies'}; `cel aggregate` adds them to the results page")
    return status


def cmd_export(args) -> int:
    from cel_utils.models.heads import parse_head
    from cel_utils.models.loading import load_model
    from cel_utils.pipeline.artifacts import read_artifact
    from cel_utils.pipeline.export import export_ablated, verify_export

    artifact = read_artifact(Path(args.artifact))
    heads = [parse_head(h) for h in artifact["frozen"]["heads"]]
    cfg = artifact["config"]
    lm = load_model(cfg["model"], device=args.device, dtype=artifact["model"]["dtype"], revision=cfg.get("revision"))
    if lm.fingerprint != artifact["model"]["fingerprint"] and not args.force:
        print(f"error: the weights of {artifact['config']['model']!r} loaded now (fingerprint {lm.fingerprint}) are not "
              f"those the run used ({artifact['model']['fingerprint']}); pass --force to export anyway", file=sys.stderr)
        return 2
    try:
        out = export_ablated(lm, heads, args.out, artifact=artifact, overwrite=args.overwrite)
    except (FileExistsError, ValueError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    print(f"exported {lm.name} with {'+'.join(map(str, heads))} zeroed to {out}")
    if args.no_verify:
        return 0
    difference = verify_export(lm, heads, out)
    print(f"check: largest |logit difference| between the export (loaded without cel_utils) and the hooked model: "
          f"{difference:.2e}")
    return 0 if difference <= args.tolerance else 1


def _list_lmeval(part: str) -> int:
    from cel_utils.tasks.lmeval_declared import KINDS
    from cel_utils.tasks.lmeval_registry import PREFIX, lmeval_version, search

    rows = search(part)
    print(f"lm-evaluation-harness {lmeval_version()}: {len(rows)} name(s) containing {part!r} "
          "(run a task as lmeval:<name>; a group or tag is its tasks, run as a grid)")
    for row in rows:
        if row["kind"] == "task":
            kind = KINDS.get(row["output_type"], "not runnable: no per-item decision")
            print(f"  {PREFIX + row['name']:48s} {row['output_type']:22s} -> {kind}")
        elif row["kind"] in ("group", "tag"):
            members = row["members"]
            shown = ", ".join(members[:4]) + (f", ... ({len(members)})" if len(members) > 4 else "")
            print(f"  {row['name']:48s} {row['kind']:22s} of {shown}")
        else:
            print(f"  {row['name']:48s} {'python class':22s} -> not runnable (not a YAML declaration)")
    return 0


def cmd_list(args) -> int:
    from cel_utils.presets import PRESETS, preset_values
    from cel_utils.models.plumbing import ARCHITECTURES
    from cel_utils.tasks.specs import TASKS

    if args.lmeval is not None:
        return _list_lmeval(args.lmeval)
    print("tasks (task: kind, primary metric, the paper's discovery / holdout sizes):")
    for name, task in TASKS.items():
        print(f"  {name:16s} {task.kind:8s} {task.metric:8s} {task.paper_sizes[0]} / {task.paper_sizes[1]}")
    print("\npresets (settings per task family; anything else is RunConfig's default):")
    for name in PRESETS:
        print(f"  {name}: default tasks {' '.join(PRESET_TASKS[name])}")
        for task in sorted({t for t in PRESET_TASKS[name]}):
            values = ", ".join(f"{k}={v}" for k, v in preset_values(name, task).items())
            print(f"    {task:16s} {values or '(RunConfig defaults)'}")
    print("\nmodel families (model_type -> decoder layers, attention output projection):")
    for model_type, (layers, projection) in ARCHITECTURES.items():
        print(f"  {model_type:12s} {layers}, {projection}")
    return 0


def parser() -> argparse.ArgumentParser:
    from importlib.metadata import PackageNotFoundError, version

    try:
        own_version = version("cel-book")
    except PackageNotFoundError:
        own_version = "unknown (not installed)"
    top = argparse.ArgumentParser(prog="cel", description=__doc__.replace("``", ""),
                                  formatter_class=argparse.RawDescriptionHelpFormatter)
    top.add_argument("--version", action="version", version=f"cel-book {own_version}")
    sub = top.add_subparsers(dest="command", required=True, metavar="COMMAND")
    commands = {
        "grid": ("run the per-run notebook for a grid of models x tasks x seeds", cmd_grid, [grid_arguments, path_arguments]),
        "main": ("grid of the book's models and seed with the default preset, then book", cmd_main,
                 [main_arguments, path_arguments, book_arguments]),
        "transfer": ("score each model's frozen sets on the holdouts of its other tasks (the transfer matrix)",
                     cmd_transfer, [transfer_arguments, path_arguments]),
        "book": ("theory notebooks, results page, toc, and jupyter-book build", cmd_book, [path_arguments, book_arguments]),
        "aggregate": ("write the results page from the artifacts", cmd_aggregate, [path_arguments]),
        "toc": ("print the table of contents and the executed notebooks it picks up", cmd_toc, [path_arguments]),
        "strategies": ("compare search strategies on (model, task, seed) cells; executes notebooks/cel_strategies.ipynb",
                       cmd_strategies, [strategies_arguments, path_arguments]),
        "export": ("write a run's frozen ablation as a standard Hugging Face checkpoint", cmd_export, [export_arguments]),
        "list": ("the tasks, presets and model families this version knows; --lmeval: lm-eval's tasks", cmd_list,
                 [list_arguments]),
    }
    for name, (help_text, func, adders) in commands.items():
        command = sub.add_parser(name, help=help_text, description=help_text)
        for add in adders:
            add(command)
        command.set_defaults(func=func)
    return top


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    return args.func(args)
