"""The sandbox's result cache: its key holds the sandbox's own code (SANDBOX_VERSION, derived from it), the Python
and the layers in force; a timeout is tried a second time, alone, before it is reported (unless it had the CPU all
along), and is never stored."""
from __future__ import annotations

import shutil
import threading
import time
from pathlib import Path

import pytest

from cel_utils import sandbox
from cel_utils.sandbox import ExecCache, ExecResult, run_program
from cel_utils.sandbox import cache as exec_cache
from cel_utils.sandbox import run as runner

T = 2.0
ADD = "def add(a, b):\n    return a + b\n"
TESTS = ["assert add(1, 2) == 3"]
LOOP = "while True:\n    pass\n"
SLEEP = "import time\ntime.sleep(60)\n"
pytestmark = pytest.mark.filterwarnings("ignore::cel_utils.sandbox.SandboxWarning")  # degraded runs warn


def count_executions(monkeypatch, first=None) -> list[str]:
    """The programs the sandbox ran (after the isolation probe, which the cache key needs, has run);
    `first`, when given, stands in for the first run's result."""
    sandbox.isolation_report()
    real, programs = runner._execute, []

    def counting(*args):
        programs.append(args[0])
        return first if first is not None and len(programs) == 1 else real(*args)
    monkeypatch.setattr(runner, "_execute", counting)
    return programs


def timed_out(cpu_s: float) -> ExecResult:
    return ExecResult("timeout", False, -9, T, "", "[sandbox] timeout: still running after 2 s", ("session",), cpu_s)


def test_a_timeout_under_load_is_tried_again_and_the_second_verdict_kept(tmp_path, monkeypatch):
    # the first run timed out with little CPU time, as one starved by a parallel run would
    programs = count_executions(monkeypatch, first=timed_out(cpu_s=0.3))
    result = run_program(ADD, TESTS, timeout_s=T, cache=ExecCache(tmp_path))
    assert result.passed and programs == [ADD, ADD]
    assert run_program(ADD, TESTS, timeout_s=T, cache=ExecCache(tmp_path)).passed and len(programs) == 2  # cached


def test_a_timeout_that_had_the_cpu_is_not_retried_nor_stored(tmp_path, monkeypatch):
    # an endless loop that got the CPU all along: another try would only burn another timeout_s
    programs = count_executions(monkeypatch, first=timed_out(cpu_s=0.97 * T))
    assert run_program(LOOP, ["assert True"], timeout_s=T, cache=ExecCache(tmp_path)).status == "timeout"
    assert programs == [LOOP] and not list(tmp_path.rglob("*.json"))


def test_a_real_timeout_is_reported_and_never_stored(tmp_path, monkeypatch):
    programs = count_executions(monkeypatch)
    cache = ExecCache(tmp_path)
    first = run_program(SLEEP, ["assert True"], timeout_s=0.5, cache=cache)
    assert first.status == "timeout" and len(programs) == 2  # asleep, it used no CPU: retried once
    assert first.cpu_s is not None and first.cpu_s < 0.25
    assert not list(tmp_path.rglob("*.json"))
    again = run_program(SLEEP, ["assert True"], timeout_s=0.5, cache=cache)
    assert again.status == "timeout" and len(programs) == 4  # recomputed, not served from the cache


def test_the_retry_runs_alone_among_this_processes_sandboxes():
    # Ordered by events, not sleeps, so that a loaded machine only slows it down. A waiting thread cannot be observed
    # waiting: a wrong gate is given `chance_s` to let it through, which on a loaded machine it might not use (the
    # test then misses the error), but a right gate is never blamed.
    gate, events, chance_s = runner._Gate(), [], 0.2
    other_running, other_may_end = threading.Event(), threading.Event()
    retry_running, retry_may_end = threading.Event(), threading.Event()
    late_asking, late_running = threading.Event(), threading.Event()

    def other_run():
        with gate.shared():
            other_running.set()
            other_may_end.wait(30)
            events.append("other run ends")

    def retry():
        with gate.alone():
            events.append("retry runs")
            retry_running.set()
            retry_may_end.wait(30)
            events.append("retry ends")

    def late_run():
        late_asking.set()
        with gate.shared():
            late_running.set()
            events.append("late run starts")

    threads = [threading.Thread(target=run) for run in (other_run, retry, late_run)]
    threads[0].start()
    assert other_running.wait(30)
    threads[1].start()
    deadline = time.monotonic() + 30
    while not gate._alone and time.monotonic() < deadline:  # the retry has claimed the gate...
        time.sleep(0.01)
    assert gate._alone
    assert not retry_running.wait(chance_s) and events == []  # ...but waits for the run beside it
    other_may_end.set()
    assert retry_running.wait(30)
    threads[2].start()  # starts while the retry runs: must wait for it
    assert late_asking.wait(30)
    assert not late_running.wait(chance_s)
    retry_may_end.set()
    for t in threads:
        t.join(30)
    assert not any(t.is_alive() for t in threads)
    assert events == ["other run ends", "retry runs", "retry ends", "late run starts"]


def test_the_key_holds_the_layers_in_force_the_python_and_the_limits(monkeypatch):
    here = sandbox.isolation_report()["protections"]
    base = ExecCache.key(ADD, TESTS, "", T, 1024, here)
    assert base == ExecCache.key(ADD, TESTS, "", T, 1024, list(reversed(here)))  # a set of layers
    assert base != ExecCache.key(ADD, TESTS, "", T, 1024, [p for p in here if p != "netns"] or ["x"])
    assert base != ExecCache.key(ADD, TESTS, "", T + 1, 1024, here)  # the limits make other verdicts
    assert base != ExecCache.key(ADD, TESTS, "", T, 512, here)
    monkeypatch.setattr(exec_cache, "_PYTHON", ["cpython", 3, 99, 0, "final", 0])
    assert ExecCache.key(ADD, TESTS, "", T, 1024, here) != base
    monkeypatch.undo()
    monkeypatch.setattr(exec_cache, "SANDBOX_VERSION", "another")
    assert ExecCache.key(ADD, TESTS, "", T, 1024, here) != base


def test_a_result_from_other_layers_is_not_served(tmp_path, monkeypatch):
    programs = count_executions(monkeypatch)
    cache = ExecCache(tmp_path)
    full = run_program(ADD, TESTS, timeout_s=T, cache=cache)
    if "netns" not in full.protections:
        pytest.skip("this machine gives the sandbox no network namespace to take away")
    monkeypatch.setenv("CEL_SANDBOX_DISABLE", "netns")
    monkeypatch.setenv("CEL_SANDBOX_UNISOLATED", "allow")
    degraded = run_program(ADD, TESTS, timeout_s=T, cache=cache)
    assert programs.count(ADD) == 2 and "netns" not in degraded.protections


def test_sandbox_version_is_a_hash_of_the_sandbox_code(tmp_path):
    here = Path(sandbox.__file__).parent
    names = sorted(p.name for p in here.glob("*.py"))
    assert {"__init__.py", "run.py", "cache.py", "result.py", "child.py", "isolation.py", "harness.py"} <= set(names)
    for name in names:
        shutil.copy(here / name, tmp_path / name)
    seen = {exec_cache.source_version(tmp_path)}
    assert seen == {sandbox.SANDBOX_VERSION}  # the same code, the same version
    for name in names:  # any change to any of them is a new version
        original = (tmp_path / name).read_text()
        (tmp_path / name).write_text(original.replace("\n", "\n ", 1))
        seen.add(exec_cache.source_version(tmp_path))
        (tmp_path / name).write_text(original)
    (tmp_path / "new.py").write_text("x = 1\n")  # and so is a new module beside them
    seen.add(exec_cache.source_version(tmp_path))
    assert len(seen) == len(names) + 2
