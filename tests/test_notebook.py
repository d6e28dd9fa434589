"""The per-run notebook: its parameters, one papermill execution on a tiny random model, and bad parameters."""
import json
import math
import os
from pathlib import Path

import nbformat
import papermill as pm
import pytest

from cel_utils import grid
from cel_utils.artifacts import read_artifact

REPO = Path(__file__).resolve().parents[1]
NOTEBOOK = REPO / "notebooks" / "cel_run.ipynb"
MIRROR = Path(os.environ.get("CEL_DATA_DIR") or REPO.parent / "shared" / "data")
DATA_DIR = str(MIRROR) if MIRROR.is_dir() else None  # without a mirror, arithmetic comes from the hub or the generator
PARAMETERS = ["model", "task", "n_discovery", "n_holdout", "p", "k", "seed", "fmt", "num_fewshot", "data_dir",
              "results_dir", "batch_size", "device", "engine", "max_new_tokens", "n_random_sets", "n_resamples", "resample"]
TINY = dict(model="random:llama:tiny", task="arithmetic_2da", n_discovery=6, n_holdout=8, p=3, k=2, engine="naive",
            data_dir=DATA_DIR)


def code_cells(nb):
    return [c for c in nb.cells if c.cell_type == "code"]


def test_template_is_stored_without_outputs_and_has_one_parameters_cell():
    nb = nbformat.read(NOTEBOOK, as_version=4)
    nbformat.validate(nb)
    assert nb.metadata.kernelspec.name == "python3"
    assert all(not c.outputs and c.execution_count is None for c in code_cells(nb))
    tagged = [c for c in nb.cells if "parameters" in c.metadata.get("tags", [])]
    assert len(tagged) == 1 and tagged[0].cell_type == "code"
    inferred = pm.inspect_notebook(str(NOTEBOOK))  # what papermill sees (a '=' in a comment hides a parameter)
    assert sorted(inferred) == sorted(PARAMETERS)
    assert json.loads(inferred["engine"]["default"]) == "fast"
    first = code_cells(nb)[code_cells(nb).index(tagged[0]) + 1]
    assert ".validate()" in first.source and "RunConfig(" in first.source
    assert nb.cells[0].cell_type == "markdown" and nb.cells[0].source.startswith(grid.TITLE_PREFIX)


@pytest.fixture(scope="module")
def executed(tmp_path_factory):
    folder = tmp_path_factory.mktemp("notebook")
    output = folder / "run.ipynb"
    pm.execute_notebook(str(NOTEBOOK), str(output), parameters={**TINY, "results_dir": str(folder / "results")},
                        kernel_name="python3", progress_bar=False, cwd=str(folder))
    return output, folder / "results"


def test_notebook_executes_and_writes_an_artifact(executed):
    output, results = executed
    artifacts = sorted(results.glob("*.json"))
    assert [a.name for a in artifacts] == ["random-llama-tiny__arithmetic_2da__seed0.json"]
    art = read_artifact(artifacts[0])
    assert art["config"]["engine"] == "naive" and art["holdout"]["n_items"] == 8
    assert len(art["stage1"]) == 12 and len(art["pool"]) == 3  # 3 layers x 4 heads

    nb = nbformat.read(output, as_version=4)
    by_id = {c.get("id"): c for c in nb.cells}
    assert not any(o.output_type == "error" for c in code_cells(nb) for o in c.outputs)
    assert any("image/png" in o.get("data", {}) for o in by_id["stage1-heatmap"].outputs)
    for table in ("pool", "stage2", "holdout", "run"):
        assert any("text/html" in o.get("data", {}) for o in by_id[table].outputs), table
    assert by_id["flips"].outputs  # a table of flipped items, or the note that none flipped
    for figure in ("null-histogram", "stability"):  # is the gain real? (cel_utils.reliability)
        assert any("image/png" in o.get("data", {}) for o in by_id[figure].outputs), figure
    assert any("text/markdown" in o.get("data", {}) for o in by_id["reliability"].outputs)
    null, size = art["reliability"]["null"], len(art["frozen"]["heads"])
    assert null["n_sets"] == min(100, math.comb(12, size) - 1)  # every other set of that size, up to 100
    assert art["reliability"]["stability"]["n_resamples"] == 50


def test_retitle_names_the_run(executed):
    output, _ = executed
    assert grid.retitle(output) is True
    nb = nbformat.read(output, as_version=4)
    assert nb.cells[0].source.splitlines()[0] == "# CEL run: random:llama:tiny on arithmetic_2da"
    assert grid.retitle(output) is False  # idempotent
    assert grid.notebook_parameters(output)["n_holdout"] == 8


@pytest.mark.parametrize("bad, message", [
    ({"p": 2, "k": 3}, "pool size p=2 is smaller than the budget k=3"),
    ({"engine": "turbo"}, "unknown engine 'turbo'"),
    ({"task": "arithmetic_9dz"}, "unknown task 'arithmetic_9dz'"),
])
def test_bad_parameters_fail_in_the_first_cell_and_leave_no_artifact(tmp_path, bad, message):
    output, results = tmp_path / "bad.ipynb", tmp_path / "results"
    with pytest.raises(pm.PapermillExecutionError) as caught:
        pm.execute_notebook(str(NOTEBOOK), str(output), parameters={**TINY, **bad, "results_dir": str(results)},
                            kernel_name="python3", progress_bar=False, cwd=str(tmp_path))
    assert caught.value.ename == "ValueError" and message in caught.value.evalue
    nb = nbformat.read(output, as_version=4)
    cells = code_cells(nb)
    failed = [c for c in cells if any(o.output_type == "error" for o in c.outputs)]
    assert [c.get("id") for c in failed] == ["validate"]
    # the first code cell after the parameters (and papermill's injected parameters) is the one that failed
    after = [c for c in cells if not {"parameters", "injected-parameters"} & set(c.metadata.get("tags", []))]
    assert after[0].get("id") == "validate"
    assert all(c.execution_count is None for c in after[1:])  # nothing after it ran
    assert not (results.exists() and list(results.glob("*.json")))


def test_greedy_answers_for_teacher_forced_items(tmp_path):
    """Arithmetic stores no generated text: the run page generates a short answer for the items it shows."""
    from cel_utils.protocol import RunConfig, run_cel
    from cel_utils.report import greedy_answers

    run = run_cel(RunConfig(**{**TINY, "results_dir": str(tmp_path)}), progress=False)
    answers = greedy_answers(run, [0, 1], (), max_new_tokens=4)
    assert len(answers) == 2 and all(isinstance(a, str) and "\n" not in a for a in answers)
    again = greedy_answers(run, [0, 1], (), max_new_tokens=4)
    assert again == answers  # greedy: deterministic
