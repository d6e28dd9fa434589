"""The grid runner: presets, planning, and a 2-cell grid through submitit's local executor with one failing cell."""
import json
import os
import re
from dataclasses import asdict
from pathlib import Path

import nbformat
import pytest

from cel_utils import config, grid, presets
from cel_utils.book.build import BookPaths, toc_dict
from cel_utils.cli import main
from cel_utils.grid.executors import prepare_models, start_order

REPO = Path(__file__).resolve().parents[1]
MIRROR = Path(os.environ.get("CEL_DATA_DIR") or REPO.parent / "shared" / "data")
DATA_DIR = str(MIRROR) if MIRROR.is_dir() else None
GOOD, BAD = "random:llama:tiny", "random:nosuch:tiny"  # the second fails when run_cel loads the model


def test_presets_are_partial_configurations_of_known_settings():
    names = set(config.field_names(config.TransferConfig))  # the runs' settings and the transfer step's
    for preset, table in presets.PRESETS.items():
        assert set(table) <= {"*", *presets.TASK_FAMILIES}, preset
        for row in table.values():
            assert set(row) <= names, (preset, row)
    paper = config.RunConfig.from_dict({"task": "boolq", "preset": "paper"})
    assert (paper.n_discovery, paper.n_holdout, paper.p, paper.k, paper.preset) == (None, None, 10, 3, "paper")
    cpu = config.RunConfig.from_dict({"task": "arithmetic_2da", "preset": "cpu", "p": 4})
    assert cpu.n_discovery == presets.preset_values("cpu", "arithmetic_2da")["n_discovery"] and cpu.p == 4  # given wins
    assert presets.preset_values("cpu", "mbpp")["n_discovery"] != presets.PRESETS["cpu"]["*"]["n_discovery"]  # a row adds
    assert presets.resolve_preset("auto") in ("cpu", "paper")
    with pytest.raises(ValueError, match="unknown preset"):
        presets.resolve_preset("huge")
    with pytest.raises(ValueError, match=r"unknown run setting\(s\) \['n_discovry'\]"):
        config.RunConfig.from_dict({"n_discovry": 5})


def test_each_preset_has_default_tasks_one_per_family_that_plan_accepts(tmp_path):
    assert set(config.PRESET_TASKS) == set(presets.PRESETS)
    for name in presets.PRESETS:
        tasks = presets.default_tasks(name)
        assert sorted(map(presets.task_family, tasks)) == sorted(presets.TASK_FAMILIES), name
        cells = grid.plan([GOOD], tasks, [0], name, runs_dir=tmp_path / "runs", results_dir=tmp_path / "results")
        assert [c.parameters["task"] for c in cells] == list(tasks)
    assert presets.default_tasks("cpu")[0] == "arithmetic_1dc" and presets.default_tasks("paper")[0] == "arithmetic"


def test_the_local_pool_starts_the_longest_measured_runs_first(tmp_path):
    """`make book` (two workers): BoolQ and HellaSwag start together and arithmetic, the shortest, starts last, not
    beside BoolQ; cells never measured follow in grid order; results still come back in grid order (test below)."""
    assert {presets.task_family(t) for t in presets.default_tasks("cpu")} <= set(config.RUN_MINUTES["cpu"]["*"])
    paths = dict(runs_dir=tmp_path / "runs", results_dir=tmp_path / "results")
    cpu = grid.plan([GOOD], presets.default_tasks("cpu"), [0], "cpu", **paths)
    smoke = grid.plan([GOOD], ["mbpp", "arithmetic_2da"], [0, 1], "smoke", **paths)
    order = [(c.parameters["preset"], c.parameters["task"], c.parameters["seed"]) for c in start_order(smoke + cpu)]
    assert order == [("cpu", "boolq", 0), ("cpu", "hellaswag", 0), ("cpu", "mbpp", 0), ("cpu", "arithmetic_1dc", 0),
                     ("smoke", "mbpp", 0), ("smoke", "mbpp", 1),
                     ("smoke", "arithmetic_2da", 0), ("smoke", "arithmetic_2da", 1)]


def test_the_local_pool_dequantizes_each_gguf_model_once_before_its_workers_start(tmp_path, monkeypatch):
    """Two cells of one GGUF model: one dequantization, before the workers (which would each make it at once); a spec
    that is not a GGUF file reads nothing, and a missing file is left to fail in its own cell."""
    import shutil

    from cel_utils.models import loading

    made = []
    monkeypatch.setattr(loading, "dequantized_checkpoint", lambda path: made.append(path) or tmp_path)
    model = tmp_path / "m.gguf"
    shutil.copy(loading.embedded_gguf(), model)
    cells = grid.plan([str(model), GOOD], ["boolq", "hellaswag"], [0], "smoke", runs_dir=tmp_path / "runs",
                      results_dir=tmp_path / "results")
    model.rename(tmp_path / "gone.gguf")
    prepare_models(cells)
    assert made == []  # the file is gone: its cells report it
    (tmp_path / "gone.gguf").rename(model)
    prepare_models(cells)
    assert made == [model]


def test_plan_applies_preset_and_overrides_and_validates_first(tmp_path):
    cells = grid.plan([GOOD], ["arithmetic_2da", "boolq"], [0, 1], "cpu", runs_dir=tmp_path / "runs",
                      results_dir=tmp_path / "results", engine="naive", n_holdout=7)
    assert [c.name for c in cells] == ["random-llama-tiny__arithmetic_2da__seed0", "random-llama-tiny__arithmetic_2da__seed1",
                                       "random-llama-tiny__boolq__seed0", "random-llama-tiny__boolq__seed1"]
    first = cells[0].config()
    assert first.n_discovery == presets.preset_values("cpu", "arithmetic_2da")["n_discovery"] and first.n_holdout == 7
    assert first.engine == "naive" and Path(first.results_dir).is_absolute() and first.preset == "cpu"
    assert cells[0].parameters["config"] == {"engine": "naive", "n_holdout": 7, "results_dir": first.results_dir}
    assert cells[0].page == tmp_path / "runs" / "random-llama-tiny__arithmetic_2da__seed0.ipynb"
    with pytest.raises(ValueError, match=r"grid cell \(m, nosuchtask, seed 0\): unknown task"):
        grid.plan(["m"], ["nosuchtask"], [0], "cpu", results_dir=tmp_path / "results")
    with pytest.raises(ValueError, match="pool size p=1 is smaller than the budget k=2"):
        grid.plan(["m"], ["boolq"], [0], "cpu", results_dir=tmp_path / "results", p=1)


@pytest.fixture(scope="module")
def ran_grid(tmp_path_factory):
    root = tmp_path_factory.mktemp("grid")
    (root / "_toc.yml").write_text((REPO / "_toc.yml").read_text())  # the committed toc, whose globs find the runs
    cells = grid.plan([GOOD, BAD], ["arithmetic_2da"], [0], "smoke", runs_dir=root / "book" / "runs",
                      results_dir=root / "results", cwd=root, engine="naive", data_dir=DATA_DIR)
    seen = []
    results = grid.run_grid(cells, "submitit-local", log_dir=root / "submitit", progress=False, poll_s=0.5,
                            on_result=seen.append)
    return root, cells, results, seen


def test_submitit_grid_reports_the_failed_cell_and_finishes_the_other(ran_grid):
    root, cells, results, seen = ran_grid
    assert len(seen) == 2
    by_model = {r.model: r for r in results}
    ok, failed = by_model[GOOD], by_model[BAD]
    assert ok.status == "ok" and ok.holdout["n_items"] == 8
    assert failed.status == "failed" and "ValueError: unknown family 'nosuch'" in failed.error
    summary = grid.summary_text(results)
    assert "1 ok, 0 skipped (up to date), 1 failed" in summary and "FAILED  random-nosuch-tiny" in summary

    runs, results_dir = root / "book" / "runs", root / "results"
    assert sorted(p.name for p in runs.glob("*.ipynb")) == ["random-llama-tiny__arithmetic_2da__seed0.ipynb"]
    assert sorted(p.name for p in results_dir.glob("*.json")) == ["random-llama-tiny__arithmetic_2da__seed0.json"]
    assert (results_dir / "failed" / "random-nosuch-tiny__arithmetic_2da__seed0.ipynb").exists()
    assert not list((results_dir / ".running").glob("*"))
    page = nbformat.read(runs / "random-llama-tiny__arithmetic_2da__seed0.ipynb", as_version=4)
    assert page.cells[0].source.startswith("# CEL run: random-llama-tiny on arithmetic_2da (seed 0)")

    toc = toc_dict(BookPaths(root=root))
    run_part = next(p for p in toc["parts"] if p["caption"] == "Runs")
    assert [c["file"] for c in run_part["chapters"]] == ["book/runs/random-llama-tiny__arithmetic_2da__seed0.ipynb"]


def test_skip_existing_reuses_an_up_to_date_cell(ran_grid):
    root, cells, _, _ = ran_grid
    good = next(c for c in cells if c.parameters["model"] == GOOD)
    assert grid.run_cell(good, skip_existing=True).status == "skipped"
    assert grid.up_to_date(grid.with_settings(good, n_holdout=9)) is None  # other sizes: run again


def test_a_failure_after_the_artifact_was_written_leaves_nothing_in_the_book(tmp_path):
    template = nbformat.read(grid.DEFAULT_NOTEBOOK, as_version=4)
    template.cells.append(nbformat.v4.new_code_cell('raise RuntimeError("the last cell broke")'))
    broken = tmp_path / "broken.ipynb"
    nbformat.write(template, broken)
    (cell,) = grid.plan([GOOD], ["arithmetic_2da"], [0], "smoke", runs_dir=tmp_path / "runs",
                        results_dir=tmp_path / "results", notebook=broken, engine="naive", data_dir=DATA_DIR)
    result = grid.run_cell(cell)
    assert result.status == "failed" and "RuntimeError: the last cell broke" in result.error
    assert not cell.page.exists() and not cell.artifact.exists()
    assert (tmp_path / "results" / "failed" / f"{cell.name}.json").exists()  # kept for debugging, outside the book


def test_a_kernel_that_dies_at_start_up_is_started_again(tmp_path, monkeypatch):
    import papermill as pm

    (cell,) = grid.plan([GOOD], ["arithmetic_2da"], [0], "smoke", runs_dir=tmp_path / "runs",
                        results_dir=tmp_path / "results", engine="naive", data_dir=DATA_DIR)
    real, calls = pm.execute_notebook, []

    def flaky(*args, **kwargs):  # the first start loses a port race, as parallel cells can
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("Kernel died before replying to kernel_info")
        return real(*args, **kwargs)

    monkeypatch.setattr(pm, "execute_notebook", flaky)
    result = grid.run_cell(cell)
    assert result.status == "ok" and len(calls) == 2 and cell.page.exists()

    def dead(*args, **kwargs):
        calls.append(1)
        raise RuntimeError("Kernel died before replying to kernel_info")

    calls.clear()
    monkeypatch.setattr(pm, "execute_notebook", dead)
    result = grid.run_cell(cell)
    assert result.status == "failed" and "Kernel died" in result.error and len(calls) == grid.KERNEL_START_ATTEMPTS

    def broken(*args, **kwargs):  # a failure of the run itself is not retried
        calls.append(1)
        raise RuntimeError("the run broke")

    calls.clear()
    monkeypatch.setattr(pm, "execute_notebook", broken)
    assert "the run broke" in grid.run_cell(cell).error and len(calls) == 1


def test_a_local_grid_shows_what_each_run_prints_under_its_bar(tmp_path, capfd):
    probe = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(
        "import sys\nprint('[cel] probe: stage 1: 3/9 evals', file=sys.stderr, flush=True)")])
    probe.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    nbformat.write(probe, tmp_path / "probe.ipynb")
    cells = grid.plan([GOOD], ["arithmetic_2da"], [0], "smoke", runs_dir=tmp_path / "runs",
                      results_dir=tmp_path / "results", notebook=tmp_path / "probe.ipynb", data_dir=DATA_DIR)
    for progress in (True, False):
        (result,) = grid.run_grid(cells, "local", progress=progress)
        assert result.status == "failed" and "wrote no new artifact" in result.error  # the probe only prints
        err = capfd.readouterr().err
        # on its own line, not written onto the grid bar's line (tqdm clears the bar with a carriage return)
        shown = [line for line in re.split(r"[\r\n]", err) if line.startswith("[cel] probe")]
        assert shown == (["[cel] probe: stage 1: 3/9 evals"] if progress else []), err


def test_cli_exit_codes_and_cells_at_once_with_the_same_numbers_as_submitit(ran_grid, tmp_path, capsys):
    """Exit 2 when nothing can run, 1 when a cell failed. `make book` runs two cells at a time (--jobs 2): the
    failing cell is reported, the other's artifact is the one the submitit grid wrote (only where it was written
    differs), and the summary lists the cells in grid order."""
    _, _, submitted, _ = ran_grid
    common = ["--root", str(tmp_path), "--tasks", "arithmetic_2da", "--preset", "smoke", "--engine", "naive"]
    common += ["--data-dir", DATA_DIR] if DATA_DIR else []
    assert main(["grid", "--models", "m", "--tasks", "nosuchtask", "--root", str(tmp_path)]) == 2  # nothing runs
    assert "unknown task" in capsys.readouterr().err
    assert main(["grid", "--models", GOOD, BAD, "--jobs", "2", *common]) == 1
    out = capsys.readouterr().out
    summary = out[out.index("1 ok, 0 skipped (up to date), 1 failed"):]
    assert summary.index("random-llama-tiny__") < summary.index("FAILED  random-nosuch-tiny__")
    (written,) = (tmp_path / "results").glob("*.json")
    here = json.loads(written.read_text())
    there = json.loads(Path(next(r for r in submitted if r.model == GOOD).artifact).read_text())
    for artifact in (here, there):
        del artifact["config"]["results_dir"]
    assert here == there


def test_cell_is_picklable_for_submitit():
    import pickle

    (cell,) = grid.plan([GOOD], ["boolq"], [0], "smoke", results_dir="/tmp")
    assert pickle.loads(pickle.dumps(cell)).parameters == cell.parameters
    assert json.dumps(asdict(grid.CellResult("n", "m", "t", 0, "ok")))


def test_local_workers_each_get_their_own_gpu(monkeypatch):
    import queue

    import torch

    from cel_utils.grid import executors

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3,5")
    assert executors.visible_gpus() == ["3", "5"]  # what the machine's own setting allows
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    assert executors.visible_gpus() == ["0", "1"]
    handed = queue.Queue()
    handed.put("1")
    executors.claim_gpu(handed)  # what a worker process does first
    assert os.environ["CUDA_VISIBLE_DEVICES"] == "1"
