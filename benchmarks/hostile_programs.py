"""Run a table of hostile programs through the MBPP sandbox and print how each one ended.

    python benchmarks/hostile_programs.py [--timeout 2]

Each program would pass its test (`assert True`, or a wrong `add` with real asserts for the cheats) if its
attack worked, so every row must end as something other than "passed". tests/test_sandbox.py asserts the
same programs (and more) in detail; this script prints the table for reports.
"""
from __future__ import annotations

import argparse
import os
import sys

from cel_utils.evaluation.sandbox import run_program

WRONG_ADD = "def add(a, b):\n    return 0\n"
ADD_TESTS = ["assert add(1, 2) == 3"]
HOSTILE = [
    ("infinite loop", "while True:\n    pass\n", ["assert True"]),
    ("sleep forever", "import time\ntime.sleep(10**6)\n", ["assert True"]),
    ("fork bomb", "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass\n",
     ["assert True"]),
    ("memory bomb (50 MiB chunks)", "chunks = []\nwhile True:\n    chunks.append(bytearray(50 << 20))\n",
     ["assert True"]),
    ("64 GiB allocation", "x = bytearray(64 << 30)\n", ["assert True"]),
    ("recursion bomb", "def f():\n    return f()\nf()\n", ["assert True"]),
    ("C-stack recursion bomb", "import sys\nsys.setrecursionlimit(10**8)\ndef f(n):\n    return max(map(f, [n + 1]))\n"
     "f(0)\n", ["assert True"]),
    ("print gigabytes", "import sys\nwhile True:\n    sys.stdout.write('x' * (1 << 20))\n", ["assert True"]),
    ("network connection", "import socket\nsocket.create_connection(('127.0.0.1', 22), timeout=1)\n",
     ["assert True"]),
    ("write outside workdir", "open('/etc/cel-pwned', 'w').write('x')\n", ["assert True"]),
    ("delete outside workdir", "import os\nos.remove(os.path.expanduser('~/.bashrc'))\n", ["assert True"]),
    # its parent as it sees it, then this script by pid (outside a pid namespace that is the real parent's parent)
    ("kill its parent", f"import os, signal\nos.kill(os.getppid(), signal.SIGKILL)\nos.kill({os.getpid()}, signal.SIGKILL)\n",
     ["assert True"]),
    ("os._exit(0) before asserts", WRONG_ADD + "import os\nos._exit(0)\n", ADD_TESTS),
    ("sys.exit(0) before asserts", WRONG_ADD + "import sys\nsys.exit(0)\n", ADD_TESTS),
    ("patch builtins.AssertionError", WRONG_ADD + "import builtins\nbuiltins.AssertionError = "
     "type('Nope', (Exception,), {})\n", ADD_TESTS),
    ("patch builtins.exec", WRONG_ADD + "import builtins\nbuiltins.exec = lambda *a, **k: None\n", ADD_TESTS),
    ("atexit os._exit(0)", WRONG_ADD + "import atexit, os\natexit.register(lambda: os._exit(0))\n", ADD_TESTS),
    ("trace hook exits 0", WRONG_ADD + "import sys\ndef t(frame, event, arg):\n    raise SystemExit(0)\n"
     "sys.settrace(t)\n", ADD_TESTS),
]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--timeout", type=float, default=2.0, help="wall-clock limit per program, seconds")
    args = parser.parse_args(argv)
    print(f"uid {os.geteuid()}; timeout {args.timeout:g} s, memory 256 MiB\n")
    print("| program | status | passed | seconds | protections |\n|---|---|---|---|---|")
    passed = 0
    for name, program, tests in HOSTILE:
        r = run_program(program, tests, timeout_s=args.timeout, memory_mb=256, cache=False)
        passed += r.passed
        print(f"| {name} | {r.status} | {r.passed} | {r.duration_s:.2f} | {','.join(r.protections)} |", flush=True)
    print(f"\n{passed} of {len(HOSTILE)} hostile programs passed (must be 0); this script (pid {os.getpid()}) is alive")
    return int(passed > 0)


if __name__ == "__main__":
    sys.exit(main())
