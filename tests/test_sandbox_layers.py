"""What the sandbox reports about its own isolation: which of network, files and processes only the audit hook
guards, the warning a user then gets (once per process, where CEL_SANDBOX_UNISOLATED=allow lets such runs
happen at all), and the switch that takes the hook away so that the
kernel layers are tested alone. The hostile programs themselves are in test_sandbox.py (as root) and
test_sandbox_unprivileged.py (as an ordinary user)."""
from __future__ import annotations

import pytest

from cel_utils import sandbox
from cel_utils.sandbox import run as runner
from cel_utils.sandbox import run_many, run_program

T = 2.0
ADD = "def add(a, b):\n    return a + b\n"
# as root with every namespace: the layers that keep code off our network, files and processes
FULL = ("netns", "mntns", "pidns", "private-tmp", "private-proc", "uid-nobody", "rlimits", "session")
pytestmark = pytest.mark.filterwarnings("ignore::cel_utils.sandbox.SandboxWarning")


def run(program: str, tests=(), **kw):
    return run_program(program, tests, timeout_s=T, cache=False, **kw)


def test_protections_name_what_only_the_hook_guards(monkeypatch):
    monkeypatch.setenv("CEL_SANDBOX_DISABLE", "netns")
    report = sandbox.isolation_report()
    assert "netns" not in report["protections"] and report["unguarded"][0] == "network"
    assert report["warning"].startswith("the MBPP sandbox cannot isolate your network")
    assert sandbox.unguarded(FULL) == [] and sandbox.isolation_warning(FULL) is None
    # a user namespace guards files with read-only mounts instead of the uid drop
    assert sandbox.unguarded(["userns", "netns", "pidns", "read-only-root"]) == []
    assert sandbox.unguarded(["userns", "netns", "pidns"]) == ["files"]


def test_best_effort_sandbox_warns_once_per_process(monkeypatch):
    monkeypatch.setenv("CEL_SANDBOX_DISABLE", ",".join(x for x in sandbox.LAYERS if x != "audit"))
    monkeypatch.setenv("CEL_SANDBOX_UNISOLATED", "allow")  # the opt-in to such runs; refused without it
    monkeypatch.setattr(runner, "_warned", set())
    with pytest.warns(sandbox.SandboxWarning, match="network, files and processes") as caught:
        results = run_many([{"program": ADD, "tests": ["assert add(1, 2) == 3"]}] * 3, timeout_s=T, cache=False)
    assert all(r.passed for r in results) and len(caught) == 1


def test_without_the_audit_hook_only_kernel_layers_remain(monkeypatch):
    monkeypatch.setenv("CEL_SANDBOX_DISABLE", "audit,netns")
    monkeypatch.setenv("CEL_SANDBOX_UNISOLATED", "allow")
    r = run("import socket\nsocket.socket().close()\n")  # refused by the hook when it is there
    assert r.passed and "audit-guard" not in r.protections


def test_mount_points_are_unescaped(tmp_path):
    from cel_utils.sandbox import isolation

    info = tmp_path / "mountinfo"
    info.write_bytes(b"27 1 254:0 / / rw - ext4 /dev/vda rw\n"
                     b"60 27 0:40 / /mnt/with\\040space\\134x rw,nosuid - tmpfs t rw\n")
    assert isolation.mount_points(str(info)) == ["/", "/mnt/with space\\x"]


def test_the_run_page_shows_the_warning_a_run_recorded(monkeypatch):
    from test_report import make_artifact

    from cel_utils.book import run_page

    artifact = make_artifact()
    monkeypatch.setenv("CEL_SANDBOX_DISABLE", ",".join(x for x in sandbox.LAYERS if x != "audit"))
    artifact["sandbox"] = sandbox.isolation_report()  # what run_cel records for MBPP
    sentence = run_page.holdout_sentence(artifact)
    assert "**Warning: best-effort sandbox.**" in sentence and "network, files and processes" in sentence
    monkeypatch.delenv("CEL_SANDBOX_DISABLE")
    artifact["sandbox"] = sandbox.isolation_report()
    if artifact["sandbox"]["unguarded"]:
        pytest.skip("this machine gives the sandbox no kernel layers at all (neither root nor user namespaces)")
    assert "Warning" not in run_page.holdout_sentence(artifact) and run_page.sandbox_note(artifact) == ""
    artifact["sandbox"] = None  # artifacts from before the sandbox was recorded (the schema's migration), tasks that run no code
    assert run_page.sandbox_note(artifact) == ""
