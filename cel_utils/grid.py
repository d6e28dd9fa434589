"""Run the per-run notebook over a grid of (model, task, seed) cells with papermill, locally or on Slurm.

Every cell of the grid executes ``notebooks/cel_run.ipynb`` once with papermill and produces two files:

* ``results/<model>__<task>__seed<N>.json`` -- the run's artifact, written atomically by ``run_cel``;
* ``book/runs/<model>__<task>__seed<N>.ipynb`` -- the executed notebook, which becomes the run's book page.

papermill writes its output as cells finish, so a cell executes into ``results/.running/`` and its notebook is
moved into ``book/runs/`` only when every notebook cell succeeded. A failed cell is reported (the summary at the
end; the CLI exits non-zero) and never stops the others. Its executed notebook goes to ``results/failed/`` for
debugging, never into ``book/runs/``, so it cannot reach the table of contents. A failure before ``run_cel``
finished leaves no artifact (and keeps any earlier successful run of the cell as it was); a failure after it
(in a plot or table) moves the fresh artifact to ``results/failed/`` too and drops the cell's earlier page,
which no longer matches any artifact. ``python -m cel_utils strategies`` runs its notebook through the same
cells (into ``book/strategies/`` and ``results/strategies/``), so its pages follow the same rule.

Executors: ``local`` runs cells in this process one after the other, or ``jobs`` at a time in worker processes
(each papermill run starts its own kernel); ``submitit-local`` and ``slurm`` submit one submitit job per cell
(like the paper: one job per model-task), the first on this machine, the second to a Slurm cluster.

Presets hold per-task sizes and search parameters, in the one table :data:`PRESETS`.
"""
from __future__ import annotations

import ast
import os
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Callable, Iterable

PACKAGE_DIR = Path(__file__).resolve().parent
DEFAULT_NOTEBOOK = PACKAGE_DIR.parent / "notebooks" / "cel_run.ipynb"
EXECUTORS = ("local", "submitit-local", "slurm")
TITLE_PREFIX = "# CEL run"


@dataclass(frozen=True)
class TaskPreset:
    n_discovery: int | None  # None: the paper's Table 3 size
    n_holdout: int | None
    p: int
    k: int
    num_fewshot: int | None = None  # None: the task's default (MBPP 3, others 0)
    fmt: str = "plain"
    max_new_tokens: int = 256  # only generation (MBPP) uses it
    batch_size: int = 8
    # cel_utils.reliability: random head sets scored on the holdout (the null), and reruns of the selection on
    # resampled discovery sets (stability). Each random set costs one holdout evaluation; each resample costs
    # the subsets of its pool not yet evaluated, plus one holdout evaluation per distinct selection.
    n_random_sets: int = 100
    n_resamples: int = 50
    resample: str = "bootstrap"


# One row per (preset, task family). "arithmetic" also covers its single configs (arithmetic_2da, ...).
# cpu: a laptop-sized demonstration of the whole protocol on the default model (measured wall times in README.md):
#   tiny discovery sets, so the selections are noisy by design, and the reliability section of each page says how
#   noisy. Arithmetic runs 3-shot: SmolLM2-135M-Instruct echoes the question at 0-shot (0.8% on the pooled
#   configs) and gets 0% of the 3- to 5-digit configs at 3-shot; on 40 items per config at 3-shot it reached
#   1dc 12%, 2dm 8%, 2da 5%, the rest 0-2% (chat format: 0-5%), so the cpu default is arithmetic_1dc (5.2% on
#   500 items). MBPP is the costly one: decoding takes about 1.1 s per item and intervention on 2 cores (stage 1
#   is 271 interventions), so its discovery set is 2 problems (a smoke test of the protocol on code, not a finding).
# paper: the paper's Table 3 sizes with p=10, k=3 (for a GPU); smoke: seconds per cell with a random tiny model.
# null / resamples (cel_utils.reliability): the paper preset runs 100 random sets and 50 bootstrap reruns; the
# cpu preset only a few, so that they add about a fifth to a cell's time.
PRESETS: dict[str, dict[str, TaskPreset]] = {
    "cpu": {
        #                        n_disc n_hold  p  k  fewshot  fmt      new_tok batch null resamples
        "arithmetic": TaskPreset(16,    100,    5, 2, 3,       "plain", 256,    8,    5,   4),
        "boolq":      TaskPreset(8,     80,     5, 2, None,    "plain", 256,    8,    4,   3),
        "hellaswag":  TaskPreset(8,     80,     5, 2, None,    "plain", 256,    8,    4,   3),
        "mbpp":       TaskPreset(2,     10,     5, 2, None,    "plain", 96,     8,    2,   2),
    },
    "paper": {
        "arithmetic": TaskPreset(None,  None,   10, 3, None,   "plain", 256,    32,   100, 50),
        "boolq":      TaskPreset(None,  None,   10, 3, None,   "plain", 256,    32,   100, 50),
        "hellaswag":  TaskPreset(None,  None,   10, 3, None,   "plain", 256,    32,   100, 50),
        "mbpp":       TaskPreset(None,  None,   10, 3, None,   "plain", 256,    32,   100, 50),
    },
    "smoke": {
        "arithmetic": TaskPreset(6,     8,      3, 2, None,    "plain", 32,     8,    3,   3),
        "boolq":      TaskPreset(6,     8,      3, 2, None,    "plain", 32,     8,    3,   3),
        "hellaswag":  TaskPreset(6,     8,      3, 2, None,    "plain", 32,     8,    3,   3),
        "mbpp":       TaskPreset(2,     3,      3, 2, None,    "plain", 32,     8,    3,   3),
    },
}
PRESET_NAMES = ("auto", *PRESETS)
DEFAULT_TASKS = ("arithmetic", "boolq", "hellaswag", "mbpp")
# The tasks a grid runs when none are named. The paper pools the 10 arithmetic configs; on CPU the default model
# is only non-degenerate on single configs like 1dc (see the cpu rows above).
PRESET_TASKS = {"cpu": ("arithmetic_1dc", "boolq", "hellaswag", "mbpp"), "paper": DEFAULT_TASKS, "smoke": DEFAULT_TASKS}


def default_tasks(preset: str = "auto") -> tuple[str, ...]:
    return PRESET_TASKS[resolve_preset(preset)]


def task_family(task: str) -> str:
    return "arithmetic" if task.startswith("arithmetic") else task


def resolve_preset(name: str = "auto") -> str:
    """``auto``: ``paper`` when CUDA is available, else ``cpu``."""
    if name == "auto":
        import torch

        return "paper" if torch.cuda.is_available() else "cpu"
    if name not in PRESETS:
        raise ValueError(f"unknown preset {name!r}: choose from {', '.join(PRESET_NAMES)}")
    return name


def preset_for(preset: str, task: str) -> TaskPreset:
    from cel_utils.tasks import get_task

    get_task(task)  # an unknown task says so, not "no preset row"
    table = PRESETS[resolve_preset(preset)]
    family = task_family(task)
    if family not in table:
        raise ValueError(f"preset {preset!r} has no row for task {task!r} (family {family!r}): add one to cel_utils.grid.PRESETS")
    return table[family]


# --- the grid ----------------------------------------------------------------------------------------------------

@dataclass
class Cell:
    """One (model, task, seed) of the grid: the notebook's parameters and where its outputs go."""

    parameters: dict  # the notebook's papermill parameters (= RunConfig fields)
    runs_dir: str
    results_dir: str
    notebook: str = str(DEFAULT_NOTEBOOK)
    cwd: str | None = None
    kernel_name: str = "python3"
    retitle: bool = True  # give the page the run title (see retitle); off for other notebooks (strategies)

    @property
    def name(self) -> str:
        from cel_utils.artifacts import artifact_name
        from cel_utils.models import display_name

        p = self.parameters
        return artifact_name(display_name(p["model"]), p["task"], p["seed"]).removesuffix(".json")

    @property
    def page(self) -> Path:
        return Path(self.runs_dir) / f"{self.name}.ipynb"

    @property
    def artifact(self) -> Path:
        return Path(self.results_dir) / f"{self.name}.json"

    @property
    def failed_dir(self) -> Path:
        return Path(self.results_dir) / "failed"

    @property
    def staging(self) -> Path:
        return Path(self.results_dir) / ".running" / f"{self.name}.ipynb"


@dataclass
class CellResult:
    name: str
    model: str
    task: str
    seed: int
    status: str  # "ok", "failed" or "skipped" (an up-to-date result existed)
    seconds: float = 0.0
    notebook: str | None = None
    artifact: str | None = None
    error: str | None = None
    holdout: dict | None = None  # the artifact's holdout summary (ok and skipped run cells)


def plan(models: Iterable[str], tasks: Iterable[str], seeds: Iterable[int] = (0,), preset: str = "auto", *,
         runs_dir: str | os.PathLike = "book/runs", results_dir: str | os.PathLike = "results",
         notebook: str | os.PathLike = DEFAULT_NOTEBOOK, cwd: str | os.PathLike | None = None,
         **overrides) -> list[Cell]:
    """The grid's cells, each checked with ``RunConfig.validate()`` before anything runs.

    ``overrides`` (any RunConfig field: n_discovery, p, engine, data_dir, device, ...) replace the preset's
    value for every task; ``None`` values are ignored.
    """
    from cel_utils.protocol import RunConfig

    preset = resolve_preset(preset)
    overrides = {key: value for key, value in overrides.items() if value is not None}
    unknown = set(overrides) - set(RunConfig.__dataclass_fields__)
    if unknown:
        raise ValueError(f"unknown run parameter(s) {sorted(unknown)}: use RunConfig fields")
    results_dir = Path(results_dir).resolve()
    if "data_dir" in overrides:
        overrides["data_dir"] = str(Path(overrides["data_dir"]).expanduser().resolve())
    cells, seen = [], set()
    for model in models:
        for task in tasks:
            for seed in seeds:
                try:
                    parameters = {"model": model, "task": task, "seed": int(seed), **asdict(preset_for(preset, task)),
                                  "results_dir": str(results_dir), **overrides}
                    RunConfig(**parameters).validate()
                except (ValueError, TypeError, PermissionError) as error:
                    raise ValueError(f"grid cell ({model}, {task}, seed {seed}): {error}") from None
                cell = Cell(parameters=parameters, runs_dir=str(Path(runs_dir).resolve()), results_dir=str(results_dir),
                            notebook=str(Path(notebook).resolve()), cwd=str(Path(cwd).resolve()) if cwd else None)
                if cell.name in seen:
                    raise ValueError(f"two grid cells write the same files {cell.name!r}: model names must differ")
                seen.add(cell.name)
                cells.append(cell)
    return cells


# --- one cell ----------------------------------------------------------------------------------------------------

_COMPARED = ("model", "task", "seed", "n_discovery", "n_holdout", "p", "k", "fmt", "num_fewshot", "max_new_tokens",
             "n_random_sets", "n_resamples", "resample")


def up_to_date(cell: Cell) -> dict | None:
    """The cell's artifact if it and its page exist and it was made with the same parameters."""
    from cel_utils.artifacts import read_artifact

    if not (cell.artifact.exists() and cell.page.exists()):
        return None
    try:
        artifact = read_artifact(cell.artifact)
    except ValueError:
        return None
    stored = artifact.get("config", {})
    wanted = {key: cell.parameters.get(key) for key in _COMPARED}
    return artifact if all(stored.get(k) == v for k, v in wanted.items()) else None


def _stat(path: Path):
    try:
        stat = path.stat()
        return stat.st_ino, stat.st_mtime_ns, stat.st_size
    except FileNotFoundError:
        return None


def _error_text(error: BaseException) -> str:
    from papermill.exceptions import PapermillExecutionError

    if isinstance(error, PapermillExecutionError):
        evalue = (error.evalue or "").strip().splitlines()
        return f"{error.ename}: {evalue[0] if evalue else ''} (notebook cell [{error.exec_count}])"
    text = str(error).strip().splitlines()
    return f"{type(error).__name__}: {text[0] if text else ''}"


# jupyter_client picks a kernel's ports by binding free ones and releasing them, so kernels that parallel cells
# (--jobs, submitit) start at the same moment can pick the same port, and one dies before it answers. No notebook
# cell has run then, so starting it again is safe; any other failure is the run's own and is not retried.
KERNEL_START_ERRORS = ("Kernel died before replying to kernel_info", "Kernel didn't respond in")
KERNEL_START_ATTEMPTS = 3


def _execute(cell: Cell) -> None:
    """papermill on the cell's notebook, into its staging path; a kernel that fails to start is started again."""
    import papermill as pm

    for attempt in range(1, KERNEL_START_ATTEMPTS + 1):
        try:
            pm.execute_notebook(cell.notebook, str(cell.staging), parameters=cell.parameters,
                                kernel_name=cell.kernel_name, progress_bar=False, cwd=cell.cwd)
            return
        except RuntimeError as error:
            if attempt == KERNEL_START_ATTEMPTS or not str(error).startswith(KERNEL_START_ERRORS):
                raise


def run_cell(cell: Cell, skip_existing: bool = False) -> CellResult:
    """Execute the notebook for one cell; never raises for a failing run (the result says what failed)."""
    p = cell.parameters
    result = CellResult(name=cell.name, model=p["model"], task=p["task"], seed=p["seed"], status="failed")
    if skip_existing:
        artifact = up_to_date(cell)
        if artifact is not None:
            result.status, result.notebook, result.artifact = "skipped", str(cell.page), str(cell.artifact)
            result.holdout = artifact["holdout"]
            return result
    start = time.perf_counter()
    before = _stat(cell.artifact)
    cell.staging.parent.mkdir(parents=True, exist_ok=True)
    cell.staging.unlink(missing_ok=True)
    try:
        _execute(cell)
        if not cell.artifact.exists() or _stat(cell.artifact) == before:
            raise RuntimeError(f"the notebook finished but wrote no new artifact {cell.artifact}")
    except Exception as error:  # noqa: BLE001 - a failed cell is reported, never raised
        result.error = _error_text(error)
        result.seconds = time.perf_counter() - start
        _file_failure(cell, before, result)
        return result
    if cell.retitle:
        retitle(cell.staging)
    cell.page.parent.mkdir(parents=True, exist_ok=True)
    os.replace(cell.staging, cell.page)
    for stale in (cell.failed_dir / f"{cell.name}.ipynb", cell.failed_dir / f"{cell.name}.json"):
        stale.unlink(missing_ok=True)
    from cel_utils.artifacts import read_artifact

    result.status, result.notebook, result.artifact = "ok", str(cell.page), str(cell.artifact)
    result.holdout = read_artifact(cell.artifact).get("holdout")  # a strategies summary has none
    result.seconds = time.perf_counter() - start
    return result


def _file_failure(cell: Cell, artifact_before, result: CellResult) -> None:
    """Move what a failed run left behind out of the book: notebook (and a fresh artifact) to results/failed/."""
    cell.failed_dir.mkdir(parents=True, exist_ok=True)
    if cell.staging.exists():
        os.replace(cell.staging, cell.failed_dir / f"{cell.name}.ipynb")
        result.notebook = str(cell.failed_dir / f"{cell.name}.ipynb")
    if cell.artifact.exists() and _stat(cell.artifact) != artifact_before:
        os.replace(cell.artifact, cell.failed_dir / f"{cell.name}.json")
        cell.page.unlink(missing_ok=True)  # its earlier page matched the artifact just replaced


def _failed_result(cell: Cell, error: BaseException, artifact_before, seconds: float = 0.0) -> CellResult:
    """For a job that died outside run_cell (killed, out of memory, cluster error)."""
    p = cell.parameters
    result = CellResult(name=cell.name, model=p["model"], task=p["task"], seed=p["seed"], status="failed",
                        seconds=seconds, error=_error_text(error))
    _file_failure(cell, artifact_before, result)
    return result


# --- the title of an executed notebook ---------------------------------------------------------------------------

def notebook_parameters(path: str | os.PathLike) -> dict:
    """The parameters an executed notebook ran with: the parameters cell's defaults, overridden by papermill's."""
    import nbformat

    nb = nbformat.read(path, as_version=4)
    values = {}
    for cell in nb.cells:
        if cell.cell_type == "code" and "parameters" in cell.metadata.get("tags", []):
            for node in ast.parse(cell.source).body:
                if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
                    try:
                        values[node.targets[0].id] = ast.literal_eval(node.value)
                    except ValueError:
                        pass
            break
    values.update(nb.metadata.get("papermill", {}).get("parameters", {}))
    return values


def run_heading(parameters: dict) -> str:
    return f"{TITLE_PREFIX}: {parameters.get('model', '?')} on {parameters.get('task', '?')}"


def retitle(path: str | os.PathLike) -> bool:
    """Make an executed notebook's title cell read ``# CEL run: {model} on {task}`` (idempotent).

    Jupyter Book takes a page's title from its first Markdown heading; a heading *displayed* by a code cell is
    not one (myst-nb renders outputs inside the page, and warns), so the runner writes it into the title cell.
    """
    import nbformat

    nb = nbformat.read(path, as_version=4)
    heading = run_heading(notebook_parameters(path))
    for cell in nb.cells:
        if cell.cell_type == "markdown" and cell.source.startswith(TITLE_PREFIX):
            lines = cell.source.split("\n")
            if lines[0] == heading:
                return False
            cell.source = "\n".join([heading] + lines[1:])
            break
    else:
        nb.cells.insert(0, nbformat.v4.new_markdown_cell(heading))
    from cel_utils.artifacts import atomic_write_text

    atomic_write_text(Path(path), nbformat.writes(nb))
    return True


# --- the whole grid ----------------------------------------------------------------------------------------------

@dataclass
class SlurmOptions:
    partition: str | None = None
    timeout_min: int = 12 * 60
    gpus_per_node: int = 1
    cpus_per_task: int = 8
    mem_gb: int = 64
    extra: dict = field(default_factory=dict)  # passed as slurm_additional_parameters


def run_grid(cells: list[Cell], executor: str = "local", *, jobs: int = 1, skip_existing: bool = False,
             slurm: SlurmOptions | None = None, log_dir: str | os.PathLike | None = None, progress: bool = True,
             poll_s: float = 2.0, on_result: Callable[[CellResult], None] | None = None) -> list[CellResult]:
    """Run every cell; a failure is recorded in its result and the others go on. Results are in grid order."""
    from tqdm.auto import tqdm

    if executor not in EXECUTORS:
        raise ValueError(f"unknown executor {executor!r}: choose from {EXECUTORS}")
    if not isinstance(jobs, int) or jobs < 1:
        raise ValueError(f"jobs must be a positive integer, got {jobs!r}")
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
                done(run_cell(cell, skip_existing))
        elif executor == "local":
            _run_pool(cells, jobs, skip_existing, done)
        else:
            _run_submitit(cells, executor, skip_existing, slurm or SlurmOptions(), log_dir, poll_s, done)
    finally:
        bar.close()
    return [results[cell.name] for cell in cells if cell.name in results]


def _run_pool(cells: list[Cell], jobs: int, skip_existing: bool, done: Callable) -> None:
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor, as_completed

    with ProcessPoolExecutor(max_workers=jobs, mp_context=multiprocessing.get_context("spawn")) as pool:
        futures = {pool.submit(run_cell, cell, skip_existing): (cell, _stat(cell.artifact)) for cell in cells}
        for future in as_completed(futures):
            try:
                done(future.result())
            except Exception as error:  # noqa: BLE001 - the worker process died
                cell, before = futures[future]
                done(_failed_result(cell, error, before))


def _run_submitit(cells: list[Cell], executor: str, skip_existing: bool, slurm: SlurmOptions, log_dir, poll_s: float,
                  done: Callable) -> None:
    import submitit

    folder = Path(log_dir or Path(cells[0].results_dir if cells else "results") / "submitit") / "%j"
    cluster = "local" if executor == "submitit-local" else "slurm"
    ex = submitit.AutoExecutor(folder=folder, cluster=cluster)
    params = {"name": "cel", "timeout_min": slurm.timeout_min}
    if cluster == "slurm":
        params.update(gpus_per_node=slurm.gpus_per_node, cpus_per_task=slurm.cpus_per_task, mem_gb=slurm.mem_gb,
                      slurm_additional_parameters=dict(slurm.extra))
        if slurm.partition:
            params["slurm_partition"] = slurm.partition
    ex.update_parameters(**params)
    submitted = {}
    for cell in cells:
        before, started = _stat(cell.artifact), time.perf_counter()
        job = ex.submit(run_cell, cell, skip_existing)
        submitted[job.job_id] = (job, cell, before, started)
    for job in submitit.helpers.as_completed([entry[0] for entry in submitted.values()], poll_frequency=poll_s):
        _, cell, before, started = submitted[job.job_id]
        try:
            done(job.result())
        except Exception as error:  # noqa: BLE001 - the job died outside run_cell
            done(_failed_result(cell, error, before, time.perf_counter() - started))


# --- reporting ---------------------------------------------------------------------------------------------------

def result_line(result: CellResult) -> str:
    if result.status == "failed":
        where = f" (notebook kept in {result.notebook})" if result.notebook else ""
        return f"FAILED  {result.name}: {result.error}{where}"
    from cel_utils.report import rer_text, transition_text

    h = result.holdout or {}
    numbers = (f"{transition_text(h['full_accuracy'], h['ablated_accuracy'], h['gain_points'])}, "
               f"rel. error red. {rer_text(h['relative_error_reduction'])}, heads {h['heads_label']}") if h else ""
    label = "ok     " if result.status == "ok" else "skipped"
    return f"{label} {result.name}{': ' + numbers if numbers else ''} [{result.seconds:.0f} s]"


def summary_text(results: list[CellResult]) -> str:
    counts = {status: sum(r.status == status for r in results) for status in ("ok", "skipped", "failed")}
    lines = [f"CEL grid: {len(results)} cell(s): {counts['ok']} ok, {counts['skipped']} skipped (up to date), "
             f"{counts['failed']} failed"]
    lines += ["  " + result_line(r) for r in results]
    return "\n".join(lines)


def with_overrides(cell: Cell, **parameters) -> Cell:
    """A copy of a cell with some notebook parameters changed (tests use it to make a cell fail)."""
    return replace(cell, parameters={**cell.parameters, **parameters})
