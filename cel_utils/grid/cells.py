"""One cell of a grid: a (model, task, seed) run of a notebook with papermill, and what it leaves behind.

Every cell executes a notebook (``notebooks/cel_run.ipynb``, or the strategies notebook) once and produces two files:

* ``results/<model>__<task>__seed<N>.json``: the run's artifact, written atomically by the notebook;
* ``book/runs/<model>__<task>__seed<N>.ipynb``: the executed notebook, which becomes the run's book page.

papermill writes its output as cells finish, so a cell executes into ``results/.running/`` and its notebook is
moved into ``book/runs/`` only when every notebook cell succeeded. A failed cell is reported and never stops the
others. Its executed notebook goes to ``results/failed/`` for debugging, never into ``book/runs/``, so it cannot
reach the table of contents. A failure before the artifact was written leaves no artifact (and keeps any earlier
successful run of the cell as it was); a failure after it (in a plot or table) moves the fresh artifact to
``results/failed/`` too and drops the cell's earlier page, which no longer matches any artifact.

A cell's notebook parameters are ``model``, ``task``, ``seed``, ``preset`` and ``config`` (every other setting given
explicitly): the notebook turns them into a :class:`cel_utils.config.RunConfig` with
:func:`cel_utils.config.from_notebook`, so the preset is resolved where the notebook runs (a Slurm node, not the
login node that submitted it).
"""
from __future__ import annotations

import os
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Iterable

from cel_utils.config import RunConfig, from_notebook, result_settings
from cel_utils.presets import resolve_preset
from cel_utils.pipeline.schema import RunArtifact

REPO_DIR = Path(__file__).resolve().parents[2]  # the checkout: notebooks/ sits beside the package
DEFAULT_NOTEBOOK = REPO_DIR / "notebooks" / "cel_run.ipynb"
STRATEGIES_NOTEBOOK = REPO_DIR / "notebooks" / "cel_strategies.ipynb"


@dataclass
class Cell:
    """One (model, task, seed) of the grid: the notebook's parameters and where its outputs go."""

    parameters: dict  # model, task, seed, preset, config (see the module docstring)
    runs_dir: str
    results_dir: str  # the artifact's folder
    notebook: str = str(DEFAULT_NOTEBOOK)
    cwd: str | None = None
    kernel_name: str = "python3"
    retitle: bool = True  # give the page the run title (cel_utils.book.titles); off for the strategies pages
    config_class: type = RunConfig
    # Whether the machine the cell runs on has CUDA, when that is another machine (a Slurm job's node, told by the GPUs
    # it asks for); None: this one. The checks here then leave the device to the job, and `auto` presets resolve for it.
    cuda: bool | None = None

    @property
    def name(self) -> str:
        from cel_utils.models.loading import display_name
        from cel_utils.pipeline.artifacts import artifact_name

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

    def config(self, preset: str | None = None) -> RunConfig:
        """The cell's configuration as its notebook will build it, with ``preset`` in place of the requested one."""
        if preset is None and self.parameters["preset"] == "auto" and self.cuda is not None:
            preset = resolve_preset("auto", self.cuda)  # as the job will resolve it where it runs
        parameters = self.parameters if preset is None else {**self.parameters, "preset": preset}
        return from_notebook(parameters, self.config_class, here=self.cuda is None)


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
         config_class: type = RunConfig, cuda: bool | None = None, **settings: Any) -> list[Cell]:
    """The grid's cells, each checked with ``RunConfig.validate()`` before anything runs.

    ``settings`` (any run setting: n_discovery, p, engine, data_dir, device, ...) replace the preset's value for every
    task. The preset is checked here but resolved again where each cell runs. ``cuda``: whether the machine the cells
    run on has CUDA, when that is not this one (:attr:`Cell.cuda`); settings wrong everywhere still fail here.
    """
    results_dir = Path(results_dir).resolve()
    if settings.get("data_dir"):
        settings["data_dir"] = str(Path(settings["data_dir"]).expanduser().resolve())
    cells, seen = [], set()
    for model in models:
        for task in tasks:
            for seed in seeds:
                parameters = {"model": model, "task": task, "seed": seed, "preset": preset,
                              "config": {**settings, "results_dir": str(results_dir)},
                              "progress": "log"}  # lines a terminal or a Slurm log can show (cel_utils.progress)
                cell = Cell(parameters=parameters, runs_dir=str(Path(runs_dir).resolve()),
                            results_dir=str(results_dir / config_class.ARTIFACT_SUBDIR),
                            notebook=str(Path(notebook).resolve()), cwd=str(Path(cwd).resolve()) if cwd else None,
                            config_class=config_class, cuda=cuda)
                try:
                    cell.config()
                except (ValueError, TypeError, PermissionError, FileNotFoundError) as error:
                    raise ValueError(f"grid cell ({model}, {task}, seed {seed}): {error}") from None
                if cell.name in seen:
                    raise ValueError(f"two grid cells write the same files {cell.name!r}: model names must differ")
                seen.add(cell.name)
                cells.append(cell)
    return cells


def with_settings(cell: Cell, **settings: Any) -> Cell:
    """A copy of a cell with some run settings changed."""
    parameters = {**cell.parameters, "config": {**cell.parameters["config"], **settings}}
    return replace(cell, parameters=parameters)


def up_to_date(cell: Cell) -> dict | None:
    """The cell's artifact if it and its page exist, every result-changing setting is what the cell asks for, and the
    weights and the data source are those the artifact's run read (:func:`same_inputs`).

    A preset of ``auto`` is compared as the artifact resolved it (paper or cpu, on the machine that ran it)."""
    from cel_utils.pipeline.artifacts import read_artifact

    if not (cell.artifact.exists() and cell.page.exists()):
        return None
    try:
        artifact = read_artifact(cell.artifact)
    except ValueError:
        return None
    stored = artifact["config"]
    requested = cell.parameters["preset"]
    wanted = cell.config(stored.get("preset") if requested == "auto" else None)
    names = result_settings(type(wanted))
    if not all(name in stored and stored[name] == getattr(wanted, name) for name in names):
        return None
    return artifact if same_inputs(artifact, wanted) else None


def data_source(config: RunConfig) -> str:
    """Where ``config``'s items come from: ``mirror`` (a local mirror: ``data_dir``, else $CEL_DATA_DIR) or ``hub``.
    The two hold different splits (the hub has BoolQ's train split, the mirror not), so they draw different items."""
    from cel_utils.tasks.data import resolve_data_dir

    return "hub" if resolve_data_dir(config.data_dir) is None else "mirror"


def same_inputs(artifact: RunArtifact, config: RunConfig) -> bool:
    """Whether a run of ``config`` now would read what the artifact's run read: the same weights (the part of the
    model's source that names them, :func:`cel_utils.models.loading.weights_source`; loading the model to take its
    fingerprint would cost as much as a short run) and the same kind of data source. The settings are compared apart.

    Items generated because the hub could not be reached (arithmetic) count as the hub's: a rerun offline would
    generate the same ones, and one online reads the hub."""
    from cel_utils.models.loading import weights_source

    splits = artifact["data"].get("splits") or [{"source": None}]
    kinds = {split.get("source") for split in splits}
    wanted = data_source(config)
    if kinds - ({"hub", "generated"} if wanted == "hub" else {"mirror"}):
        return False
    try:
        now = weights_source(config.model, config.revision)
    except (OSError, ValueError):  # cannot be told here: run the cell, which reports the problem itself
        return False
    stored = artifact["model"]["source"] or {}
    return all(stored.get(key) == value for key, value in now.items())


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


def _execute(cell: Cell, stream: bool) -> None:
    """papermill on the cell's notebook, into its staging path; a kernel that fails to start is started again.
    The kernel's traffic is encrypted, and its printed output streams here if ``stream`` (cel_utils.grid.kernel)."""
    import papermill as pm

    from cel_utils.grid.kernel import papermill_options

    for attempt in range(1, KERNEL_START_ATTEMPTS + 1):
        try:
            pm.execute_notebook(cell.notebook, str(cell.staging), parameters=cell.parameters,
                                kernel_name=cell.kernel_name, progress_bar=False, cwd=cell.cwd, **papermill_options(stream))
            return
        except RuntimeError as error:
            if attempt == KERNEL_START_ATTEMPTS or not str(error).startswith(KERNEL_START_ERRORS):
                raise


def _new_result(cell: Cell, **fields: Any) -> CellResult:
    p = cell.parameters
    return CellResult(name=cell.name, model=p["model"], task=p["task"], seed=p["seed"], **fields)


def run_cell(cell: Cell, skip_existing: bool = False, stream: bool = False) -> CellResult:
    """Execute the notebook for one cell; never raises for a failing run (the result says what failed). With ``stream``,
    what the notebook prints (its stages and progress lines) appears on this process's stdout and stderr as it runs."""
    from cel_utils.pipeline.artifacts import read_artifact

    if skip_existing:
        artifact = up_to_date(cell)
        if artifact is not None:
            return _new_result(cell, status="skipped", notebook=str(cell.page), artifact=str(cell.artifact),
                               holdout=artifact.get("holdout"))
    start = time.perf_counter()
    before = _stat(cell.artifact)
    cell.staging.parent.mkdir(parents=True, exist_ok=True)
    cell.staging.unlink(missing_ok=True)
    try:
        _execute(cell, stream)
        if not cell.artifact.exists() or _stat(cell.artifact) == before:
            raise RuntimeError(f"the notebook finished but wrote no new artifact {cell.artifact}")
    except Exception as error:  # noqa: BLE001 - a failed cell is reported, never raised
        return failed_result(cell, error, before, time.perf_counter() - start)
    if cell.retitle:
        from cel_utils.book.titles import retitle

        retitle(cell.staging, cell.name)
    cell.page.parent.mkdir(parents=True, exist_ok=True)
    os.replace(cell.staging, cell.page)
    for stale in (cell.failed_dir / f"{cell.name}.ipynb", cell.failed_dir / f"{cell.name}.json"):
        stale.unlink(missing_ok=True)
    return _new_result(cell, status="ok", notebook=str(cell.page), artifact=str(cell.artifact),
                       holdout=read_artifact(cell.artifact).get("holdout"),  # a strategies summary has none
                       seconds=time.perf_counter() - start)


def failed_result(cell: Cell, error: BaseException, artifact_before, seconds: float = 0.0) -> CellResult:
    """Report a failed cell, and move what it left behind out of the book: its notebook (and a fresh artifact) go to
    ``results/failed/``. Also for a job that died outside :func:`run_cell` (killed, out of memory, cluster error)."""
    result = _new_result(cell, status="failed", seconds=seconds, error=_error_text(error))
    cell.failed_dir.mkdir(parents=True, exist_ok=True)
    if cell.staging.exists():
        os.replace(cell.staging, cell.failed_dir / f"{cell.name}.ipynb")
        result.notebook = str(cell.failed_dir / f"{cell.name}.ipynb")
    if cell.artifact.exists() and _stat(cell.artifact) != artifact_before:
        os.replace(cell.artifact, cell.failed_dir / f"{cell.name}.json")
        cell.page.unlink(missing_ok=True)  # its earlier page matched the artifact just replaced
    return result


def result_line(result: CellResult) -> str:
    if result.status == "failed":
        where = f" (notebook kept in {result.notebook})" if result.notebook else ""
        return f"FAILED  {result.name}: {result.error}{where}"
    from cel_utils.book.text import rer_text, transition_text

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
