"""The per-run notebook: its parameters, one papermill execution on a tiny random model, and bad parameters."""
import json
import math
import os
from pathlib import Path

import nbformat
import papermill as pm
import pytest

from cel_utils.book.titles import TITLE_PREFIX, retitle
from cel_utils.config import NOTEBOOK_PARAMETERS
from cel_utils.pipeline.artifacts import read_artifact

REPO = Path(__file__).resolve().parents[1]
NOTEBOOK = REPO / "notebooks" / "cel_run.ipynb"
MIRROR = Path(os.environ.get("CEL_DATA_DIR") or REPO.parent / "shared" / "data")
DATA_DIR = str(MIRROR) if MIRROR.is_dir() else None  # without a mirror, arithmetic comes from the hub or the generator
SETTINGS = dict(n_discovery=6, n_holdout=8, p=3, k=2, engine="naive", data_dir=DATA_DIR)
TINY = dict(model="random:llama:tiny", task="arithmetic_2da", preset="none", config=SETTINGS)


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
    assert list(inferred) == list(NOTEBOOK_PARAMETERS)  # the declared input, nothing more
    assert {name: json.loads(p["default"]) for name, p in inferred.items()} == NOTEBOOK_PARAMETERS
    first = code_cells(nb)[code_cells(nb).index(tagged[0]) + 1]
    assert "from_notebook(globals())" in first.source
    assert nb.cells[0].cell_type == "markdown" and nb.cells[0].source.startswith(TITLE_PREFIX)


@pytest.fixture(scope="module")
def executed(tmp_path_factory):
    folder = tmp_path_factory.mktemp("notebook")
    output = folder / "run.ipynb"
    pm.execute_notebook(str(NOTEBOOK), str(output),
                        parameters={**TINY, "config": {**SETTINGS, "results_dir": str(folder / "results")}},
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
    assert any("Plotly.newPlot" in o.get("data", {}).get("text/html", "") for o in by_id["stage1-heatmap"].outputs)
    for table in ("pool", "stage2", "holdout", "run"):
        assert any("text/html" in o.get("data", {}) for o in by_id[table].outputs), table
    assert by_id["flips"].outputs  # a table of flipped items, or the note that none flipped
    for figure in ("null-histogram", "stability"):  # is the gain real? (cel_utils.stats.reliability)
        assert any("image/png" in o.get("data", {}) for o in by_id[figure].outputs), figure
    assert any("text/markdown" in o.get("data", {}) for o in by_id["reliability"].outputs)
    null, size = art["reliability"]["null"], len(art["frozen"]["heads"])
    assert null["n_sets"] == min(100, math.comb(12, size) - 1)  # every other set of that size, up to 100
    assert art["reliability"]["stability"]["n_resamples"] == 50


def test_retitle_names_the_run(executed):
    output, _ = executed
    assert retitle(output, "random-llama-tiny__arithmetic_2da__seed0") is True
    nb = nbformat.read(output, as_version=4)
    assert nb.cells[0].source.splitlines()[0] == "# CEL run: random-llama-tiny on arithmetic_2da (seed 0)"
    assert retitle(output, "random-llama-tiny__arithmetic_2da__seed0") is False  # idempotent


@pytest.mark.parametrize("bad, message", [
    ({"config": {**SETTINGS, "p": 2, "k": 3}}, "pool size p=2 is smaller than the budget k=3"),
    ({"config": {**SETTINGS, "engine": "turbo"}}, "unknown engine 'turbo'"),
    ({"task": "arithmetic_9dz"}, "unknown task 'arithmetic_9dz'"),
    ({"config": {**SETTINGS, "n_discovry": 5}}, "unknown run setting(s) ['n_discovry']"),
    ({"dtype": "bfloat16"}, "run setting(s) ['dtype'] given as separate notebook parameters would be ignored"),
])
def test_bad_parameters_fail_in_the_first_cell_and_leave_no_artifact(tmp_path, bad, message):
    output, results = tmp_path / "bad.ipynb", tmp_path / "results"
    parameters = {**TINY, **bad}
    parameters["config"] = {**parameters["config"], "results_dir": str(results)}
    with pytest.raises(pm.PapermillExecutionError) as caught:
        pm.execute_notebook(str(NOTEBOOK), str(output), parameters=parameters,
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


def test_greedy_answers_for_teacher_forced_items(tiny_models, data_dir):
    """Arithmetic is scored teacher forced: the run generates a short answer for the items its page shows."""
    from cel_utils.pipeline.examples import greedy_answers
    from cel_utils.tasks.splits import load_task_data

    lm, data = tiny_models["llama"], load_task_data("arithmetic_2da", 6, 8, data_dir=data_dir)
    answers = greedy_answers(lm, data, [0, 1], (), max_new_tokens=4)
    assert len(answers) == 2 and all(isinstance(a, str) and "\n" not in a for a in answers)
    again = greedy_answers(lm, data, [0, 1], (), max_new_tokens=4)
    assert again == answers  # greedy: deterministic
