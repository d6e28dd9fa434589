"""Where the package keeps things on disk, and the one way it writes a file.

* :func:`cache_dir`: dequantized checkpoints, the evaluation store and the sandbox's execution cache live under
  ``$CEL_CACHE_DIR``, else ``$XDG_CACHE_HOME/cel-book``, else ``~/.cache/cel-book``.
* :func:`atomic_write`: every file the package writes (artifacts, pages, store records, cache entries) goes to a
  temporary name in the same folder and is renamed over its name, so a reader, or a crash, never sees half a file.
"""
from __future__ import annotations

import errno
import os
import tempfile
from pathlib import Path


def cache_dir() -> Path:
    """``$CEL_CACHE_DIR``, else ``$XDG_CACHE_HOME/cel-book``, else ``~/.cache/cel-book``."""
    if os.environ.get("CEL_CACHE_DIR"):
        return Path(os.environ["CEL_CACHE_DIR"])
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "cel-book"


def atomic_write(path: str | os.PathLike, data: str | bytes, *, durable: bool = False) -> Path:
    """Write ``data`` to ``path`` via a temporary file and a rename, creating the parent folder.

    ``durable`` also fsyncs before the rename (results a user keeps); caches skip it, because a record damaged by a
    power loss is caught by its checksum and recomputed.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    handle, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(handle, "wb") as out:
            out.write(data.encode("utf-8") if isinstance(data, str) else data)
            if durable:
                out.flush()
                os.fsync(out.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


def check_writable(directory: str | os.PathLike, what: str, fix: str) -> Path:
    """Fail before long work starts if files cannot be written into ``directory`` (created later, not here).

    The folder itself, or its nearest existing parent when it does not exist yet, must take a file.
    """
    directory = Path(directory).expanduser()
    existing = directory
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    try:
        if not existing.is_dir():
            raise NotADirectoryError(errno.ENOTDIR, os.strerror(errno.ENOTDIR))
        with tempfile.NamedTemporaryFile(dir=existing, prefix=".write-test."):
            pass
    except OSError as error:
        raise PermissionError(f"{what} {str(directory)!r} is not writable ({error.strerror}): {fix}") from None
    return directory
