"""Unix-domain sockets our processes listen on must be out of the candidate's reach: sockets at paths (a network
namespace does not hide them, and a read-only mount does not stop connect()) and abstract ones (shared wherever
the network namespace is not new). The seccomp layer (no-unix-sockets) refuses socket(AF_UNIX) in every mode.
Each case also connects from outside the sandbox, so a listener that could not be reached anyway fails the test.
The same attacks run in benchmarks/hostile_programs.py, as an ordinary user in test_sandbox_unprivileged.py."""
from __future__ import annotations

import os
import socket
import tempfile
from pathlib import Path

import pytest

from cel_utils.sandbox import run_program

T = 2.0
pytestmark = pytest.mark.filterwarnings("ignore::cel_utils.sandbox.SandboxWarning")  # degraded runs warn


def connect_program(address: str) -> str:
    return f"import socket\ns = socket.socket(socket.AF_UNIX)\ns.connect({address!r})\ns.sendall(b'pwned')\n"


def attack(where: str, disable: str, monkeypatch) -> tuple[object, bool]:
    """Run the connect in the sandbox with `disable`; (its result, whether our listener got a connection)."""
    monkeypatch.setenv("CEL_SANDBOX_DISABLE", disable)
    monkeypatch.setenv("CEL_SANDBOX_UNISOLATED", "allow")  # some cases below stand in for a user namespace's uid
    with tempfile.TemporaryDirectory(dir=Path.home()) as folder:
        path = os.path.join(folder, "listener.sock")
        address = path if where == "home" else f"\0cel-sandbox-test-{os.getpid()}-{os.urandom(4).hex()}"
        with socket.socket(socket.AF_UNIX) as listener:
            listener.bind(address)
            listener.listen()
            listener.settimeout(0.3)
            if where == "home":  # permissions are not what should stop it
                os.chmod(folder, 0o755)
                os.chmod(path, 0o777)
            result = run_program(connect_program(address), ["assert True"], timeout_s=T, cache=False)
            try:
                listener.accept()[0].close()
                reached = True
            except socket.timeout:
                reached = False
            with socket.socket(socket.AF_UNIX) as client:  # from outside it is reachable: the test can fail
                client.connect(address)
                listener.accept()[0].close()
    return result, reached


@pytest.mark.parametrize("where, disable", [
    pytest.param("home", "", id="home-default"),
    # as our own uid, as in a user namespace, and without the hook: only the kernel can refuse
    pytest.param("home", "uid,audit", id="home-own-uid-no-hook"),
    pytest.param("abstract", "audit", id="abstract-no-hook"),
    pytest.param("abstract", "netns,uid,audit", id="abstract-shared-netns-own-uid-no-hook"),
])
def test_unix_sockets_are_out_of_reach(where, disable, monkeypatch):
    result, reached = attack(where, disable, monkeypatch)
    assert not reached, "a program in the sandbox connected to our Unix socket"
    assert not result.passed and result.status == "exception", result.stderr
    if "audit" in disable:
        assert "no-unix-sockets" in result.protections
        assert "Address family not supported" in result.stderr  # refused by the seccomp filter, not by chance


def test_without_the_seccomp_layer_the_same_attack_gets_through(monkeypatch):
    # shows that the filter is what holds above: with it off (and the hook, and the uid drop), the connect works
    result, reached = attack("home", "uid,audit,seccomp", monkeypatch)
    assert reached and result.passed and "no-unix-sockets" not in result.protections
