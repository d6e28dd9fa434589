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
  no-unix-sockets  a seccomp filter: socket(AF_UNIX) and io_uring fail,    x86_64 or aarch64 (Linux seccomp)
                   so no socket our processes listen on (at a path, which
                   no namespace hides, or abstract) can be reached
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
remain, and the audit hook, best effort and not a security boundary, would be all that stands between the
candidate, running as our own uid, and our files, processes and network. `unguarded` names what only the hook
would protect. Such a run is refused (UnisolatedSandboxError, before any candidate code runs) unless the user
opts in with the environment variable CEL_SANDBOX_UNISOLATED=allow (an environment variable, so that it reaches
worker processes and notebooks); opted in, the first such run of a process warns. `isolation_report()` is what a
run records in its artifact and shows on its page.
We do our own unshare() and mounts (ctypes, as root already did) rather than calling bubblewrap: `bwrap` is often
not installed where researchers run (cluster nodes, laptops) and cannot be installed without root, while every
layer here degrades on its own where a kernel refuses it (bwrap refuses to start instead).
As root without a mount namespace, a Python installed under a directory others cannot enter (pyenv in a 0700
/root, as on our dev machine) leaves no uid drop possible; with one, that directory is covered by an empty tmpfs
and only the Python directories are bound back, in the sandbox's view only. Without a pid namespace, a grandchild
that calls setsid() escapes the final group kill (it keeps the CPU limit). RLIMIT_NPROC counts all of nobody's
processes on the machine (in a user namespace, those of the namespace), so parallel sandboxes as root share those
16. Memory is bounded per process only (RLIMIT_AS); there are no cgroups.
`CEL_SANDBOX_DISABLE=userns,netns,mntns,pidns,ipcns,utsns,uid,seccomp,audit` (any subset) switches layers off, to
test the degraded paths (userns matters only without root, uid only as root) and the kernel layers without the
hook; one that leaves something unguarded needs CEL_SANDBOX_UNISOLATED=allow as well.

Statuses (`ExecResult.status`); only "passed" has `passed=True`:
  passed        setup, program and every test ran, and the harness reported it with this run's secret
  failed        an assert raised AssertionError (normally a test; the stderr note names the phase)
  exception     any other exception: NameError, MemoryError, RecursionError, EOFError from input(), EFBIG...
  syntax_error  setup, program or a test does not compile
  early_exit    the worker ended before the harness reported: sys.exit(), exit(), os._exit(), a tampered pipe
  timeout       the wall-clock limit (timeout_s, from the worker's start) or the CPU-time limit; one that did not
                have the CPU all along runs again at once, alone among our sandboxes, before it is reported
  killed        ended by another signal, e.g. SIGSEGV from a C-level stack overflow
  error         the sandbox itself failed
The last line of `stderr` is a "[sandbox] <status>: <why>" note, e.g. which test failed and how.

How cheating is scored, and what is not defended (code written against the harness): see _sandbox_harness.py.

Results are cached on disk by sha256 of SANDBOX_VERSION (a hash of this file and the _sandbox_*.py beside it),
the Python, the layers a sandbox gets here (`isolation_report`: other users, CEL_SANDBOX_DISABLE or kernels get
others), program, tests, setup and limits. Timeouts and sandbox errors are never cached: how long a program takes
depends on what else the machine runs, and a timeout under load must not become a permanent verdict.
"""
from __future__ import annotations

import hashlib
import json
import os
import secrets
import signal
import subprocess
import sys
import tempfile
import threading
import time
import warnings
from collections.abc import Iterable, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any

from cel_utils.evaluation._sandbox_harness import judge, read_report
from cel_utils.evaluation._sandbox_isolation import GUARDS, remove_tree, unguarded
from cel_utils.paths import atomic_write, cache_dir


def source_version(folder: str | os.PathLike[str] = Path(__file__).parent) -> str:
    """A hash of the sandbox's code in `folder`: sandbox.py and every _sandbox_*.py (child, isolation, harness).
    Part of the cache key, so any change to how programs are run or judged recomputes every result."""
    digest = hashlib.sha256()
    for path in sorted([Path(folder) / "sandbox.py", *Path(folder).glob("_sandbox_*.py")]):
        data = path.read_bytes()  # name and length first, so no two sets of files hash alike
        digest.update(f"{path.name}\0{len(data)}\0".encode() + data)
    return digest.hexdigest()[:16]


SANDBOX_VERSION = source_version()  # derived, never hand-kept: no change can be forgotten
LAYERS = ("userns", "netns", "mntns", "pidns", "ipcns", "utsns", "uid", "seccomp", "audit")  # CEL_SANDBOX_DISABLE
UNISOLATED_ENV = "CEL_SANDBOX_UNISOLATED"  # "allow": run code even where only the audit hook guards something
STATUSES = ("passed", "failed", "exception", "syntax_error", "early_exit", "timeout", "killed", "error")
TAIL_BYTES = 4000   # how much of stdout/stderr a result keeps
GRACE_S = 5.0       # on top of timeout_s before we stop waiting for the supervisor itself
BUSY = 0.9          # a timeout that used this share of timeout_s as CPU time was not starved by load: no retry
_CHILD = Path(__file__).with_name("_sandbox_child.py")
_CHILD_ENV = {"PATH": "/usr/local/bin:/usr/bin:/bin", "LANG": "C.UTF-8"}
_PYTHON = [sys.implementation.name, *sys.version_info]  # what ran the results (the child is sys.executable too)


@dataclass(frozen=True)
class ExecResult:
    status: str                     # see the module docstring
    passed: bool
    returncode: int | None          # of the process that ran the candidate; -N for signal N; None if unknown
    duration_s: float               # wall clock, interpreter start-up included
    stdout: str                     # last TAIL_BYTES
    stderr: str                     # last TAIL_BYTES, ending with a "[sandbox] ..." note
    protections: tuple[str, ...]    # the layers that were active, see the module docstring
    cpu_s: float | None = None      # CPU time of the process that ran the candidate; None if unknown


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
    key = ExecCache.key(program, tests, setup, timeout_s, memory_mb) if store is not None else ""
    if store is not None and (hit := store.get(key)) is not None:
        return hit
    with _gate.shared():
        result = _execute(program, tests, setup, float(timeout_s), int(memory_mb))
    if result.status == "timeout" and (result.cpu_s or 0) < BUSY * timeout_s:
        # shared cores can push an honest program past its limit: once more with none of ours beside it, unless it
        # had the CPU all along (an endless loop). Others' load we cannot stop: hence timeouts are never cached.
        with _gate.alone():
            result = _execute(program, tests, setup, float(timeout_s), int(memory_mb))
    if store is not None and result.status not in ("timeout", "error"):
        store.put(key, result)
    return result


def check_mbpp(completion: str, test_list: Sequence[str], test_setup_code: str = "", *, timeout_s: float = 10.0,
               **kw: Any) -> ExecResult:
    """Score one MBPP completion: its test_setup_code, then the completion, then its asserts."""
    return run_program(completion, test_list, test_setup_code, timeout_s=timeout_s, **kw)


def run_many(jobs: Iterable[Mapping[str, Any]], workers: int = 2, **kw: Any) -> list[ExecResult]:
    """run_program for each job (a mapping of its arguments, overriding `kw`), `workers` sandboxes at a time
    (threads are enough: each only waits for its sandbox process, which does the work)."""
    with ThreadPoolExecutor(max_workers=workers) as pool:
        return list(pool.map(lambda job: run_program(**{**kw, **job}), jobs))


# --- how isolated is the sandbox here? -----------------------------------------------------------------------------

class SandboxWarning(UserWarning):
    """Model-written code runs with only best-effort protection of something (see `unguarded`)."""


class UnisolatedSandboxError(RuntimeError):
    """The sandbox would leave something of GUARDS to the audit hook alone, and the user did not opt in."""


def allow_unisolated() -> bool:
    """Whether the user opted in, with CEL_SANDBOX_UNISOLATED=allow, to runs that only the audit hook guards."""
    value = os.environ.get(UNISOLATED_ENV, "").strip()
    if value not in ("", "allow"):
        raise ValueError(f"{UNISOLATED_ENV}={value!r} is not understood: set it to 'allow' to run model-written code "
                         "where the sandbox has only best-effort protection, or unset it to have such runs refused")
    return value == "allow"


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


class _Gate:
    """Our sandboxes run side by side (`shared`); a timeout's second try (`alone`) waits until none of them runs,
    and holds new ones back until it is done."""

    def __init__(self) -> None:
        self._cond, self._running, self._alone = threading.Condition(), 0, False

    @contextmanager
    def shared(self) -> Iterator[None]:
        with self._cond:
            self._cond.wait_for(lambda: not self._alone)
            self._running += 1
        try:
            yield
        finally:
            with self._cond:
                self._running -= 1
                self._cond.notify_all()

    @contextmanager
    def alone(self) -> Iterator[None]:
        with self._cond:
            self._cond.wait_for(lambda: not self._alone)
            self._alone = True
            self._cond.wait_for(lambda: self._running == 0)
        try:
            yield
        finally:
            with self._cond:
                self._alone = False
                self._cond.notify_all()


_gate = _Gate()
_reports: dict[tuple[int, str], dict] = {}


def isolation_report() -> dict:
    """The layers a sandbox gets here, as this user with this CEL_SANDBOX_DISABLE, from one empty program run
    uncached (once per process): {"protections": [...], "unguarded": [...], "warning": text or None}. A run
    records it in its artifact, and its page shows the warning; the cache keys results by these layers."""
    key = (os.geteuid(), os.environ.get("CEL_SANDBOX_DISABLE", ""))
    if key not in _reports:
        with _gate.shared():  # no model-written code in it, so it runs whatever CEL_SANDBOX_UNISOLATED says
            probe = _execute("", [], "", 10.0, 1024, True)
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
    def key(program: str, tests: Sequence[str], setup: str, timeout_s: float, memory_mb: int,
            protections: Sequence[str] | None = None) -> str:
        """The entry's name; `protections` defaults to the layers a sandbox gets here (`isolation_report`)."""
        if protections is None:
            protections = isolation_report()["protections"]
        blob = json.dumps([SANDBOX_VERSION, _PYTHON, sorted(protections), program, list(tests), setup,
                           float(timeout_s), int(memory_mb)])
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


_FIELD_TYPES = (str, bool, (int, type(None)), (float, int), str, str, tuple, (float, int, type(None)))


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


def _execute(program: str, tests: list[str], setup: str, timeout_s: float, memory_mb: int,
             allow: bool | None = None) -> ExecResult:
    """One run; `allow` overrides CEL_SANDBOX_UNISOLATED (the isolation probe, which runs no candidate code)."""
    secret = secrets.token_hex(16)
    disable = _disabled()
    allow = allow_unisolated() if allow is None else allow
    workdir = tempfile.mkdtemp(prefix="cel-sandbox-")  # used when there is no private /tmp
    start = time.monotonic()
    try:
        with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err, tempfile.TemporaryFile() as report:
            job = {"program": program, "tests": tests, "setup": setup, "timeout_s": timeout_s,
                   "memory_mb": memory_mb, "workdir": workdir, "report_fd": report.fileno(), "secret": secret,
                   "disable": disable, "allow_unisolated": allow}
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
            record = read_report(report.read(), secret)
            status, returncode, note = judge(record, backstop, proc.returncode, timeout_s, GRACE_S)
            protections = tuple(record["layers"]) if record else ()
            if record and (record["verdict"] or "").startswith("refused "):
                # the worker stopped before any candidate code ran
                raise UnisolatedSandboxError(f"refused to run model-written code: {isolation_warning(protections)}. To "
                                             "run it anyway, behind that hook alone, set the environment variable "
                                             f"{UNISOLATED_ENV}=allow (read by every process, notebooks too)")
            if record and record["ready"]:
                _warn_once(protections)
            stderr = _tail(err)
            stderr += ("\n" if stderr and not stderr.endswith("\n") else "") + f"[sandbox] {status}: {note}"
            return ExecResult(status, status == "passed", returncode, round(duration, 4), _tail(out), stderr,
                              protections, record["cpu_s"] if record else None)
    finally:
        if not remove_tree(workdir):
            warnings.warn(f"sandbox: could not remove {workdir}", stacklevel=3)


def _tail(f: Any) -> str:
    size = f.seek(0, os.SEEK_END)
    f.seek(max(0, size - TAIL_BYTES))
    text = f.read().decode(errors="replace")
    return f"[... {size - TAIL_BYTES} earlier bytes]\n{text}" if size > TAIL_BYTES else text
