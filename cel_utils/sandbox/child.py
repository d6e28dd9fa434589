"""Child side of cel_utils.sandbox; run as `python -I -B child.py` with the job as JSON on stdin.

Standard library only and never imported by the parent: it runs before anything else in a fresh interpreter, and
the worker, once isolated, may not be able to read the project (as `nobody`, or behind a 0700 home). Its two
siblings, isolation.py (the kernel layers) and harness.py (audit hook, running the candidate), are loaded by path
at start-up, while this process can still read them, under private names and without putting their directory on
sys.path, so the candidate's imports resolve as in any isolated interpreter.

Two processes:
  supervisor  this script as started by run.py (own session). It unshares namespaces (inside a new user
              namespace when not root), forks the worker, enforces the wall-clock limit, kills leftovers and
              records how the worker ended.
  worker      pid 1 of a new pid namespace where possible. It builds its private filesystem view, sets rlimits,
              drops to `nobody` (root) or gives up the user namespace's capabilities (otherwise), installs a
              seccomp filter refusing Unix sockets, then runs setup, program and tests in-process and writes the
              verdict; or, where a kernel layer of GUARDS is missing and the user did not opt in
              (CEL_SANDBOX_UNISOLATED=allow), refuses without running any of them.

The worker writes its verdict, "<secret> <status> <phase> <detail>", to a pipe only the supervisor reads, and
only after the candidate code has finished, so nothing the candidate can read during its run holds the secret.
The supervisor keeps the first line carrying the secret and reports everything as one JSON line, prefixed with
the secret, on the report fd that only it holds.
"""
from __future__ import annotations

import importlib.util
import json
import os
import signal
import sys
import time
import traceback


def _sibling(name: str):
    """The module `name`.py beside this file, loaded by path as `_cel_sandbox_<name>` (see above)."""
    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), f"{name}.py")
    spec = importlib.util.spec_from_file_location(f"_cel_sandbox_{name}", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


harness = _sibling("harness")
isolation = _sibling("isolation")


# --- supervisor ---------------------------------------------------------------------------------------------------

def main() -> None:
    job = json.loads(sys.stdin.buffer.read())
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)  # the candidate gets an empty stdin; the job (and its secret) has been consumed
    os.close(null)
    secret, report_fd = job.pop("secret"), job["report_fd"]

    layers = ["session"] + isolation.enter_namespaces(job["disable"])  # session: run.py's start_new_session
    setup_r, setup_w = os.pipe()      # worker -> supervisor: the layers it set up, closed before the candidate runs
    verdict_r, verdict_w = os.pipe()  # worker -> supervisor: the verdict; the candidate cannot read it back
    start = time.monotonic()
    pid = os.fork()
    if pid == 0:
        os.close(setup_r)
        os.close(verdict_r)
        os.close(report_fd)  # only the supervisor talks to the parent
        try:
            _worker(job, secret, setup_w, verdict_w, layers)  # leaves through os._exit
        except BaseException:
            traceback.print_exc()
        os._exit(70)  # the sandbox itself broke before the candidate ran
    os.close(setup_w)
    os.close(verdict_w)
    verdict = _Verdict(secret.encode(), verdict_r)
    status, timed_out, cpu_s = _wait(pid, job["timeout_s"], verdict)
    duration = time.monotonic() - start
    try:
        os.killpg(pid, signal.SIGKILL)  # leftovers in the worker's group (without a pid namespace they may exist)
    except (ProcessLookupError, PermissionError):
        pass
    verdict.drain()
    worker_layers = os.read(setup_r, 1 << 16).decode(errors="replace").split()
    record = {"timed_out": timed_out, "duration_s": round(duration, 4), "cpu_s": round(cpu_s, 4),
              "code": os.WEXITSTATUS(status) if os.WIFEXITED(status) else None,
              "signal": os.WTERMSIG(status) if os.WIFSIGNALED(status) else None,
              "verdict": verdict.line, "ready": bool(worker_layers), "layers": worker_layers or layers}
    os.write(report_fd, f"{secret} {json.dumps(record)}\n".encode())


class _Verdict:
    """Reads the verdict pipe, keeping the first line that starts with the secret.

    The candidate can write to this pipe too, but without the secret its lines are just skipped; it is drained
    while the worker runs, so garbage filling it cannot block the real verdict.
    """

    def __init__(self, secret: bytes, fd: int) -> None:
        self.secret, self.fd, self.buf, self.line = secret, fd, b"", None
        os.set_blocking(fd, False)

    def drain(self, max_chunks: int = 16) -> None:  # bounded: a writer that never stops cannot keep us here
        for _ in range(max_chunks):
            try:
                chunk = os.read(self.fd, 1 << 16)
            except BlockingIOError:
                return
            if not chunk:
                return
            if self.line is None:
                self._scan(self.buf + chunk)

    def _scan(self, buf: bytes) -> None:
        start = buf.find(self.secret)
        if start < 0:
            self.buf = buf[-len(self.secret):]  # the secret may be split across reads
            return
        end = buf.find(b"\n", start)
        if end < 0:
            self.buf = buf[start:start + 4096]  # a verdict line is short; the rest is coming
            return
        self.line = buf[start + len(self.secret):end].decode(errors="replace").strip()


def _wait(pid: int, timeout_s: float, verdict: _Verdict) -> tuple[int, bool, float]:
    """Wait for the worker, killing it at the deadline; polling keeps this obvious and costs nothing measurable.
    Returns its wait status, whether it was killed, and the CPU seconds it used (how much of the machine it got)."""
    deadline = time.monotonic() + timeout_s
    while True:
        verdict.drain()
        done, status, usage = os.wait4(pid, os.WNOHANG)
        if done:
            return status, False, usage.ru_utime + usage.ru_stime
        if time.monotonic() >= deadline:
            os.kill(pid, signal.SIGKILL)  # as pid 1 of its namespace, its death takes every descendant with it
            _, status, usage = os.wait4(pid, 0)
            return status, True, usage.ru_utime + usage.ru_stime
        time.sleep(0.01)


# --- worker ---------------------------------------------------------------------------------------------------------

def _worker(job: dict, secret: str, setup_w: int, verdict_w: int, ns_layers: list[str]) -> None:
    layers = [x for x in ns_layers if x != "pidns" or os.getpid() == 1]
    os.setpgid(0, 0)  # our own group, so the supervisor can kill whatever we leave behind
    os.umask(0o022)
    root = os.geteuid() == 0 and "userns" not in layers
    workdir = isolation.private_filesystem(layers, job["workdir"])
    os.chdir(workdir)
    layers.append("workdir")

    isolation.set_rlimits(job["timeout_s"], job["memory_mb"])
    layers.append("rlimits")

    if root and "uid" not in job["disable"]:
        dirs = isolation.python_dirs()
        if "private-tmp" in layers:
            try:
                isolation.expose(dirs)
            except OSError:
                pass
        if all(isolation.blocker(d) is None for d in dirs):
            isolation.drop_to_nobody(workdir)
            layers.append("uid-nobody")
    if "userns" in layers:
        isolation.drop_capabilities()  # not optional: with them, read-only mounts could be made writable again
        layers.append("no-caps")
    try:
        isolation.prctl(isolation.PR_SET_NO_NEW_PRIVS, 1)
        layers.append("no-new-privs")
    except OSError:
        pass
    if "seccomp" not in job["disable"]:
        try:
            isolation.deny_unix_sockets()
            layers.append("no-unix-sockets")
        except OSError:  # an unknown architecture, or a kernel without seccomp filters
            pass
    try:
        isolation.prctl(isolation.PR_SET_PDEATHSIG, signal.SIGKILL)  # after setresuid, which clears it
        layers.append("pdeathsig")
    except OSError:
        pass
    if os.getppid() == 1 and "pidns" not in layers:
        os._exit(71)  # the supervisor died while we were setting up: nobody would ever kill us

    os.environ.clear()
    os.environ.update(PATH="/usr/local/bin:/usr/bin:/bin", HOME=workdir, TMPDIR=workdir, LANG="C.UTF-8",
                      # a thread per core (numpy's BLAS) would run into RLIMIT_NPROC on a big machine
                      OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1", MKL_NUM_THREADS="1")
    layers.append("env-scrubbed")
    if ("netns" not in layers or "uid-nobody" not in layers) and "audit" not in job["disable"]:
        sys.addaudithook(harness.guard(os.path.realpath(workdir)))
        layers.append("audit-guard")

    os.write(setup_w, " ".join(layers).encode())
    os.close(setup_w)  # closed before the candidate runs
    missing = isolation.unguarded(layers)
    if missing and not job["allow_unisolated"]:
        # decided here, from the layers this very run got, so no candidate ever runs on a stale view of the machine
        os.write(verdict_w, f"{secret} refused - {','.join(missing)}\n".encode())
        os._exit(0)
    harness.run_candidate(job, secret, verdict_w)


if __name__ == "__main__":
    main()
