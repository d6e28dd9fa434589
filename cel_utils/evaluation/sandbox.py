"""Run untrusted, model-written Python (MBPP completions) in a separate, locked-down process.

lm-eval's `code_eval` runs candidates in threads of the evaluating process and its own docs call that unsafe.
Here every run is a fresh interpreter (`_sandbox_child.py`: a root-side supervisor and the worker that runs the
candidate), in its own session, with these layers:

  protection       what it gives                                           needs
  ---------------  ------------------------------------------------------  ----------------------------------
  session          own session; the worker's process group is killed at    -
                   the end, the whole session on our backstop timeout
  rlimits          CPU seconds, address space (memory_mb), 16 MiB per      -
                   file (stdout/stderr too: more fails with EFBIG),
                   16 processes, 256 fds, no core dumps
  workdir          a fresh working directory, removed afterwards           -
  env-scrubbed     nothing inherited (tokens, proxies, PYTHON*)            -
  no-new-privs     setuid binaries cannot hand privileges back             -
  pdeathsig        the worker dies if its supervisor dies                  -
  userns           without root: a user namespace mapping our uid to       not root, and a kernel that lets
                   itself, inside which the namespaces below are made      users make one (userns below)
  netns            no network: a namespace with only a down loopback       root or userns
  mntns            private mounts, and with them private-tmp: a fresh      root or userns
                   tmpfs on /tmp, /var/tmp, /dev/shm and /run (sockets:
                   the session bus, docker, databases)
  pidns            the worker is pid 1 of its own pid namespace: nothing   root or userns
                   outside is visible or signalable, and everything it
                   started dies with it; with it private-proc
  ipcns, utsns     no shared SysV IPC, no hostname changes                 root or userns
  uid-nobody       runs as `nobody`: cannot touch our files or signal our  root, and Python readable by nobody
                   processes, and RLIMIT_NPROC applies (root ignores it)   (see below)
  read-only-root   every mount read-only but the private tmpfs's (the      userns, mntns
                   workdir is one): as our own uid, the candidate could
                   otherwise change any file we own
  no-caps          the capabilities the user namespace gave are dropped    userns
                   before the candidate runs (they could undo the above)
  audit-guard      whenever uid-nobody or netns is missing: a PEP 578      -
                   hook refusing sockets, subprocesses, fork, kill,
                   ctypes and file changes outside the workdir

`ExecResult.protections` records which were active in each run. Without root, where the kernel lets ordinary
users create user namespaces (`unshare -Urn true` works; so on most current distributions), the namespaces are
made inside one (`_sandbox_isolation.py` says how): the candidate still runs as our uid, so read-only mounts, not
file permissions, keep it off our files; it can read what we can read (our home), with no network to send it
anywhere. Where user namespaces are refused (or switched off with CEL_SANDBOX_DISABLE=userns) only the "-" rows
remain: the candidate runs as our own uid and the audit hook, best effort and not a security boundary, is all that
stands between it and our files, processes and network. `unguarded` names what only the hook protects; the first
such run of a process warns, and `isolation_report()` is what a run records in its artifact and shows on its page.
We do our own unshare() and mounts (ctypes, as root already did) rather than calling bubblewrap: `bwrap` is often
not installed where researchers run (cluster nodes, laptops) and cannot be installed without root, while every
layer here degrades on its own where a kernel refuses it (bwrap refuses to start instead).
As root without a mount namespace, a Python installed under a
directory others cannot enter (pyenv in a 0700 /root, as on our dev machine) leaves no uid drop possible; with
one, that directory is covered by an empty tmpfs and only the Python directories are bound back, in the
sandbox's view only. Without a pid namespace, a grandchild that calls setsid() escapes the final group kill (it
keeps the CPU limit). RLIMIT_NPROC counts all of nobody's processes on the machine (in a user namespace, those
of the namespace), so parallel sandboxes as root share those 16. Memory is bounded per process only (RLIMIT_AS);
there are no cgroups.
`CEL_SANDBOX_DISABLE=userns,netns,mntns,pidns,ipcns,utsns,uid,audit` (any subset) switches layers off, to test
the degraded paths (userns matters only without root, uid only as root) and the kernel layers without the hook.

Statuses (`ExecResult.status`); only "passed" has `passed=True`:
  passed        setup, program and every test ran, and the harness reported it with this run's secret
  failed        an assert raised AssertionError (normally a test; the stderr note names the phase)
  exception     any other exception: NameError, MemoryError, RecursionError, EOFError from input(), EFBIG...
  syntax_error  setup, program or a test does not compile
  early_exit    the worker ended before the harness reported: sys.exit(), exit(), os._exit(), a tampered pipe
  timeout       the wall-clock limit (timeout_s, from the worker's start) or the CPU-time limit
  killed        ended by another signal, e.g. SIGSEGV from a C-level stack overflow
  error         the sandbox itself failed; never cached
The last line of `stderr` is a "[sandbox] <status>: <why>" note, e.g. which test failed and how.

How cheating is scored. Exit status 0 never counts. A pass is the harness's verdict line "<secret> passed",
where the secret is 128 random bits made per run and handed over on stdin (which the candidate then finds
empty). The harness writes it only after the last test returned, into a pipe the candidate cannot read back
(root-owned; reopening it through /proc is refused to nobody; in a user namespace the candidate owns it, which
gives it no more than the frames below do), and checks first that the fd is still that pipe;
the supervisor keeps the first line carrying the secret and ignores everything else. The harness then leaves
with os._exit, so atexit handlers never run. Before the candidate runs, the harness binds exec, os.write,
os._exit and the exception classes; before each test it restores the builtins module and the namespace's
__builtins__ and clears trace and profile hooks. So: sys.exit(0)/os._exit(0) before the asserts -> early_exit;
printed or written fake results -> ignored; patched `exec`/`sorted`/`AssertionError`, atexit or excepthook
tricks -> the asserts still run and fail.
Not defended: candidate and harness share one interpreter, as asserts must call the candidate's functions, so
code written against this harness can read the secret out of its frames (`sys._getframe(1).f_locals`, gc, a
racing thread) and forge a pass (a strict xfail test shows it); and an object whose __eq__ always returns True,
or a patched module function that a test calls (math.isclose), makes false asserts true. These take deliberate,
visible code, not an accident of generation; closing them needs the asserts evaluated outside the candidate's
process (values passed back as plain data), which is not done.

Results are cached on disk by sha256(program, tests, setup, limits, SANDBOX_VERSION); timeouts are cached too
(pass cache=False to re-check one), sandbox errors never.
"""
from __future__ import annotations

import hashlib
import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import warnings
from collections.abc import Iterable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any

from cel_utils.paths import atomic_write, cache_dir

SANDBOX_VERSION = "2"  # bump when a change could alter any result: it is part of the cache key
LAYERS = ("userns", "netns", "mntns", "pidns", "ipcns", "utsns", "uid", "audit")  # what CEL_SANDBOX_DISABLE may name
STATUSES = ("passed", "failed", "exception", "syntax_error", "early_exit", "timeout", "killed", "error")
TAIL_BYTES = 4000   # how much of stdout/stderr a result keeps
GRACE_S = 5.0       # on top of timeout_s before we stop waiting for the supervisor itself
_CHILD = Path(__file__).with_name("_sandbox_child.py")
_CHILD_ENV = {"PATH": "/usr/local/bin:/usr/bin:/bin", "LANG": "C.UTF-8"}
# What model-written code must be kept away from, and the kernel layers that do it (any one of them suffices).
GUARDS = {"network": ("netns",), "files": ("uid-nobody", "read-only-root"), "processes": ("pidns", "uid-nobody")}


@dataclass(frozen=True)
class ExecResult:
    status: str                     # see the module docstring
    passed: bool
    returncode: int | None          # of the process that ran the candidate; -N for signal N; None if unknown
    duration_s: float               # wall clock, interpreter start-up included
    stdout: str                     # last TAIL_BYTES
    stderr: str                     # last TAIL_BYTES, ending with a "[sandbox] ..." note
    protections: tuple[str, ...]    # the layers that were active, see the module docstring


def run_program(program: str, tests: Sequence[str] = (), setup: str = "", *, timeout_s: float = 10.0,
                memory_mb: int = 1024, cache: bool | ExecCache = True) -> ExecResult:
    """Run `setup`, then `program`, then each statement in `tests` in one namespace, in the sandbox."""
    if not isinstance(program, str) or not isinstance(setup, str):
        raise TypeError("program and setup must be strings")
    if isinstance(tests, str):
        raise TypeError("tests must be a sequence of statements, not one string")
    if timeout_s <= 0 or memory_mb <= 0:
        raise ValueError("timeout_s and memory_mb must be positive")
    tests = [str(t) for t in tests]
    store = ExecCache() if cache is True else cache or None
    key = ExecCache.key(program, tests, setup, timeout_s, memory_mb)
    if store is not None and (hit := store.get(key)) is not None:
        return hit
    result = _execute(program, tests, setup, float(timeout_s), int(memory_mb))
    if store is not None and result.status != "error":
        store.put(key, result)
    return result


def check_mbpp(completion: str, test_list: Sequence[str], test_setup_code: str = "", *, timeout_s: float = 10.0,
               **kw: Any) -> ExecResult:
    """Score one MBPP completion: its test_setup_code, then the completion, then its asserts."""
    return run_program(completion, test_list, test_setup_code, timeout_s=timeout_s, **kw)


def run_many(jobs: Iterable[Mapping[str, Any]], workers: int = 2, **kw: Any) -> list[ExecResult]:
    """run_program for each job (a mapping of its arguments, overriding `kw`), `workers` sandboxes at a time.

    Threads are enough: each thread only waits for its sandbox process, which does the work.
    """
    with ThreadPoolExecutor(max_workers=workers) as pool:
        return list(pool.map(lambda job: run_program(**{**kw, **job}), jobs))


# --- how isolated is the sandbox here? -----------------------------------------------------------------------------

class SandboxWarning(UserWarning):
    """Model-written code runs with only best-effort protection of something (see `unguarded`)."""


def unguarded(protections: Iterable[str]) -> list[str]:
    """What of GUARDS no kernel layer among `protections` protects: only the best-effort audit hook does."""
    have = set(protections)
    return [what for what, layers in GUARDS.items() if not have.intersection(layers)]


def isolation_warning(protections: Sequence[str]) -> str | None:
    """The warning a user gets when `protections` leave something to the audit hook alone; None when they do not."""
    missing = unguarded(protections)
    if not missing:
        return None
    named = missing[0] if len(missing) == 1 else f"{', '.join(missing[:-1])} and {missing[-1]}"
    return (f"the MBPP sandbox cannot isolate your {named} from the model-written code it runs: only a "
            "best-effort audit hook, which is not a security boundary, stands in. Run as root, or as a user allowed to "
            "create user namespaces (`unshare -Urn true` must work), to get the kernel layers "
            f"(layers here: {', '.join(protections) or 'none'}; see cel_utils/evaluation/sandbox.py)")


_warned: set[tuple[str, ...]] = set()
_warned_lock = threading.Lock()


def _warn_once(protections: tuple[str, ...]) -> None:
    """Warn about best-effort isolation once per process and set of layers, not once per program."""
    text = isolation_warning(protections)
    with _warned_lock:
        if text is None or protections in _warned:
            return
        _warned.add(protections)
    warnings.warn(text, SandboxWarning, stacklevel=4)


_reports: dict[tuple[int, str], dict] = {}


def isolation_report() -> dict:
    """The layers a sandbox gets here, as this user with this CEL_SANDBOX_DISABLE, from one empty program run
    uncached (once per process): {"protections": [...], "unguarded": [...], "warning": text or None}. A run
    records it in its artifact, and its page shows the warning."""
    key = (os.geteuid(), os.environ.get("CEL_SANDBOX_DISABLE", ""))
    if key not in _reports:
        probe = run_program("", cache=False)
        if probe.status != "passed":  # not remembered: the next call tries again
            return {"protections": [], "unguarded": list(GUARDS),
                    "warning": f"the MBPP sandbox failed to run an empty program: {probe.stderr.splitlines()[-1]}"}
        _reports[key] = {"protections": list(probe.protections), "unguarded": unguarded(probe.protections),
                         "warning": isolation_warning(probe.protections)}
    return _reports[key]


# --- cache ----------------------------------------------------------------------------------------------------------

class ExecCache:
    """Results on disk, one JSON file per key. Entries are written atomically and carry a checksum, so a
    truncated or corrupted entry reads as a miss and is recomputed."""

    def __init__(self, root: str | os.PathLike[str] | None = None) -> None:
        self.root = Path(root) if root is not None else cache_dir() / "exec"

    @staticmethod
    def key(program: str, tests: Sequence[str], setup: str, timeout_s: float, memory_mb: int) -> str:
        blob = json.dumps([SANDBOX_VERSION, program, list(tests), setup, float(timeout_s), int(memory_mb)])
        return hashlib.sha256(blob.encode()).hexdigest()

    def _path(self, key: str) -> Path:
        return self.root / key[:2] / f"{key}.json"

    def get(self, key: str) -> ExecResult | None:
        try:
            entry = json.loads(self._path(key).read_text())
            result = entry["result"]
            if entry["key"] != key or entry["sha256"] != _digest(result):
                return None
            result["protections"] = tuple(result["protections"])
            out = ExecResult(**result)
        except (OSError, ValueError, KeyError, TypeError):
            return None
        types_ok = all(isinstance(getattr(out, f.name), t) for f, t in zip(fields(ExecResult), _FIELD_TYPES))
        consistent = out.status in STATUSES and out.passed == (out.status == "passed")
        return out if types_ok and consistent else None

    def put(self, key: str, result: ExecResult) -> None:
        path = self._path(key)
        record = asdict(result)
        try:  # readers see the old entry or the new one, never half of one
            atomic_write(path, json.dumps({"key": key, "sha256": _digest(record), "result": record}))
        except OSError as exc:
            warnings.warn(f"sandbox cache: could not write {path}: {exc}", stacklevel=2)


_FIELD_TYPES = (str, bool, (int, type(None)), (float, int), str, str, tuple)


def _digest(record: Mapping[str, Any]) -> str:
    canonical = json.dumps({**record, "protections": list(record["protections"])}, sort_keys=True)
    return hashlib.sha256(canonical.encode()).hexdigest()


# --- running one program --------------------------------------------------------------------------------------------

def _disabled() -> list[str]:
    names = [n.strip() for n in os.environ.get("CEL_SANDBOX_DISABLE", "").split(",") if n.strip()]
    unknown = set(names) - set(LAYERS)
    if unknown:
        raise ValueError(f"CEL_SANDBOX_DISABLE: unknown layers {sorted(unknown)}; known: {LAYERS}")
    return names


def _execute(program: str, tests: list[str], setup: str, timeout_s: float, memory_mb: int) -> ExecResult:
    secret = secrets.token_hex(16)
    disable = _disabled()
    workdir = tempfile.mkdtemp(prefix="cel-sandbox-")  # used when there is no private /tmp
    start = time.monotonic()
    try:
        with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err, tempfile.TemporaryFile() as report:
            job = {"program": program, "tests": tests, "setup": setup, "timeout_s": timeout_s,
                   "memory_mb": memory_mb, "workdir": workdir, "report_fd": report.fileno(), "secret": secret,
                   "disable": disable}
            try:
                proc = subprocess.Popen([sys.executable, "-I", "-B", str(_CHILD)], stdin=subprocess.PIPE,
                                        stdout=out, stderr=err, pass_fds=(report.fileno(),), cwd=workdir,
                                        env=_CHILD_ENV, start_new_session=True)
            except OSError as exc:
                return ExecResult("error", False, None, time.monotonic() - start, "",
                                  f"[sandbox] error: could not start the sandbox: {exc}", ())
            backstop = False
            try:
                proc.communicate(json.dumps(job).encode(), timeout=timeout_s + GRACE_S)
            except subprocess.TimeoutExpired:
                backstop = True
                try:
                    os.killpg(proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                proc.wait()
            duration = time.monotonic() - start
            report.seek(0)
            record = _read_report(report.read(), secret)
            status, returncode, note = _judge(record, backstop, proc.returncode, timeout_s)
            protections = tuple(record["layers"]) if record else ()
            if record and record["ready"]:
                _warn_once(protections)
            stderr = _tail(err)
            stderr += ("\n" if stderr and not stderr.endswith("\n") else "") + f"[sandbox] {status}: {note}"
            return ExecResult(status, status == "passed", returncode, round(duration, 4), _tail(out), stderr,
                              protections)
    finally:
        _remove_tree(workdir)


def _remove_tree(path: str) -> None:
    shutil.rmtree(path, ignore_errors=True)
    if os.path.exists(path):
        # without root the candidate ran as us and may have made directories unreadable (chmod 0): undo that,
        # never following symlinks it may have left, and try again
        _chmod_dir(path)
        for dirpath, dirnames, _ in os.walk(path):
            for name in dirnames:
                _chmod_dir(os.path.join(dirpath, name))  # before os.walk descends into it
        shutil.rmtree(path, ignore_errors=True)
    if os.path.exists(path):
        warnings.warn(f"sandbox: could not remove {path}", stacklevel=3)


def _chmod_dir(path: str) -> None:
    if not os.path.islink(path):
        try:
            os.chmod(path, 0o700)
        except OSError:
            pass


def _read_report(data: bytes, secret: str) -> dict | None:
    """The supervisor's record: the first line carrying this run's secret."""
    for line in data.decode(errors="replace").splitlines():
        _, found, rest = line.partition(secret)
        if found:
            try:
                return json.loads(rest)
            except ValueError:
                return None
    return None


def _judge(record: dict | None, backstop: bool, supervisor_rc: int | None,
           timeout_s: float) -> tuple[str, int | None, str]:
    """Status, return code and a one-line explanation, from what the supervisor recorded."""
    if backstop:
        return "timeout", None, f"the sandbox did not finish within {timeout_s + GRACE_S:g} s and was killed"
    if record is None:
        return "error", supervisor_rc, f"the sandbox supervisor ended without a record (exit {supervisor_rc})"
    code, sig = record["code"], record["signal"]
    returncode = -sig if sig else code
    if record["timed_out"] or sig == signal.SIGXCPU:
        return "timeout", returncode, f"still running after {timeout_s:g} s (wall clock or CPU time)"
    if record["verdict"] is not None:
        status, phase, detail = (record["verdict"].split(" ", 2) + ["", ""])[:3]
        if status == "passed":
            if code == 0:
                return "passed", returncode, "all tests ran"
            return "error", returncode, f"harness reported a pass but exited with {code}"
        return status, returncode, f"in {phase}: {detail}"
    if sig:
        try:
            name = signal.Signals(sig).name
        except ValueError:  # e.g. a real-time signal
            name = f"signal {sig}"
        return "killed", returncode, f"killed by {name}"
    if not record["ready"]:
        return "error", returncode, "the sandbox failed while setting up (see stderr)"
    return "early_exit", returncode, f"exited with status {code} before the tests finished"


def _tail(f: Any) -> str:
    size = f.seek(0, os.SEEK_END)
    f.seek(max(0, size - TAIL_BYTES))
    text = f.read().decode(errors="replace")
    return f"[... {size - TAIL_BYTES} earlier bytes]\n{text}" if size > TAIL_BYTES else text
