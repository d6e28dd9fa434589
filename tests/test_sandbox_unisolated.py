"""Where the sandbox would leave something (network, files, processes) to the best-effort audit hook alone, it runs
model-written code only when the user opted in with CEL_SANDBOX_UNISOLATED=allow; otherwise it refuses before any
of that code runs. As root the degraded case is made with CEL_SANDBOX_DISABLE; test_sandbox_unprivileged.py
checks the same as an ordinary user without user namespaces."""
from __future__ import annotations

import socket

import pytest

from cel_utils import sandbox
from cel_utils.sandbox import ExecCache, run_program

T = 2.0
pytestmark = pytest.mark.filterwarnings("ignore::cel_utils.sandbox.SandboxWarning")  # opted-in runs warn


def test_without_the_opt_in_unguarded_code_is_refused_before_it_runs(monkeypatch, tmp_path):
    # no network namespace and no hook: only the refusal stands between this program and our listener
    monkeypatch.setenv("CEL_SANDBOX_DISABLE", "netns,audit")
    monkeypatch.delenv("CEL_SANDBOX_UNISOLATED", raising=False)
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        listener.settimeout(0.3)
        program = (f"import socket\ns = socket.create_connection(('127.0.0.1', {listener.getsockname()[1]}), "
                   "timeout=1)\ns.sendall(b'x')\n")
        with pytest.raises(RuntimeError, match="CEL_SANDBOX_UNISOLATED=allow") as refused:
            run_program(program, ["assert True"], timeout_s=T, cache=ExecCache(tmp_path))
        assert refused.type is sandbox.UnisolatedSandboxError and "cannot isolate your network" in str(refused.value)
        with pytest.raises(socket.timeout):
            listener.accept()  # the program never ran
        assert not list(tmp_path.rglob("*.json"))
        # opted in, the same program runs, and here nothing stops it: so the refusal above is what held
        monkeypatch.setenv("CEL_SANDBOX_UNISOLATED", "allow")
        assert run_program(program, ["assert True"], timeout_s=T, cache=False).passed
        listener.accept()[0].close()


def test_the_isolation_report_needs_no_opt_in(monkeypatch):
    # it runs no model-written code, so a run can record (and its page show) how isolated the sandbox would be
    monkeypatch.setenv("CEL_SANDBOX_DISABLE", "netns")
    monkeypatch.delenv("CEL_SANDBOX_UNISOLATED", raising=False)
    assert sandbox.isolation_report()["unguarded"] == ["network"]


def test_a_fully_isolated_sandbox_needs_no_opt_in(monkeypatch):
    monkeypatch.delenv("CEL_SANDBOX_DISABLE", raising=False)
    monkeypatch.delenv("CEL_SANDBOX_UNISOLATED", raising=False)
    if sandbox.isolation_report()["unguarded"]:
        pytest.skip("this machine gives the sandbox no kernel layers for some of network, files and processes")
    assert run_program("x = 1\n", timeout_s=T, cache=False).passed


def test_an_unknown_opt_in_value_is_an_error(monkeypatch):
    monkeypatch.setenv("CEL_SANDBOX_UNISOLATED", "yes")
    with pytest.raises(ValueError, match="CEL_SANDBOX_UNISOLATED='yes'.*'allow'"):
        run_program("", timeout_s=T, cache=False)
