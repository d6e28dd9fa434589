"""Kernel layers of the sandbox (see cel_utils.sandbox): namespaces, private mounts, the drop to
`nobody` as root, or a user namespace with a read-only filesystem and no capabilities without root; rlimits; a
seccomp filter against Unix sockets. Also GUARDS, which both sides read (the worker refuses to run a candidate
that only the audit hook would guard), and the parent's clean-up of a workdir.

Standard library only: child.py loads this file by path before anything is isolated or any privilege
given up (see its docstring); the project itself is never imported here.

Two ways to the same namespaces:
  root       unshare() each namespace directly; the worker later drops to `nobody`.
  otherwise  first a new user namespace in which our own uid and gid are mapped to themselves (the only mapping an
             ordinary user may write). In it we hold every capability, so the same unshare() calls work; the worker
             uses them to make every inherited mount read-only, then gives all of them up before the candidate runs.
             Whatever we set up stays: mounts that a less privileged namespace inherits are locked by the kernel, so
             even a nested user namespace could not make them writable again (and nested ones are switched off
             where /proc is private).
"""
from __future__ import annotations

import ctypes
import errno
import math
import os
import pwd
import re
import resource
import shutil
import stat
import sys

CLONE_NEWNS, CLONE_NEWUTS, CLONE_NEWIPC = 0x00020000, 0x04000000, 0x08000000
CLONE_NEWUSER, CLONE_NEWPID, CLONE_NEWNET = 0x10000000, 0x20000000, 0x40000000
NAMESPACES = (("netns", CLONE_NEWNET), ("mntns", CLONE_NEWNS), ("pidns", CLONE_NEWPID), ("ipcns", CLONE_NEWIPC),
              ("utsns", CLONE_NEWUTS))
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC, MS_REMOUNT = 1, 2, 4, 8, 32
MS_BIND, MS_REC, MS_PRIVATE = 4096, 16384, 1 << 18
MNT_DETACH = 2
PR_SET_PDEATHSIG, PR_SET_SECCOMP, PR_SET_NO_NEW_PRIVS = 1, 22, 38
CAP_VERSION_3 = 0x20080522
# Covered by a fresh tmpfs: everywhere others could write (so `nobody` writes only throwaway space), and /run, whose
# sockets (the user's session bus, docker, databases) the user namespace's read-only mounts would not refuse.
PRIVATE_TMPFS = ("/tmp", "/var/tmp", "/dev/shm", "/run", "/var/run")
PRIVATE_WORKDIR = "/tmp/work"
NPROC = 16        # processes + threads; also bounds a fork bomb's memory
NOFILE = 256
FSIZE = 16 << 20  # bytes per file, stdout and stderr included: more output fails with EFBIG instead of filling disk

# What model-written code must be kept away from, and the kernel layers that do it (any one of them suffices). The
# worker refuses to run a candidate that leaves any of them to the audit hook alone, unless the user opted in.
GUARDS = {"network": ("netns",), "files": ("uid-nobody", "read-only-root"), "processes": ("pidns", "uid-nobody")}

_libc = ctypes.CDLL(None, use_errno=True)
_libc.mount.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_ulong, ctypes.c_char_p]
_libc.umount2.argtypes = [ctypes.c_char_p, ctypes.c_int]
_libc.prctl.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong]


def _ok(ret: int) -> None:
    if ret != 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))


def _b(s: str | None) -> bytes | None:
    return None if s is None else os.fsencode(s)


def _mount(src: str | None, target: str, fstype: str | None, flags: int, data: str | None = None) -> None:
    _ok(_libc.mount(_b(src), _b(target), _b(fstype), flags, _b(data)))


def prctl(option: int, arg: int) -> None:
    _ok(_libc.prctl(option, arg, 0, 0, 0))


# --- supervisor: namespaces ----------------------------------------------------------------------------------------

def enter_namespaces(disable: list[str]) -> list[str]:
    """New namespaces for the worker about to be forked, one unshare() per namespace so that whatever the machine
    allows is kept. Without root they need a user namespace first; none at all where the kernel refuses one."""
    layers = []
    if os.geteuid() != 0:
        if "userns" in disable or not _user_namespace():
            return layers
        layers.append("userns")
    for name, flag in NAMESPACES:
        if name not in disable:
            try:
                _ok(_libc.unshare(flag))
                layers.append(name)
            except OSError:
                pass
    return layers


def _user_namespace() -> bool:
    """Enter a new user namespace with our uid and gid mapped to themselves; False where the kernel refuses one."""
    uid, gid = os.geteuid(), os.getegid()
    try:
        _ok(_libc.unshare(CLONE_NEWUSER))
    except OSError:
        return False
    # An ordinary user may map only its own ids, and its gid only after giving up setgroups(); a namespace without
    # a mapping cannot be left again, so a failure here is the sandbox's error, not a quiet fallback.
    try:
        _write("/proc/self/setgroups", "deny")
    except FileNotFoundError:  # kernels before 3.19 have no such switch and need none
        pass
    _write("/proc/self/uid_map", f"{uid} {uid} 1")
    _write("/proc/self/gid_map", f"{gid} {gid} 1")
    return True


def _write(path: str, text: str) -> None:
    with open(path, "w") as handle:
        handle.write(text)


def unguarded(protections) -> list[str]:
    """What of GUARDS no kernel layer among `protections` protects: only the best-effort audit hook does."""
    have = set(protections)
    return [what for what, layers in GUARDS.items() if not have.intersection(layers)]


# --- worker: the filesystem ----------------------------------------------------------------------------------------

def private_filesystem(layers: list[str], workdir: str) -> str:
    """In a mount namespace: private mounts, a fresh tmpfs where PRIVATE_TMPFS says (the workdir moves into it),
    a read-only rest of the filesystem in a user namespace, a /proc of our own pid namespace. Appends what worked
    to `layers`; returns the working directory."""
    if "mntns" not in layers:
        return workdir
    try:
        _mount(None, "/", None, MS_REC | MS_PRIVATE)  # nothing mounted below may propagate to the host
    except OSError:
        layers.remove("mntns")
        return workdir
    inherited = mount_points()  # before our own mounts, which are the only writable ones
    covered = _private_tmp()
    if covered:
        layers.append("private-tmp")
        workdir = PRIVATE_WORKDIR
        os.mkdir(workdir, 0o700)
    # As root the uid drop protects files; in a user namespace we are their owner, so only read-only mounts do
    # (and only once the workdir has moved into the private /tmp, or the candidate could not write at all).
    if "userns" in layers and covered and _read_only(inherited, covered):
        layers.append("read-only-root")
    if "pidns" in layers:
        try:
            _mount("proc", "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC)  # hide the host's processes
            layers.append("private-proc")
        except OSError:
            pass
    if "userns" in layers and "private-proc" in layers:
        try:  # per user namespace, and ours: the candidate cannot start a nested one (belt and braces, see above)
            _write("/proc/sys/user/max_user_namespaces", "0")
        except OSError:
            pass
    return workdir


def mount_points(mountinfo: str = "/proc/self/mountinfo") -> list[str]:
    """Every mount point of our mount namespace (mountinfo escapes space, tab, newline and backslash as \\ooo)."""
    with open(mountinfo, "rb") as handle:
        fields = [line.split(b" ")[4] for line in handle if line.strip()]
    return [os.fsdecode(re.sub(rb"\\([0-7]{3})", lambda m: bytes([int(m[1], 8)]), f)) for f in fields]


def _private_tmp() -> list[str]:
    """A fresh tmpfs on each of PRIVATE_TMPFS that exists; the paths covered, or [] when /tmp could not be."""
    covered = []
    for path in PRIVATE_TMPFS:
        if os.path.isdir(path) and not os.path.islink(path):
            try:
                _mount("tmpfs", path, "tmpfs", MS_NOSUID | MS_NODEV, "mode=1777,size=64m,nr_inodes=4096")
                covered.append(path)
            except OSError:
                if path == "/tmp":
                    return []
    return covered


def _read_only(mounts: list[str], covered: list[str]) -> bool:
    """Remount every inherited mount read-only, except those our tmpfs's hide. The kernel refuses to clear a flag
    on a mount inherited from a more privileged namespace, so nosuid, nodev and noexec are passed on as they are.
    A mount point we cannot reach (EACCES, ENOENT) the candidate, holding no capabilities, cannot reach either."""
    keep = MS_NOSUID | MS_NODEV | MS_NOEXEC  # statvfs's ST_NOSUID, ST_NODEV, ST_NOEXEC have the same values
    for path in mounts:
        if any(path == c or path.startswith(c + "/") for c in covered):
            continue
        try:
            flags = os.statvfs(path).f_flag & keep
            _mount(None, path, None, MS_BIND | MS_REMOUNT | MS_RDONLY | flags)
        except OSError as exc:
            if exc.errno not in (errno.EACCES, errno.ENOENT):
                return False
    return True


# --- worker: identity and limits -----------------------------------------------------------------------------------

def set_rlimits(timeout_s: float, memory_mb: int) -> None:
    cpu = math.ceil(timeout_s) + 1  # SIGXCPU at the soft limit, SIGKILL one second later
    for res, soft, hard in ((resource.RLIMIT_CPU, cpu, cpu + 1),
                            (resource.RLIMIT_AS, memory_mb << 20, memory_mb << 20),
                            (resource.RLIMIT_FSIZE, FSIZE, FSIZE),
                            (resource.RLIMIT_NPROC, NPROC, NPROC),  # ignored for root: hence the drop to nobody
                            (resource.RLIMIT_NOFILE, NOFILE, NOFILE),
                            (resource.RLIMIT_CORE, 0, 0)):
        cur_hard = resource.getrlimit(res)[1]
        if cur_hard != resource.RLIM_INFINITY:
            soft, hard = min(soft, cur_hard), min(hard, cur_hard)
        resource.setrlimit(res, (soft, hard))


class _CapHeader(ctypes.Structure):
    _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]


class _CapData(ctypes.Structure):
    _fields_ = [("effective", ctypes.c_uint32), ("permitted", ctypes.c_uint32), ("inheritable", ctypes.c_uint32)]


def drop_capabilities() -> None:
    """Give up every capability the user namespace granted: with CAP_SYS_ADMIN the candidate could remount the
    filesystem writable. Our uid there is not 0, so nothing gives them back (an exec neither, and no-new-privs
    stops setuid files)."""
    _ok(_libc.capset(ctypes.byref(_CapHeader(CAP_VERSION_3, 0)), (_CapData * 2)()))


# seccomp: refuse socket(AF_UNIX). Neither a network namespace (path sockets live in the filesystem) nor a read-only
# mount (connect() is no write) keeps a candidate running as our uid from the sockets our processes listen on, and
# abstract ones are shared wherever the network namespace is not new. socketpair() stays: it reaches nobody else.
# io_uring is refused too (its requests can open sockets without the socket() syscall), and so is the x32 ABI and
# any other architecture's syscalls (int 0x80 from a 64-bit process): the same calls under numbers not checked here.
AUDIT_ARCH = {"x86_64": 0xC000003E, "aarch64": 0xC00000B7}
SYSCALLS = {"x86_64": {"socket": 41, "io_uring_setup": 425}, "aarch64": {"socket": 198, "io_uring_setup": 425}}
SECCOMP_MODE_FILTER, SECCOMP_RET_ALLOW, SECCOMP_RET_KILL_PROCESS = 2, 0x7FFF0000, 0x80000000
SECCOMP_RET_ERRNO = 0x00050000
BPF_LD_W_ABS, BPF_JEQ_K, BPF_JGE_K, BPF_RET_K = 0x20, 0x15, 0x35, 0x06
X32_SYSCALL_BIT, AF_UNIX = 0x40000000, 1


class _SockFilter(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint16), ("jt", ctypes.c_uint8), ("jf", ctypes.c_uint8), ("k", ctypes.c_uint32)]


class _SockFprog(ctypes.Structure):
    _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.POINTER(_SockFilter))]


def deny_unix_sockets() -> None:
    """Install the seccomp filter above (after no-new-privs, which lets an unprivileged process install one).
    Raises OSError where this machine's architecture is not one we know the syscall numbers of."""
    machine = os.uname().machine
    if machine not in AUDIT_ARCH:
        raise OSError(errno.ENOSYS, f"no seccomp filter for {machine}")
    nr = SYSCALLS[machine]
    allow, eafnosupport = SECCOMP_RET_ALLOW, SECCOMP_RET_ERRNO | errno.EAFNOSUPPORT
    prog = [  # (code, jump if true, jump if false, k); seccomp_data: nr at 0, arch at 4, args[0] (low half) at 16
        (BPF_LD_W_ABS, 0, 0, 4),
        (BPF_JEQ_K, 1, 0, AUDIT_ARCH[machine]),
        (BPF_RET_K, 0, 0, SECCOMP_RET_KILL_PROCESS),         # a foreign architecture's syscall
        (BPF_LD_W_ABS, 0, 0, 0),
        (BPF_JGE_K, 0, 1, X32_SYSCALL_BIT),
        (BPF_RET_K, 0, 0, SECCOMP_RET_ERRNO | errno.ENOSYS),  # x32 numbering
        (BPF_JEQ_K, 0, 1, nr["io_uring_setup"]),
        (BPF_RET_K, 0, 0, SECCOMP_RET_ERRNO | errno.EPERM),
        (BPF_JEQ_K, 0, 3, nr["socket"]),
        (BPF_LD_W_ABS, 0, 0, 16),
        (BPF_JEQ_K, 0, 1, AF_UNIX),
        (BPF_RET_K, 0, 0, eafnosupport),
        (BPF_RET_K, 0, 0, allow),
    ]
    program = (_SockFilter * len(prog))(*[_SockFilter(*ins) for ins in prog])
    fprog = _SockFprog(len(prog), ctypes.cast(program, ctypes.POINTER(_SockFilter)))
    _ok(_libc.prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER, ctypes.addressof(fprog), 0, 0))


def drop_to_nobody(workdir: str) -> None:
    nobody = _nobody()
    os.chown(workdir, nobody.pw_uid, nobody.pw_gid)
    os.setgroups([])
    os.setresgid(nobody.pw_gid, nobody.pw_gid, nobody.pw_gid)
    os.setresuid(nobody.pw_uid, nobody.pw_uid, nobody.pw_uid)


def _nobody() -> pwd.struct_passwd:
    try:
        return pwd.getpwnam("nobody")
    except KeyError:
        return pwd.struct_passwd(("nobody", "x", 65534, 65534, "", "/nonexistent", "/bin/false"))


def python_dirs() -> list[str]:
    """The directories imports read from; `nobody` must be able to reach them or every import fails."""
    dirs = sorted({os.path.realpath(p) for p in sys.path if p and os.path.isdir(p)})
    return [d for d in dirs if not any(d.startswith(o + "/") for o in dirs)]


def blocker(path: str) -> str | None:
    """The outermost directory on the way to `path` that others may not enter, or None when there is none."""
    cur = "/"
    for part in path.strip("/").split("/"):
        cur = os.path.join(cur, part)
        if not os.stat(cur).st_mode & stat.S_IXOTH:
            return cur
    return None if os.stat(path).st_mode & stat.S_IROTH else path


def expose(dirs: list[str]) -> None:
    """Make python dirs under an unenterable directory (pyenv in a 0700 /root) reachable, in our namespace only.

    Each dir is parked on a bind mount in the private /tmp, the blocking directory is covered by an empty tmpfs
    (which also hides its other contents), and the dir is bound back at its old path.
    """
    blocked = [(d, b) for d in dirs if (b := blocker(d)) is not None]
    if not blocked or any(d == b for d, b in blocked):
        return
    parked = []
    for i, (d, _) in enumerate(blocked):
        spot = f"/tmp/.python-{i}"
        os.mkdir(spot)
        _mount(d, spot, None, MS_BIND | MS_REC)
        parked.append((d, spot))
    covered: list[str] = []
    for b in sorted({b for _, b in blocked}, key=len):
        if not any(b == c or b.startswith(c + "/") for c in covered):
            _mount("tmpfs", b, "tmpfs", MS_NOSUID | MS_NODEV, "mode=755,size=1m")
            covered.append(b)
    for d, spot in parked:
        os.makedirs(d, exist_ok=True)
        _mount(spot, d, None, MS_BIND | MS_REC)
        _ok(_libc.umount2(_b(spot), MNT_DETACH))
        os.rmdir(spot)


# --- parent: cleaning up -------------------------------------------------------------------------------------------

def remove_tree(path: str) -> bool:
    """Remove the workdir of a run without a private /tmp; False when something of it is left."""
    shutil.rmtree(path, ignore_errors=True)
    if os.path.exists(path):
        # without root the candidate ran as us and may have made directories unreadable (chmod 0): undo that,
        # never following symlinks it may have left, and try again
        _chmod_dir(path)
        for dirpath, dirnames, _ in os.walk(path):
            for name in dirnames:
                _chmod_dir(os.path.join(dirpath, name))  # before os.walk descends into it
        shutil.rmtree(path, ignore_errors=True)
    return not os.path.exists(path)


def _chmod_dir(path: str) -> None:
    if not os.path.islink(path):
        try:
            os.chmod(path, 0o700)
        except OSError:
            pass
