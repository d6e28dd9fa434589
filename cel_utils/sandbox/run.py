"""Running programs in the sandbox (what it protects, and the statuses: see the package docstring,
cel_utils.sandbox): one at a time or several side by side, a timeout's retry alone, and how isolated a run is here.
"""
from __future__ import annotations

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
from pathlib import Path
from typing import Any

from cel_utils.sandbox.cache import ExecCache
from cel_utils.sandbox.harness import judge, read_report
from cel_utils.sandbox.isolation import GUARDS, remove_tree, unguarded
from cel_utils.sandbox.result import ExecResult

# A program's limits unless the caller gives others. A run's MBPP limits are the settings exec_timeout_s and
# exec_memory_mb (cel_utils.config.RunConfig declares them, with these defaults; this layer cannot import it).
TIMEOUT_S = 10.0    # wall clock from the worker's start; the CPU-time limit follows it (isolation.set_rlimits)
MEMORY_MB = 1024    # address space per process (RLIMIT_AS)
LAYERS = ("userns", "netns", "mntns", "pidns", "ipcns", "utsns", "uid", "seccomp", "audit")  # CEL_SANDBOX_DISABLE
UNISOLATED_ENV = "CEL_SANDBOX_UNISOLATED"  # "allow": run code even where only the audit hook guards something
TAIL_BYTES = 4000   # how much of stdout/stderr a result keeps
GRACE_S = 5.0       # on top of timeout_s before we stop waiting for the supervisor itself
BUSY = 0.9          # a timeout that used this share of timeout_s as CPU time was not starved by load: no retry
_CHILD = Path(__file__).with_name("child.py")
_CHILD_ENV = {"PATH": "/usr/local/bin:/usr/bin:/bin", "LANG": "C.UTF-8"}


def run_program(program: str, tests: Sequence[str] = (), setup: str = "", *, timeout_s: float = TIMEOUT_S,
                memory_mb: int = MEMORY_MB, cache: bool | ExecCache = True) -> ExecResult:
    """Run `setup`, then `program`, then each statement in `tests` in one namespace, in the sandbox."""
    if not isinstance(program, str) or not isinstance(setup, str):
        raise TypeError("program and setup must be strings")
    if isinstance(tests, str):
        raise TypeError("tests must be a sequence of statements, not one string")
    if timeout_s <= 0 or memory_mb <= 0:
        raise ValueError("timeout_s and memory_mb must be positive")
    tests = [str(t) for t in tests]
    store = ExecCache() if cache is True else cache or None
    key = "" if store is None else ExecCache.key(program, tests, setup, timeout_s, memory_mb,
                                                 isolation_report()["protections"])  # the layers a run gets here
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


def check_mbpp(completion: str, test_list: Sequence[str], test_setup_code: str = "", **kw: Any) -> ExecResult:
    """Score one MBPP completion: its test_setup_code, then the completion, then its asserts (`kw`: run_program's)."""
    return run_program(completion, test_list, test_setup_code, **kw)


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
            f"(layers here: {', '.join(protections) or 'none'}; see cel_utils/sandbox/__init__.py)")


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
            probe = _execute("", [], "", TIMEOUT_S, MEMORY_MB, True)
        if probe.status != "passed":  # not remembered: the next call tries again
            return {"protections": [], "unguarded": list(GUARDS),
                    "warning": f"the MBPP sandbox failed to run an empty program: {probe.stderr.splitlines()[-1]}"}
        _reports[key] = {"protections": list(probe.protections), "unguarded": unguarded(probe.protections),
                         "warning": isolation_warning(probe.protections)}
    return _reports[key]


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
