"""A run killed with SIGKILL at seeded random moments and restarted each time resumes where it stopped and
ends with the same artifact bytes (and the same store records) as a run that was never interrupted."""
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

from cel_utils.paths import cache_dir

REPO = Path(__file__).resolve().parents[1]
CHILD = REPO / "tests" / "resume_child.py"  # a small run_cel on a tiny random model (hellaswag, 12 + 10 items)
ARTIFACT = "random-llama-tiny__hellaswag__seed0.json"
WRITE_DELAY_S = 0.15  # per store write, so that the kills land inside the evaluations, not after them
N_KILLS = 5


def _cache(tmp_path: Path, name: str) -> Path:
    """A fresh $CEL_CACHE_DIR whose models/ is the user's, so the tokenizer checkpoint is not rebuilt per run."""
    cache = tmp_path / name
    cache.mkdir()
    models = cache_dir() / "models"
    models.mkdir(parents=True, exist_ok=True)
    (cache / "models").symlink_to(models, target_is_directory=True)
    return cache


def _start(results: Path, cache: Path, data_dir: str) -> subprocess.Popen:
    env = {**os.environ, "CEL_CACHE_DIR": str(cache), "PYTHONWARNINGS": "ignore"}
    return subprocess.Popen([sys.executable, str(CHILD), str(results), data_dir, str(WRITE_DELAY_S)], cwd=REPO,
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _finish(child: subprocess.Popen) -> None:
    output, _ = child.communicate(timeout=900)
    assert child.returncode == 0, output[-3000:]


def _records(cache: Path) -> list[Path]:
    return sorted((cache / "evals").rglob("*.rec"))


def _identity(cache: Path) -> dict[str, tuple]:
    """Each record's inode and mtime: a record written again (recomputed) gets new ones."""
    return {str(p.relative_to(cache)): (p.stat().st_ino, p.stat().st_mtime_ns) for p in _records(cache)}


def test_killed_runs_resume_to_the_same_artifact(tmp_path, data_dir, tokenizer):  # tokenizer: models/ is filled
    results = tmp_path / "results"  # the same path for both runs: results_dir is part of the artifact's config
    reference = _cache(tmp_path, "reference")
    _finish(_start(results, reference, data_dir))
    expected = (results / ARTIFACT).read_bytes()
    expected_records = {str(p.relative_to(reference)): p.read_bytes() for p in _records(reference)}
    shutil.rmtree(results)

    cache = _cache(tmp_path, "resumed")
    rng = random.Random(2024)
    # Kill once this many records exist; the first kill lands at a random moment of start-up (0 records).
    targets = [0] + sorted(rng.sample(range(1, len(expected_records)), N_KILLS - 1))
    seen, kills = {}, []
    for target in targets:
        child = _start(results, cache, data_dir)
        if target == 0:
            time.sleep(rng.uniform(0.5, 4.0))
        while len(_records(cache)) < target and child.poll() is None:
            time.sleep(0.005)
        assert child.poll() is None, "the run ended before it could be killed"
        time.sleep(rng.uniform(0.0, WRITE_DELAY_S))  # anywhere between two writes, a write included
        child.send_signal(signal.SIGKILL)
        child.wait()
        assert not (results / ARTIFACT).exists()
        now = _identity(cache)
        assert all(now[name] == ident for name, ident in seen.items()), "a stored record was computed again"
        seen = now
        kills.append(len(now))

    _finish(_start(results, cache, data_dir))
    assert (results / ARTIFACT).read_bytes() == expected
    assert {str(p.relative_to(cache)): p.read_bytes() for p in _records(cache)} == expected_records
    assert all(_identity(cache)[name] == ident for name, ident in seen.items())
    info = json.loads((results / "run-info" / ARTIFACT).read_text())
    assert info["store"]["read"] > 0 and info["store"]["computed"] > 0
    print(f"kill points (records stored when killed): {kills} of {len(expected_records)}")
