"""`cel grid --executor slurm` on a real Slurm: a one-node cluster on this machine (scripts/slurm-cluster.sh, which
needs root; the tests skip with its reason elsewhere, and fail in CI): a 2-cell job array with a cap of 1, then one of its cells again,
preempted mid-run (submitit's USR2: the job requeues itself), cancelled with scancel in the requeued run, and
submitted again: it ends with the artifact of the uninterrupted run, and no finished evaluation is computed twice.

The cells run a tiny random model with small sizes; the submitting process and the jobs share this machine, its
filesystem and the environment that sbatch exports (SLURM_CONF, CEL_CACHE_DIR, CEL_DATA_DIR)."""
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from cel_utils.cli import main
from cel_utils.grid.slurm import job_name
from test_resume import _cache, _identity, _records  # a fresh store per run; each record's identity

pytestmark = pytest.mark.slurm

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "scripts" / "slurm-cluster.sh"
SKIP = 77  # the script's "cannot run here"
CELLS = ("random-llama-tiny__arithmetic_2da__seed0", "random-llama-tiny__hellaswag__seed0")
HELLASWAG = CELLS[1]  # ~20 s of evaluations, ~90 store records: long enough to interrupt
SIZES = ["--n-discovery", "16", "--n-holdout", "24", "--p", "4", "--k", "3", "--batch-size", "2",
         "--n-random-sets", "2", "--n-resamples", "2"]
JOB = ["--executor", "slurm", "--slurm-gpus", "0", "--slurm-cpus", "1", "--slurm-mem-gb", "2", "--slurm-time-min", "20"]
PREEMPT_AT, CANCEL_AT = 10, 30  # store records written when the job is interrupted (of ~90)


def _grid_args(root: Path, tasks: list[str]) -> list[str]:
    return ["grid", "--models", "random:llama:tiny", "--tasks", *tasks, "--preset", "auto", *SIZES, "--root",
            str(root), *JOB]


def _script(command: str) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(SCRIPT), command], capture_output=True, text=True, timeout=900)


def in_ci() -> bool:
    """CI (CI=true, as GitHub Actions and most services set it) runs as root on a fresh machine, where the cluster can
    always be started: there, a cluster that does not start is a failure, not a reason to skip."""
    return os.environ.get("CI", "").strip().lower() in ("true", "1", "yes")


def cannot_run(reason: str) -> None:
    """Skip with ``reason`` outside CI; fail in CI, where skipping would hide that the Slurm path went untested."""
    if in_ci():
        pytest.fail(f"CI is set, so the real-Slurm tests must run, but their cluster could not be set up: {reason}. "
                    "Fix the setup (scripts/slurm-cluster.sh start, as root), or deselect them with -m 'not slurm'",
                    pytrace=False)
    pytest.skip(reason)


def start_cluster() -> bool:
    """Start the one-node cluster (skip or, in CI, fail when it cannot be); returns whether it was running before."""
    if sys.platform != "linux":
        cannot_run("the test cluster is Linux-only")
    was_running = _script("status").returncode == 0
    started = _script("start")
    output = (started.stdout + started.stderr).strip()
    if started.returncode == SKIP:
        cannot_run((output.splitlines() or ["scripts/slurm-cluster.sh start: cannot run here"])[-1])
    assert started.returncode == 0, output
    return was_running


@pytest.fixture(scope="module")
def cluster():
    """The one-node cluster, started for these tests (and stopped after them) unless it was running already."""
    was_running = start_cluster()
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("SLURM_CONF", _script("env").stdout.strip().removeprefix("export SLURM_CONF="))
        yield
    if not was_running:
        _script("stop")


def _sacct(job_id: str) -> list[dict]:
    """The job's (or array's) accounting once it ended: its result file comes a moment before the job exits."""
    keys = ("id", "name", "state", "start", "end")
    for _ in range(60):
        out = subprocess.run(["sacct", "-n", "-P", "-X", "-j", job_id, "-o", "JobID,JobName,State,Start,End"],
                             capture_output=True, text=True, check=True).stdout
        tasks = [dict(zip(keys, line.split("|"))) for line in out.splitlines() if line]
        if tasks and all(t["state"] not in ("PENDING", "RUNNING", "COMPLETING") for t in tasks):
            break
        time.sleep(0.5)
    return tasks


@pytest.fixture(scope="module")
def ran(cluster, tmp_path_factory):
    """The 2-cell grid as one job array running one cell at a time, submitted by a process that sees CUDA: `auto`
    must still resolve where each job runs (no CUDA there: `cpu`)."""
    root = tmp_path_factory.mktemp("slurm-grid")
    args = _grid_args(root, ["arithmetic_2da", "hellaswag"]) + [
        "--slurm-array", "1", "--slurm-setup", "echo cel-setup-line-ran"]
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(torch.cuda, "is_available", lambda: True)
        started = time.perf_counter()
        status = main(args)
    seconds = time.perf_counter() - started
    expected = (root / "results" / f"{HELLASWAG}.json").read_bytes() if status == 0 else None
    return SimpleNamespace(root=root, args=args, status=status, seconds=seconds, expected=expected)


def test_a_grid_runs_as_a_capped_job_array(ran, capsys):
    assert ran.status == 0
    results = ran.root / "results"
    for name in CELLS:
        artifact = json.loads((results / f"{name}.json").read_text())
        assert artifact["config"]["preset"] == "cpu", "auto was resolved where the grid was submitted"
        assert artifact["holdout"]["n_items"] == 24
        assert (ran.root / "book" / "runs" / f"{name}.ipynb").exists()
    assert not list((results / ".running").glob("*")) and not (results / "failed").exists()

    (submission,) = (results / "submitit").glob("*/*_submission.sh")
    script = submission.read_text()
    for line in ("--array=0-1%1", "--job-name=cel-grid", "--requeue", "--export=ALL", "--cpus-per-task=1", "--mem=2GB", "--time=20",
                 "echo cel-setup-line-ran"):
        assert line in script, line
    tasks = _sacct(submission.name.split("_")[0])
    assert [(t["name"], t["state"]) for t in tasks] == [("cel-grid", "COMPLETED")] * 2, tasks
    assert tasks[1]["start"] >= tasks[0]["end"], f"the cap of 1 let both cells run at once: {tasks}"
    for index, name in enumerate(CELLS):  # each task's log: setup line, its cell, its result; no kernel warning
        log = next((results / "submitit").glob(f"*_{index}/*_{index}_0_log.out")).read_text()
        assert "cel-setup-line-ran" in log and f"cel: cell {name} on " in log and f"ok      {name}" in log, log
        assert "Kernel is running over TCP without encryption" not in log, log

    capsys.readouterr()
    jobs_before = sorted((results / "submitit").iterdir())
    assert main(ran.args + ["--skip-existing"]) == 0
    assert "2 skipped (up to date)" in capsys.readouterr().out
    assert sorted((results / "submitit").iterdir()) == jobs_before, "an up-to-date cell was submitted"
    with capsys.disabled():
        print(f"\n2-cell job array on Slurm: {ran.seconds:.0f} s; tasks {tasks}")


def _start_cell(root: Path, cache: Path) -> subprocess.Popen:
    env = {**os.environ, "CEL_CACHE_DIR": str(cache)}
    return subprocess.Popen([sys.executable, "-m", "cel_utils", *_grid_args(root, ["hellaswag"])], cwd=REPO, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _interrupt(grid: subprocess.Popen, cache: Path, records: int, *scancel: str) -> dict:
    """Once the store holds ``records`` records, ``scancel`` the cell's job (found by its name); each record's
    identity then."""
    deadline = time.monotonic() + 300
    while len(_records(cache)) < records:
        assert grid.poll() is None and time.monotonic() < deadline, "the run ended before it could be interrupted"
        time.sleep(0.05)
    subprocess.run(["scancel", *scancel, "--name", job_name(HELLASWAG)], check=True)
    return _identity(cache)


def _kept(before: dict, cache: Path) -> None:
    now = _identity(cache)
    assert all(now[name] == ident for name, ident in before.items()), "a stored evaluation was computed again"


def test_a_preempted_then_cancelled_job_resumes_to_the_same_artifact(ran, tmp_path):
    """USR2 (what Slurm sends before preemption or the time limit) mid-run: the job requeues itself and resumes;
    scancel mid-way through the resumed run: the grid reports the cell cancelled, nothing half-done reaches the book,
    and submitting it again ends with the artifact of the uninterrupted run, no stored evaluation computed twice."""
    root, expected = ran.root, ran.expected
    assert expected is not None, "the job array failed"
    artifact, page = root / "results" / f"{HELLASWAG}.json", root / "book" / "runs" / f"{HELLASWAG}.ipynb"
    artifact.unlink()
    page.unlink()
    cache = _cache(tmp_path, "interrupted")  # a fresh store: the run computes everything again

    grid = _start_cell(root, cache)
    preempted = _interrupt(grid, cache, PREEMPT_AT, "--signal=USR2")
    cancelled = _interrupt(grid, cache, CANCEL_AT)  # in the requeued run
    output, _ = grid.communicate(timeout=300)
    assert grid.returncode == 1, output
    assert f"FAILED  {HELLASWAG}: RuntimeError: job" in output and "ended with state CANCELLED" in output, output
    assert not artifact.exists() and not page.exists()  # nothing half-done in the book
    assert (root / "results" / "failed" / f"{HELLASWAG}.ipynb").exists()
    _kept(preempted, cache)
    logs = [path.read_text() for path in (root / "results" / "submitit").glob("*/*_0_log.out")]
    (log,) = [text for text in logs if "interrupted (preemption or time limit): requeued" in text]
    assert log.count(f"cel: cell {HELLASWAG} on ") == 2, log  # the first start and the requeued one
    assert "this job is preempted" in log, log  # submitit: signalled well before the time limit
    assert "stopped by SIGTERM (cancelled or preempted)" in log, log

    again = _start_cell(root, cache)
    output, _ = again.communicate(timeout=300)
    assert again.returncode == 0, output
    assert artifact.read_bytes() == expected and page.exists()
    assert not (root / "results" / "failed" / f"{HELLASWAG}.ipynb").exists()
    _kept(cancelled, cache)
    print(f"\nrequeued (USR2) after {len(preempted)} stored evaluations, cancelled after {len(cancelled)}, "
          f"submitted again: {len(_identity(cache))} in all, the same artifact bytes")
