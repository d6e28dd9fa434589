"""The sandbox worker's last layers, in the candidate's own interpreter: the audit hook that stands in for missing
kernel layers, and the harness that runs setup, program and tests and writes the verdict (statuses: see
cel_utils.sandbox).

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

Standard library only, loaded by child.py by path before anything is isolated (see its docstring); run.py imports
it too, for `judge`, which turns the supervisor's record into a status by the rules above.
"""
from __future__ import annotations

import builtins
import json
import linecache
import os
import signal
import sys
import threading
import traceback
import types

# --- the audit hook -----------------------------------------------------------------------------------------------

# event -> ((index of a path argument, index of its dir_fd argument or None), ...), from the audit events table
PATH_EVENTS = {
    "os.remove": ((0, 1),), "os.rmdir": ((0, 1),), "os.mkdir": ((0, 2),), "os.chmod": ((0, 2),),
    "os.chown": ((0, 3),), "os.utime": ((0, 3),), "os.rename": ((0, 2), (1, 3)), "os.link": ((0, 2), (1, 3)),
    "os.symlink": ((1, 2),), "os.truncate": ((0, None),), "os.setxattr": ((0, None),),
    "os.removexattr": ((0, None),),
}
DENIED_EVENTS = {"socket.__new__", "socket.connect", "socket.bind", "subprocess.Popen", "os.system", "os.exec",
                 "os.posix_spawn", "os.spawn", "os.fork", "os.forkpty", "os.kill", "os.killpg", "signal.pthread_kill"}


def guard(workdir: str):
    """Audit hook for when the candidate runs as our own uid or with our network: standing in for the kernel layers
    we could not get, or on top of a user namespace's.

    Best effort only (PEP 578 hooks are not a security boundary): it refuses sockets, new processes, signals,
    ctypes and any file change outside the working directory.
    """
    write_flags = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND
    # bound now, so that patching os.path later cannot blind the hook
    realpath, join, fsdecode, fspath, devnull = os.path.realpath, os.path.join, os.fsdecode, os.fspath, os.devnull
    isinstance_, PermissionError_ = isinstance, PermissionError

    def inside(path, dir_fd=None) -> bool:
        if isinstance_(path, int):
            return True  # an fd we already hold
        p = fsdecode(fspath(path))
        if isinstance_(dir_fd, int) and dir_fd >= 0 and not p.startswith("/"):  # events show "none" as -1
            p = join(realpath(f"/proc/self/fd/{dir_fd}"), p)
        p = realpath(p)
        return p == workdir or p.startswith(workdir + "/") or p == devnull

    def hook(event: str, args: tuple) -> None:
        if event.startswith("ctypes.") or event in DENIED_EVENTS:
            raise PermissionError_(f"sandbox: {event} is not allowed")
        if event == "import" and args[0] in ("_posixsubprocess", "_ctypes"):
            raise PermissionError_(f"sandbox: importing {args[0]} is not allowed")
        if event == "open":
            path, mode, flags = args
            if any(c in (mode or "") for c in "wax+") or (flags or 0) & write_flags:
                # os.open (mode None) may carry a dir_fd the event does not show: only absolute paths then
                relative = not isinstance_(path, int) and not fsdecode(fspath(path)).startswith("/")
                if (mode is None and relative) or not inside(path):
                    raise PermissionError_(f"sandbox: writing {path!r} is not allowed")
        elif event in PATH_EVENTS:
            for i, fd_i in PATH_EVENTS[event]:
                if i < len(args) and not inside(args[i], None if fd_i is None or fd_i >= len(args) else args[fd_i]):
                    raise PermissionError_(f"sandbox: {event} outside the working directory is not allowed")
    return hook


# --- running the candidate ------------------------------------------------------------------------------------------

def run_candidate(job: dict, secret: str, verdict_fd: int) -> None:
    """Run setup, program and each test in one namespace; write the verdict only after the last one returned.

    Everything the verdict depends on is bound here, before any candidate code runs: patching builtins, os,
    exec or the exception classes afterwards changes nothing below.
    """
    write, exit_, exec_, compile_, fstat = os.write, os._exit, builtins.exec, builtins.compile, os.fstat
    pipe_id = (fstat(verdict_fd).st_dev, fstat(verdict_fd).st_ino)
    AssertionError_, SystemExit_, BaseException_, SyntaxError_ = AssertionError, SystemExit, BaseException, SyntaxError
    settrace, setprofile, thread_settrace = sys.settrace, sys.setprofile, threading.settrace
    builtins_module, saved_builtins = builtins, dict(builtins.__dict__)
    stdout, stderr = sys.stdout, sys.stderr
    stdout.reconfigure(line_buffering=True)  # what was printed before a kill still shows up

    def verdict(status: str, phase: str, exc: BaseException | None) -> None:
        detail = ""
        if exc is not None:
            try:
                # the first frame is this harness: leave it out; a syntax error needs no stack at all
                tb = None if isinstance(exc, SyntaxError_) else exc.__traceback__.tb_next
                traceback.print_exception(type(exc), exc, tb, file=stderr)
                detail = traceback.format_exception_only(type(exc), exc)[-1]
            except BaseException_:
                detail = "<unprintable exception>"
            detail = detail if type(detail) is str else "<unprintable exception>"
        for stream in (stdout, stderr):
            try:
                stream.flush()
            except BaseException_:
                pass
        detail = " ".join(detail.split())[:500]
        try:
            st = fstat(verdict_fd)
        except BaseException_:
            exit_(72)
        if (st.st_dev, st.st_ino) != pipe_id:
            exit_(72)  # the candidate put its own pipe on our fd to catch the secret: it gets no verdict at all
        write(verdict_fd, f"{secret} {status} {phase or '-'} {detail}\n".encode())
        exit_(0)

    sources = [("setup", job["setup"]), ("program", job["program"])]
    sources += [(f"test{i + 1}", t) for i, t in enumerate(job["tests"])]
    codes = []
    for phase, src in sources:
        linecache.cache[f"<{phase}>"] = (len(src), None, src.splitlines(True), f"<{phase}>")  # for tracebacks
        try:
            codes.append((phase, compile_(src, f"<{phase}>", "exec")))
        except (SyntaxError, ValueError) as exc:  # ValueError: source with NUL bytes
            verdict("syntax_error", phase, exc)

    module = types.ModuleType("__candidate__")  # not __main__: like lm-eval, `if __name__ == "__main__"` stays off
    sys.modules["__candidate__"] = module
    phase = ""
    try:
        for phase, code in codes:
            if phase.startswith("test"):
                # undo what the program may have done to make a false assert pass
                builtins_module.__dict__.clear()
                builtins_module.__dict__.update(saved_builtins)
                module.__dict__["__builtins__"] = builtins_module
                settrace(None)
                setprofile(None)
                thread_settrace(None)
            exec_(code, module.__dict__)
    except AssertionError_ as exc:
        verdict("failed", phase, exc)
    except SystemExit_ as exc:
        verdict("early_exit", phase, exc)
    except BaseException_ as exc:
        verdict("exception", phase, exc)
    verdict("passed", "", None)


# --- judging, in the parent (run.py) ---------------------------------------------------------------------------------

def read_report(data: bytes, secret: str) -> dict | None:
    """The supervisor's record: the first line carrying this run's secret."""
    for line in data.decode(errors="replace").splitlines():
        _, found, rest = line.partition(secret)
        if found:
            try:
                return json.loads(rest)
            except ValueError:
                return None
    return None


def judge(record: dict | None, backstop: bool, supervisor_rc: int | None,
          timeout_s: float, grace_s: float) -> tuple[str, int | None, str]:
    """Status, return code and a one-line explanation, from what the supervisor recorded (run.py: `backstop`
    means it killed the supervisor itself, timeout_s + grace_s after starting it)."""
    if backstop:
        return "timeout", None, f"the sandbox did not finish within {timeout_s + grace_s:g} s and was killed"
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
