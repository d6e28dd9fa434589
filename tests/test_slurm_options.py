"""The Slurm executor without a cluster: flags -> options -> submitit parameters, bad flags refused with exit 2
before anything runs, the job callable requeues itself, and the notebook kernel's options (encrypted traffic, no
TCP warning; output streamed into a job's log). tests/test_slurm.py runs all of it on a real Slurm."""
import pickle
import re
import shutil
import sys
from pathlib import Path

import nbformat
import pytest
import submitit

from cel_utils import grid
from cel_utils.cli import main
from cel_utils.grid import jobs, kernel
from cel_utils.grid.slurm import SlurmOptions, job_name, parse_extra, submitit_parameters

TCP_WARNING = "Kernel is running over TCP without encryption"


def _fake_slurm(bin_dir: Path, monkeypatch, sbatch: str = "#!/bin/sh\nexit 0\n") -> None:
    """Stand-ins for Slurm's commands, first on PATH: submitit's Slurm executor refuses to start without ``srun``."""
    bin_dir.mkdir(exist_ok=True)
    for name, text in (("srun", "#!/bin/sh\nexit 0\n"), ("sbatch", sbatch)):
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}:{Path(sys.executable).parent}:/usr/bin:/bin")


def test_options_become_submitit_parameters(tmp_path, monkeypatch):
    options = SlurmOptions(partition="gpu", account="lab", qos="high", constraint="a100|h100", gpus_per_node=2,
                           cpus_per_task=0, mem_gb=0, timeout_min=90, setup=["module load cuda/12.1"],
                           array_parallelism=4, extra={"reservation": "week"})
    assert submitit_parameters(options.validate(), "slurm") == {
        "timeout_min": 90, "stderr_to_stdout": True, "gpus_per_node": 2, "slurm_partition": "gpu",
        "slurm_account": "lab", "slurm_qos": "high", "slurm_constraint": "a100|h100",
        "slurm_setup": ["module load cuda/12.1"], "slurm_array_parallelism": 4,
        "slurm_additional_parameters": {"requeue": True, "export": "ALL", "reservation": "week"}}  # 0 CPUs, 0 GB: cluster defaults
    assert submitit_parameters(options, "local") == {"timeout_min": 90, "stderr_to_stdout": True}
    # submitit accepts every one of them and writes the sbatch lines a cluster needs
    _fake_slurm(tmp_path / "bin", monkeypatch)
    executor = submitit.AutoExecutor(folder="/tmp/cel-never-written", cluster="slurm")
    executor.update_parameters(**submitit_parameters(options, "slurm"), name="cel-x")
    script = executor._executor._make_submission_file_text("python -c pass", "uid")
    for line in ("--account=lab", "--qos=high", "--constraint='a100|h100'", "--gpus-per-node=2", "--time=90",
                 "--reservation=week", "--requeue", "--export=ALL", "--signal=USR2@90", "--job-name=cel-x", "module load cuda/12.1"):
        assert line in script, line
    assert "--mem" not in script and "--cpus-per-task" not in script


def test_job_names_and_extra_options():
    assert job_name("random-llama-tiny__boolq__seed3") == "cel-random-llama-tiny-boolq-s3"
    assert parse_extra(["reservation=week", "--mail-type=END"]) == {"reservation": "week", "mail-type": "END"}
    with pytest.raises(ValueError, match=r"--slurm-extra 'reservation': expected KEY=VALUE"):
        parse_extra(["reservation"])


@pytest.mark.parametrize("options, message", [
    (SlurmOptions(gpus_per_node=-1), r"gpus_per_node \(--slurm-gpus\) must be a whole number >= 0"),
    (SlurmOptions(timeout_min=0), r"timeout_min \(--slurm-time-min\) must be a whole number >= 1, got 0"),
    (SlurmOptions(array_parallelism=0), r"array_parallelism \(--slurm-array\) must be a whole number >= 1"),
    (SlurmOptions(setup=["module load a\nrm -rf b"]), r"setup line \(--slurm-setup\) must be one non-empty"),
    (SlurmOptions(extra={"--time": "5"}), r"give the option's long name without dashes"),
])
def test_bad_options_are_refused(options, message):
    with pytest.raises(ValueError, match=message):
        options.validate()


@pytest.fixture
def fake_sbatch(tmp_path, monkeypatch):
    """An sbatch on PATH that must never be called: bad flags are refused before anything is submitted."""
    _fake_slurm(tmp_path / "bin", monkeypatch, sbatch="#!/bin/sh\necho called >> \"$0.calls\"; exit 1\n")
    return tmp_path / "bin" / "sbatch.calls"


GRID = ["grid", "--models", "random:llama:tiny", "--tasks", "boolq", "--preset", "smoke"]


@pytest.mark.parametrize("flags, message", [
    (["--slurm-account", "lab"], r"--slurm-account only apply to --executor slurm \(this run: --executor local\)"),
    (["--executor", "submitit-local", "--slurm-gpus", "0"], r"--slurm-gpus only apply to --executor slurm"),
    (["--executor", "slurm", "--jobs", "4"], r"--jobs is for --executor local; with --executor slurm every cell is"),
    (["--submitit-dir", "x"], r"--submitit-dir is for --executor submitit-local or slurm"),
    (["--executor", "slurm", "--slurm-time-min", "0"], r"timeout_min \(--slurm-time-min\) must be a whole number"),
    (["--executor", "slurm", "--slurm-array", "-2"], r"array_parallelism \(--slurm-array\) must be"),
    (["--executor", "slurm", "--slurm-extra", "reservation"], r"--slurm-extra 'reservation': expected KEY=VALUE"),
])
def test_bad_execution_flags_exit_2_before_anything_runs(flags, message, fake_sbatch, tmp_path, capsys):
    assert main(GRID + ["--root", str(tmp_path)] + flags) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and re.search(message, err), err
    assert not fake_sbatch.exists() and not (tmp_path / "results").exists()


def test_slurm_without_sbatch_says_where_to_run(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("PATH", str(Path(sys.executable).parent))
    assert shutil.which("sbatch") is None
    assert main(GRID + ["--root", str(tmp_path), "--executor", "slurm"]) == 2
    assert "sbatch, which is not on PATH: run on a Slurm login node" in capsys.readouterr().err


def test_a_refused_submission_fails_its_cells_with_sbatch_s_message(tmp_path, monkeypatch):
    _fake_slurm(tmp_path / "bin", monkeypatch, sbatch="#!/bin/sh\necho 'sbatch: error: Invalid account or "
                                                        "account/partition combination specified' >&2; exit 1\n")
    cells = grid.plan(["random:llama:tiny"], ["boolq", "hellaswag"], [0], "smoke", runs_dir=tmp_path / "runs",
                      results_dir=tmp_path / "results")
    for options in (SlurmOptions(), SlurmOptions(array_parallelism=1)):
        results = grid.run_grid(cells, "slurm", slurm=options, progress=False)
        assert [r.status for r in results] == ["failed", "failed"]
        assert all(r.error == "RuntimeError: submission refused: sbatch: error: Invalid account or account/partition "
                              "combination specified" for r in results), results


def test_the_job_requeues_itself_with_its_cell(tmp_path):
    (cell,) = grid.plan(["random:llama:tiny"], ["boolq"], [0], "smoke", results_dir=tmp_path / "results")
    job = jobs.CellJob(cell, skip_existing=True)
    assert isinstance(job, submitit.helpers.Checkpointable)
    delayed = job.checkpoint()  # what submitit pickles and runs again after a requeue
    assert delayed.function is job and delayed.args == () and delayed.kwargs == {}
    again = pickle.loads(pickle.dumps(delayed.function))
    assert again.cell.parameters == cell.parameters and again.skip_existing is True


def _notebook(path: Path) -> Path:
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(
        "import sys\nprint('stage discovery 3/9', flush=True)\nprint('stage note', file=sys.stderr, flush=True)")])
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    nbformat.write(nb, path)
    return path


def test_the_kernel_runs_encrypted_without_the_tcp_warning(tmp_path, capfd):
    import papermill as pm

    source = _notebook(tmp_path / "in.ipynb")
    pm.execute_notebook(str(source), str(tmp_path / "plain.ipynb"), progress_bar=False)
    if TCP_WARNING not in capfd.readouterr().err:
        pytest.skip("this ipykernel does not warn about unencrypted TCP")
    options = kernel.papermill_options()
    assert "config" in options, "jupyter_client/libzmq here cannot encrypt the kernel's traffic"
    pm.execute_notebook(str(source), str(tmp_path / "encrypted.ipynb"), progress_bar=False, **options)
    captured = capfd.readouterr()
    assert TCP_WARNING not in captured.err and "stage discovery" not in captured.out  # not streamed: no job


def test_in_a_job_the_notebook_output_streams_to_the_log(tmp_path, capfd):
    import papermill as pm

    source = _notebook(tmp_path / "in.ipynb")
    options = kernel.papermill_options(stream=True)  # what every job asks for (cel_utils.grid.jobs)
    pm.execute_notebook(str(source), str(tmp_path / "out.ipynb"), progress_bar=False, **options)
    captured = capfd.readouterr()
    assert "stage discovery 3/9" in captured.out and "stage note" in captured.err


@pytest.mark.parametrize("ci", [None, "true"])
def test_the_real_slurm_tests_skip_outside_ci_and_fail_in_it_when_the_cluster_cannot_start(monkeypatch, ci):
    import subprocess

    import test_slurm

    if ci is None:
        monkeypatch.delenv("CI", raising=False)
    else:
        monkeypatch.setenv("CI", ci)
    said = "slurm-cluster: SKIP: slurmctld failed to start; see /var/tmp/cel-slurm/log/slurmctld.log"
    answers = {"status": subprocess.CompletedProcess([], 1, "slurm-cluster: not running\n", ""),
               "start": subprocess.CompletedProcess([], test_slurm.SKIP, said + "\n", "")}
    monkeypatch.setattr(test_slurm, "_script", lambda command: answers[command])
    monkeypatch.setattr(sys, "platform", "linux")
    outcome = pytest.fail.Exception if ci else pytest.skip.Exception
    with pytest.raises(outcome, match="slurmctld failed to start") as raised:
        test_slurm.start_cluster()
    if ci:
        assert "CI is set, so the real-Slurm tests must run" in str(raised.value)
