"""Command line: ``python -m cel_utils {grid,aggregate,toc,book,main,strategies,export}``.

    grid       run the per-run notebook for every (model, task, seed) with papermill
    aggregate  turn the JSON artifacts into the results page (book/results.md)
    toc        write _toc.yml from _toc.template.yml and the executed notebooks
    book       theory notebooks + aggregate + toc + `jupyter-book build . -W -n --keep-going`
    main       grid with the default preset, then book
    strategies the search strategies compared on one (model, task, seed) (not part of main: costly on a CPU)
    export     write a run's frozen ablation as a standard Hugging Face checkpoint

Every command exits non-zero when something failed, after doing everything it could (a failed grid cell
does not stop the others; `main` still builds the book from the cells that succeeded).
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path


def _selection_arguments(parser: argparse.ArgumentParser, title: str, tasks_required: bool = False) -> None:
    """Which (model, task, seed) cells, with which preset: shared by ``grid``/``main`` and ``strategies``."""
    from cel_utils.grid import PRESET_NAMES, PRESET_TASKS
    from cel_utils.models import DEFAULT_MODEL

    g = parser.add_argument_group(title)
    g.add_argument("--models", nargs="+", default=[DEFAULT_MODEL], metavar="MODEL",
                   help=f"model specs: {DEFAULT_MODEL!r} (default), hub ids, checkpoint paths, random:<family>:tiny")
    g.add_argument("--tasks", nargs="+", metavar="TASK", required=tasks_required,
                   help=("tasks" if tasks_required else "tasks (default: the preset's, " + "; ".join(
                       f"{name}: {' '.join(tasks)}" for name, tasks in PRESET_TASKS.items()) + ")") +
                        "; arithmetic pools the 10 configs, single ones like arithmetic_2da work too")
    g.add_argument("--seeds", nargs="+", type=int, default=[0], metavar="SEED", help="seeds (default: 0)")
    g.add_argument("--preset", choices=PRESET_NAMES, default="auto",
                   help="per-task sizes and p, k: cpu, paper (Table 3 sizes, p=10, k=3), smoke (tiny, for tests); "
                        "auto (default): paper when CUDA is available, else cpu")


def _override_arguments(parser: argparse.ArgumentParser):
    s = parser.add_argument_group("overrides of the preset, for every task")
    s.add_argument("--n-discovery", type=int)
    s.add_argument("--n-holdout", type=int)
    s.add_argument("--p", type=int, help="pool size")
    s.add_argument("--k", type=int, help="budget: heads ablated together")
    s.add_argument("--batch-size", type=int)
    s.add_argument("--engine", choices=("fast", "naive"), help="default: fast")
    s.add_argument("--device", help="auto (default), cpu, cuda, cuda:1, ...")
    s.add_argument("--data-dir", help="local data mirror (default: $CEL_DATA_DIR, else the Hugging Face hub)")
    return s


def _grid_arguments(parser: argparse.ArgumentParser) -> None:
    from cel_utils.grid import EXECUTORS

    _selection_arguments(parser, "grid")
    s = _override_arguments(parser)
    s.add_argument("--num-fewshot", type=int)
    s.add_argument("--fmt", choices=("plain", "chat"))
    s.add_argument("--max-new-tokens", type=int)
    s.add_argument("--dtype", help="auto (default: fp32 on CPU, bf16 on GPU), float32, bfloat16, float16")
    s.add_argument("--n-random-sets", type=int, help="random head sets scored on the holdout as a null (0: off)")
    s.add_argument("--n-resamples", type=int, help="reruns of the selection on resampled discovery sets (0: off)")
    s.add_argument("--resample", choices=("bootstrap", "halves"), help="how discovery sets are resampled")
    x = parser.add_argument_group("execution")
    x.add_argument("--executor", choices=EXECUTORS, default="local",
                   help="local (default: in this process, or --jobs worker processes), submitit-local (one submitit "
                        "job per cell on this machine), slurm (one submitit job per cell on a Slurm cluster)")
    x.add_argument("--jobs", type=int, default=1, help="cells run at once by the local executor (default 1)")
    x.add_argument("--skip-existing", action="store_true",
                   help="skip cells whose artifact and page exist and were made with the same parameters")
    x.add_argument("--notebook", default=None, help="the run notebook (default: notebooks/cel_run.ipynb)")
    x.add_argument("--slurm-partition")
    x.add_argument("--slurm-time-min", type=int, default=12 * 60, help="job time limit in minutes (default 720)")
    x.add_argument("--slurm-gpus", type=int, default=1, help="GPUs per job (default 1)")
    x.add_argument("--slurm-cpus", type=int, default=8, help="CPUs per job (default 8)")
    x.add_argument("--slurm-mem-gb", type=int, default=64, help="memory per job in GB (default 64)")
    x.add_argument("--submitit-dir", help="submitit's job folder (default: <results-dir>/submitit)")


def _path_arguments(parser: argparse.ArgumentParser) -> None:
    p = parser.add_argument_group("paths")
    p.add_argument("--root", default=".", help="the book root, holding _config.yml (default: .)")
    p.add_argument("--runs-dir", help="executed run notebooks, the book's run pages (default: <root>/book/runs)")
    p.add_argument("--results-dir", help="JSON artifacts (default: <root>/results)")


def _book_arguments(parser: argparse.ArgumentParser) -> None:
    b = parser.add_argument_group("book")
    b.add_argument("--theory", choices=("reuse", "run", "skip"), default="reuse",
                   help="theory notebooks: reuse (default: execute when missing or out of date), run (always), skip")
    b.add_argument("--no-build", action="store_true", help="generate the pages and _toc.yml, skip jupyter-book")


def _paths(args):
    from cel_utils.book import BookPaths

    return BookPaths(root=Path(args.root), runs_dir=args.runs_dir, results_dir=args.results_dir)


def cmd_grid(args) -> int:
    from cel_utils import grid

    paths = _paths(args)
    overrides = {name: getattr(args, name) for name in ("n_discovery", "n_holdout", "p", "k", "num_fewshot", "fmt",
                                                        "max_new_tokens", "batch_size", "engine", "device", "dtype",
                                                        "data_dir", "n_random_sets", "n_resamples", "resample")}
    try:
        cells = grid.plan(args.models, args.tasks or grid.default_tasks(args.preset), args.seeds, args.preset,
                          runs_dir=paths.runs_dir, results_dir=paths.results_dir, notebook=args.notebook or grid.DEFAULT_NOTEBOOK,
                          cwd=paths.root, **overrides)
    except ValueError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    preset = grid.resolve_preset(args.preset)
    print(f"CEL grid: {len(cells)} cell(s), preset {preset!r}, executor {args.executor!r}; pages -> {paths.runs_dir}, "
          f"artifacts -> {paths.results_dir}", flush=True)
    slurm = grid.SlurmOptions(partition=args.slurm_partition, timeout_min=args.slurm_time_min,
                              gpus_per_node=args.slurm_gpus, cpus_per_task=args.slurm_cpus, mem_gb=args.slurm_mem_gb)
    results = grid.run_grid(cells, args.executor, jobs=args.jobs, skip_existing=args.skip_existing, slurm=slurm,
                            log_dir=args.submitit_dir)
    print(grid.summary_text(results), flush=True)
    return 1 if any(r.status == "failed" for r in results) else 0


def cmd_aggregate(args) -> int:
    from cel_utils.report import write_results_page

    paths = _paths(args)
    page = write_results_page(paths.results_dir, paths.results_page, paths.runs_dir, paths.paper_table)
    print(f"results page: {page}")
    return 0


def cmd_toc(args) -> int:
    from cel_utils.book import write_toc

    print(f"table of contents: {write_toc(_paths(args))}")
    return 0


def cmd_book(args) -> int:
    from cel_utils import book, grid

    paths = _paths(args)
    status = 0
    theory = book.execute_theory(paths, args.theory)
    for name in theory.executed:
        print(f"theory: executed {name}")
    for name, error in theory.failed.items():
        print(f"theory: FAILED {name}: {error} (notebook kept in {paths.failed_dir})", file=sys.stderr)
        status = 1
    for page in book.run_pages(paths):
        grid.retitle(page)
    cmd_aggregate(args)
    cmd_toc(args)
    if args.no_build:
        return status
    print("building: " + " ".join(book.jupyter_book_command(paths.root)), flush=True)
    built = book.build_html(paths)
    if built.returncode != 0:
        print(f"jupyter-book build failed (exit {built.returncode}); see the warnings above", file=sys.stderr)
        return 1
    print(f"book: {paths.index_html}")
    return status


def cmd_main(args) -> int:
    grid_status = cmd_grid(args)
    if grid_status == 2:
        return 2
    book_status = cmd_book(args)
    return max(grid_status, book_status)


STRATEGY_PARAMETERS = ("model", "task", "seed", "n_discovery", "n_holdout", "p", "k", "fmt", "num_fewshot", "data_dir",
                       "results_dir", "batch_size", "device", "engine", "max_new_tokens", "beam_width",
                       "attribution_candidates")


def cmd_strategies(args) -> int:
    """Execute notebooks/cel_strategies.ipynb with papermill for every (model, task, seed), as grid cells: a
    page reaches book/strategies/ only when its notebook ran through (see cel_utils.grid)."""
    from dataclasses import replace

    from cel_utils import grid
    from cel_utils.strategies import check_strategy_params

    paths = _paths(args)
    notebook = Path(args.notebook or grid.PACKAGE_DIR.parent / "notebooks" / "cel_strategies.ipynb")
    overrides = {name: getattr(args, name) for name in ("n_discovery", "n_holdout", "p", "k", "engine", "device",
                                                        "batch_size", "data_dir")}
    try:  # the grid's cells, so the same preset, overrides and checks give the same items as the run pages
        cells = grid.plan(args.models, args.tasks, args.seeds, args.preset, results_dir=paths.results_dir, **overrides)
        for cell in cells:
            check_strategy_params(args.beam_width, args.attribution_candidates, cell.parameters["p"])
    except ValueError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    status = 0
    for cell in cells:
        parameters = {key: value for key, value in cell.parameters.items() if key in STRATEGY_PARAMETERS}
        cell = replace(cell, parameters={**parameters, "beam_width": args.beam_width,
                                         "attribution_candidates": args.attribution_candidates},
                       runs_dir=str(paths.root / "book" / "strategies"), results_dir=str(paths.results_dir / "strategies"),
                       notebook=str(notebook.resolve()), cwd=str(paths.root), retitle=False)
        print(f"strategies: {cell.name} -> {cell.page}", flush=True)
        result = grid.run_cell(cell)
        print(grid.result_line(result), file=sys.stderr if result.status == "failed" else sys.stdout, flush=True)
        status = 1 if result.status == "failed" else status
    print(f"summaries in {paths.results_dir / 'strategies'}; `python -m cel_utils aggregate` adds them to the results page")
    return status


def _strategies_arguments(parser: argparse.ArgumentParser) -> None:
    _selection_arguments(parser, "what to compare (sizes and p, k as for the grid: the same items as the run "
                                 "pages of the same preset)", tasks_required=True)
    _override_arguments(parser)
    g = parser.add_argument_group("strategies")
    g.add_argument("--beam-width", type=int, default=3, help="sets kept per size by beam search (default 3)")
    g.add_argument("--attribution-candidates", type=int,
                   help="heads the attribution screen passes to exact evaluation (default: p)")
    g.add_argument("--notebook", help="the strategies notebook (default: notebooks/cel_strategies.ipynb)")


def cmd_export(args) -> int:
    from cel_utils.artifacts import read_artifact
    from cel_utils.export import export_ablated, verify_export
    from cel_utils.heads import parse_head
    from cel_utils.models import load_model

    artifact = read_artifact(Path(args.artifact))
    heads = [parse_head(h) for h in artifact["frozen"]["heads"]]
    lm = load_model(artifact["config"]["model"], device=args.device, dtype=artifact["model"]["dtype"])
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


def _export_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--artifact", required=True, help="a run's JSON artifact (results/<model>__<task>__seed<N>.json)")
    parser.add_argument("--out", required=True, help="the folder to write the checkpoint to")
    parser.add_argument("--device", default="cpu", help="where to load the model (default: cpu)")
    parser.add_argument("--overwrite", action="store_true", help="write into a non-empty folder")
    parser.add_argument("--force", action="store_true", help="export even if the model's weights changed since the run")
    parser.add_argument("--no-verify", action="store_true", help="skip the logit check in a clean process")
    parser.add_argument("--tolerance", type=float, default=1e-4, help="largest allowed logit difference (default 1e-4)")


def parser() -> argparse.ArgumentParser:
    top = argparse.ArgumentParser(prog="python -m cel_utils", description=__doc__.replace("``", ""),
                                  formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = top.add_subparsers(dest="command", required=True, metavar="COMMAND")
    commands = {
        "grid": ("run the per-run notebook for a grid of models x tasks x seeds", cmd_grid, [_grid_arguments, _path_arguments]),
        "aggregate": ("write the results page from the artifacts", cmd_aggregate, [_path_arguments]),
        "toc": ("write _toc.yml from the template and the executed notebooks", cmd_toc, [_path_arguments]),
        "book": ("theory notebooks, results page, toc, and jupyter-book build", cmd_book, [_path_arguments, _book_arguments]),
        "main": ("grid with the default preset, then book", cmd_main, [_grid_arguments, _path_arguments, _book_arguments]),
        "strategies": ("compare search strategies on one (model, task, seed); executes notebooks/cel_strategies.ipynb",
                       cmd_strategies, [_strategies_arguments, _path_arguments]),
        "export": ("write a run's frozen ablation as a standard Hugging Face checkpoint", cmd_export, [_export_arguments]),
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


if __name__ == "__main__":
    sys.exit(main())
