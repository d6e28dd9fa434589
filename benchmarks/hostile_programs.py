"""Run a table of hostile programs through the MBPP sandbox and print how each one ended.

    python benchmarks/hostile_programs.py [--timeout 2] [--target DIR] [--json]

Each program would pass its test if its attack worked (its test checks the damage, or is `assert True` after an
attack that raises when refused), so every row must end as something other than "passed". The attacks on files
aim at a sentinel file that this script writes into a fresh folder under --target (default: your home), a file
you own outside the sandbox's working directory; the network attacks at listeners this script opens: on
127.0.0.1, on a Unix socket beside the sentinel (a network namespace does not hide sockets at paths, and a
read-only mount does not stop connect()) and on an abstract Unix socket (shared wherever the network namespace is
not new). Afterwards the script checks that the sentinel is unchanged, nothing new appeared beside it, no
listener got a connection, and (run as an ordinary user) that none of the programs left a process behind. One
honest program runs first as a control: it must pass, or "not passed" below would mean nothing.

The last row, a FIFO planted beside the sentinel, is the one attack the audit hook cannot see (os.mkfifo raises
no audit event): only kernel layers stop it, so it passes where the sandbox has none of them (see the warning);
there the sandbox refuses to run anything unless CEL_SANDBOX_UNISOLATED=allow is set, and this script stops.
Exit status 0 when no hostile program passed and every check held. tests/test_sandbox.py asserts most of these
programs in detail as root; tests/test_sandbox_unprivileged.py runs this script as an ordinary user.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import sys
import tempfile
import time
import warnings
from pathlib import Path

from cel_utils.sandbox import SandboxWarning, UnisolatedSandboxError, isolation_report, run_program

WRONG_ADD = "def add(a, b):\n    return 0\n"
ADD_TESTS = ["assert add(1, 2) == 3"]
CONTROL = ("control: an honest add", "def add(a, b):\n    return a + b\n", ADD_TESTS)
HOOK_BLIND = "plant a FIFO beside it (no audit event)"
Program = tuple[str, str, list[str]]  # name, program, tests


def hostile_programs(sentinel: Path, port: int, unix_path: str, abstract: str) -> list[Program]:
    """(name, program, tests) for each attack; `sentinel` is the file to attack, `port` a listener to reach, and
    `unix_path` and `abstract` (its name, without the leading NUL) Unix-socket listeners to reach."""
    target, planted, fifo = str(sentinel), str(sentinel.parent / "planted"), str(sentinel.parent / "fifo")
    ok = ["assert True"]

    def exists(path: str, negate: bool = False) -> list[str]:
        return [f"assert {'not ' if negate else ''}__import__('os').path.exists({path!r})"]
    return [
        ("infinite loop", "while True:\n    pass\n", ok),
        ("sleep forever", "import time\ntime.sleep(10**6)\n", ok),
        ("fork bomb", "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass\n", ok),
        ("memory bomb (50 MiB chunks)", "chunks = []\nwhile True:\n    chunks.append(bytearray(50 << 20))\n", ok),
        ("64 GiB allocation", "x = bytearray(64 << 30)\n", ok),
        ("recursion bomb", "def f():\n    return f()\nf()\n", ok),
        ("C-stack recursion bomb", "import sys\nsys.setrecursionlimit(10**8)\n"
         "def f(n):\n    return max(map(f, [n + 1]))\nf(0)\n", ok),
        ("print gigabytes", "import sys\nwhile True:\n    sys.stdout.write('x' * (1 << 20))\n", ok),
        ("connect to a local listener", "import socket\n"
         f"s = socket.create_connection(('127.0.0.1', {port}), timeout=1)\ns.sendall(b'pwned')\n", ok),
        ("connect to a Unix socket in your home", unix_connect(unix_path), ok),
        ("connect to an abstract Unix socket", unix_connect("\0" + abstract), ok),
        ("overwrite a file you own", f"open({target!r}, 'w').write('pwned')\n",
         [f"assert open({target!r}).read() == 'pwned'"]),
        ("delete a file you own", f"import os\nos.remove({target!r})\n", exists(target, negate=True)),
        ("plant a file beside it", f"open({planted!r}, 'w').write('x')\n", exists(planted)),
        # harmless in itself, but with CAP_SYS_ADMIN it could remount the filesystem writable or undo any other layer
        ("keep capabilities", "status = open('/proc/self/status').read()\n",
         ["assert int(status.split('CapEff:')[1].split()[0], 16) != 0"]),
        # its parent as it sees it, then this script by pid (outside a pid namespace that is the real parent's parent)
        ("kill its parent", "import os, signal\nos.kill(os.getppid(), signal.SIGKILL)\n"
         f"os.kill({os.getpid()}, signal.SIGKILL)\n", ok),
        ("os._exit(0) before asserts", WRONG_ADD + "import os\nos._exit(0)\n", ADD_TESTS),
        ("sys.exit(0) before asserts", WRONG_ADD + "import sys\nsys.exit(0)\n", ADD_TESTS),
        ("patch builtins.AssertionError", WRONG_ADD + "import builtins\nbuiltins.AssertionError = "
         "type('Nope', (Exception,), {})\n", ADD_TESTS),
        ("patch builtins.exec", WRONG_ADD + "import builtins\nbuiltins.exec = lambda *a, **k: None\n", ADD_TESTS),
        ("atexit os._exit(0)", WRONG_ADD + "import atexit, os\natexit.register(lambda: os._exit(0))\n", ADD_TESTS),
        ("trace hook exits 0", WRONG_ADD + "import sys\ndef t(frame, event, arg):\n    raise SystemExit(0)\n"
         "sys.settrace(t)\n", ADD_TESTS),
        (HOOK_BLIND, f"import os\nos.mkfifo({fifo!r})\n", exists(fifo)),
    ]


def unix_connect(address: str) -> str:
    return f"import socket\ns = socket.socket(socket.AF_UNIX)\ns.connect({address!r})\ns.sendall(b'pwned')\n"


def unix_listener(address: str) -> socket.socket:
    """A listening Unix socket at `address` (a path, or "\\0name" for the abstract namespace), not blocking."""
    listener = socket.socket(socket.AF_UNIX)
    listener.bind(address)
    listener.listen()
    listener.setblocking(False)
    return listener


def connected(listener: socket.socket) -> bool:
    """Whether anything connected to this non-blocking listener."""
    try:
        listener.accept()[0].close()
        return True
    except BlockingIOError:
        return False


def own_processes() -> set[int]:
    """Our uid's processes other than this one (for root: none counted, other users' work runs as root too)."""
    if os.geteuid() == 0:
        return set()
    mine = set()
    for entry in os.listdir("/proc"):
        try:
            if entry.isdigit() and int(entry) != os.getpid() and os.stat(f"/proc/{entry}").st_uid == os.geteuid():
                mine.add(int(entry))
        except OSError:
            pass  # ended meanwhile
    return mine


def left_behind(before: set[int], within_s: float = 5.0) -> int:
    """How many of our processes (beyond `before`) outlived the run that just ended: those still there `within_s`
    later. A killed process takes a moment to exit, longer on a loaded machine; one that escaped stays."""
    deadline = time.monotonic() + within_s
    while (extra := len(own_processes() - before)) and time.monotonic() < deadline:
        time.sleep(0.05)
    return extra


def run_suite(target_root: Path, timeout_s: float) -> dict:
    """Every program of `hostile_programs` through the sandbox, and the checks of the module docstring."""
    folder = Path(tempfile.mkdtemp(prefix="cel-hostile-", dir=target_root))
    sentinel = folder / "sentinel.txt"
    sentinel.write_text("original")
    stamp = sentinel.stat().st_mtime_ns
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen()
    listener.setblocking(False)
    unix_path, abstract = str(folder / "listener.sock"), f"cel-hostile-{os.getpid()}-{os.urandom(4).hex()}"
    listeners = {"tcp": listener, "unix": unix_listener(unix_path), "abstract": unix_listener("\0" + abstract)}
    before = own_processes()
    rows = []
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always", SandboxWarning)
            attacks = hostile_programs(sentinel, listener.getsockname()[1], unix_path, abstract)
            for name, program, tests in [CONTROL, *attacks]:
                r = run_program(program, tests, timeout_s=timeout_s, memory_mb=256, cache=False)
                rows.append({"program": name, "status": r.status, "passed": r.passed, "seconds": r.duration_s,
                             "protections": list(r.protections), "left_behind": left_behind(before),
                             "note": r.stderr.splitlines()[-1] if r.stderr else ""})
            report = isolation_report()
        checks = {"sentinel_untouched": sentinel.exists() and sentinel.read_text() == "original"
                  and sentinel.stat().st_mtime_ns == stamp,
                  "planted": sorted(p.name for p in folder.iterdir() if p not in (sentinel, Path(unix_path))),
                  "connected": [name for name, sock in listeners.items() if connected(sock)]}  # must stay []
    finally:
        for sock in listeners.values():
            sock.close()
        shutil.rmtree(folder, ignore_errors=True)
    issued = sum(issubclass(w.category, SandboxWarning) for w in caught)
    return {"uid": os.geteuid(), "timeout_s": timeout_s, "rows": rows, "checks": checks, "warning": report["warning"],
            "warnings_issued": issued}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--timeout", type=float, default=2.0, help="wall-clock limit per program, seconds")
    parser.add_argument("--target", type=Path, default=Path.home(),
                        help="folder in which to make the sentinel's folder (default: your home)")
    parser.add_argument("--json", action="store_true", help="print the results as one JSON object instead")
    args = parser.parse_args(argv)
    if not args.target.is_dir():
        parser.error(f"--target {args.target} is not a folder: pass one you own, outside /tmp")
    try:
        result = run_suite(args.target, args.timeout)
    except UnisolatedSandboxError as exc:
        print(f"hostile_programs.py: the sandbox {exc}", file=sys.stderr)
        return 2
    hostile = result["rows"][1:]
    checks = result["checks"]
    held = checks["sentinel_untouched"] and not checks["planted"] and not checks["connected"]
    failed = sum(r["passed"] for r in hostile) + (not result["rows"][0]["passed"]) + (not held)
    if args.json:
        print(json.dumps(result))
        return int(failed > 0)
    print(f"uid {result['uid']}; timeout {args.timeout:g} s, memory 256 MiB\n")
    print("| program | status | passed | seconds | left behind | protections |\n|---|---|---|---|---|---|")
    for r in result["rows"]:
        print(f"| {r['program']} | {r['status']} | {r['passed']} | {r['seconds']:.2f} | {r['left_behind']} | "
              f"{','.join(r['protections'])} |")
    print(f"\n{sum(r['passed'] for r in hostile)} of {len(hostile)} hostile programs passed (must be 0); "
          f"checks: {result['checks']}; this script (pid {os.getpid()}) is alive")
    print(f"warning: {result['warning']}" if result["warning"] else "no warning: kernel layers guard everything")
    return int(failed > 0)


if __name__ == "__main__":
    sys.exit(main())
