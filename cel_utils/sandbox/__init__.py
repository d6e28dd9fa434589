"""Run untrusted, model-written Python (MBPP completions) in a separate, locked-down process.

lm-eval's `code_eval` runs candidates in threads of the evaluating process and its own docs call that unsafe.
Here every run is a fresh interpreter (`child.py`: a root-side supervisor and the worker that runs the candidate),
in its own session, with these layers:

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
made inside one (`isolation.py` says how): the candidate still runs as our uid, so read-only mounts, not
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

How cheating is scored, and what is not defended (code written against the harness): see harness.py.

Results are cached on disk (cache.py) by sha256 of SANDBOX_VERSION (a hash of every module of this package), the
Python, the layers a sandbox gets here (`isolation_report`: other users, CEL_SANDBOX_DISABLE or kernels get
others), program, tests, setup and limits. Timeouts and sandbox errors are never cached: how long a program takes
depends on what else the machine runs, and a timeout under load must not become a permanent verdict.

The package, standard library and cel_utils.paths only (tests/test_sandbox_unprivileged.py runs it from a copy that
holds nothing else of the project):
  run.py        run_program, check_mbpp, run_many; isolation_report and the opt-in to best-effort runs
  result.py     ExecResult and its statuses
  cache.py      ExecCache, the results on disk, and SANDBOX_VERSION
  child.py      the supervisor and the worker, a fresh interpreter per run
  isolation.py  the kernel layers, which the worker sets up
  harness.py    the audit hook, running the candidate, and judging the supervisor's record
"""
from cel_utils.sandbox.cache import SANDBOX_VERSION, ExecCache
from cel_utils.sandbox.isolation import GUARDS, unguarded
from cel_utils.sandbox.result import STATUSES, ExecResult
from cel_utils.sandbox.run import (LAYERS, MEMORY_MB, TIMEOUT_S, UNISOLATED_ENV, SandboxWarning, UnisolatedSandboxError,
                                   allow_unisolated, check_mbpp, isolation_report, isolation_warning, run_many,
                                   run_program)

__all__ = ["GUARDS", "LAYERS", "MEMORY_MB", "SANDBOX_VERSION", "STATUSES", "TIMEOUT_S", "UNISOLATED_ENV", "ExecCache",
           "ExecResult", "SandboxWarning", "UnisolatedSandboxError", "allow_unisolated", "check_mbpp",
           "isolation_report", "isolation_warning", "run_many", "run_program", "unguarded"]
