"""The sandbox worker's last layers, in the candidate's own interpreter: the audit hook that stands in for missing
kernel layers, and the harness that runs setup, program and tests and writes the verdict (see
cel_utils.evaluation.sandbox for how cheating is scored).

Standard library only, imported by _sandbox_child.py by path before anything is isolated (see its docstring).
"""
from __future__ import annotations

import builtins
import linecache
import os
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
