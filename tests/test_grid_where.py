"""A grid submitted to Slurm is planned for the machines its jobs run on, not for the node that submits it: with
``--preset auto`` a GPU job gets the GPU (paper) task list and settings, and ``--device cuda`` is accepted on a login
node without a GPU; the job checks the device when it starts. Settings wrong everywhere still fail at once."""
import shutil

import pytest
import torch

from cel_utils import grid, presets
from cel_utils.cli import main

GOOD = "random:llama:tiny"
pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="plays a login node without a GPU")


@pytest.fixture
def submitted(monkeypatch):
    """`cel grid --executor slurm` as far as submitting: sbatch is found, and the cells are kept instead of run."""
    which = shutil.which
    monkeypatch.setattr(shutil, "which", lambda name, *a, **k: "/usr/bin/sbatch" if name == "sbatch"
                        else which(name, *a, **k))
    cells = []
    monkeypatch.setattr(grid, "run_grid", lambda planned, *a, **k: cells.extend(planned) or [])
    return cells


def test_a_slurm_grid_from_a_cpu_node_is_planned_for_its_gpu_jobs(submitted, tmp_path):
    assert main(["grid", "--root", str(tmp_path), "--executor", "slurm", "--models", GOOD, "--device", "cuda"]) == 0
    assert [cell.parameters["task"] for cell in submitted] == list(presets.default_tasks("paper"))
    assert presets.default_tasks("paper") != presets.default_tasks("cpu")  # else this would show nothing
    assert {cell.config().preset for cell in submitted} == {"paper"}  # as each job will resolve `auto` there
    assert all(cell.parameters["preset"] == "auto" for cell in submitted)  # still resolved by the job itself


def test_jobs_without_a_gpu_get_the_cpu_tasks(submitted, tmp_path):
    assert main(["grid", "--root", str(tmp_path), "--executor", "slurm", "--slurm-gpus", "0", "--models", GOOD]) == 0
    assert [cell.parameters["task"] for cell in submitted] == list(presets.default_tasks("cpu"))


@pytest.mark.parametrize("executor, device, error", [
    ("local", "cuda", "device 'cuda' is not available here"),  # the cells run here: checked here
    ("slurm", "gpu0", "unknown device 'gpu0'"),  # wrong on every machine: checked before anything is submitted
])
def test_a_device_wrong_where_the_cells_run_fails_at_once(submitted, tmp_path, capsys, executor, device, error):
    assert main(["grid", "--root", str(tmp_path), "--executor", executor, "--models", GOOD, "--tasks", "boolq",
                 "--preset", "smoke", "--device", device]) == 2
    assert error in capsys.readouterr().err and not submitted


def test_the_job_checks_the_device_when_it_starts(tmp_path):
    """A cell planned for a GPU node that lands on this CPU machine fails in its job, with the device's message."""
    cells = grid.plan([GOOD], ["boolq"], [0], "smoke", runs_dir=tmp_path / "runs", results_dir=tmp_path / "results",
                      cwd=tmp_path, cuda=True, device="cuda")
    (result,) = grid.run_grid(cells, "submitit-local", log_dir=tmp_path / "submitit", progress=False, poll_s=0.5)
    assert result.status == "failed" and "device 'cuda' is not available here" in result.error
