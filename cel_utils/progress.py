"""Progress a person can see, in three modes: ``bars`` (tqdm, for a terminal or an interactive notebook), ``log`` (a
plain line every ``LOG_EVERY_S`` seconds on stderr, for a grid cell's kernel: papermill streams it to the terminal or
the Slurm job's log, and the run page hides stderr) and ``off``. ``True``/``False`` mean ``bars``/``off``. A callable
``sink(done, total)`` in place of a mode receives every step instead (the explorer's progress bar widget)."""
from __future__ import annotations

import sys
import time
from typing import Callable

ProgressSink = Callable[[int, int], None]  # called with (steps done, total steps)

MODES = ("bars", "log", "off")
LOG_EVERY_S = 30.0


def _mode(progress: bool | str) -> str:
    mode = {True: "bars", False: "off"}.get(progress, progress)
    if mode not in MODES:
        raise ValueError(f"unknown progress mode {progress!r}: choose from {', '.join(MODES)} (or True / False)")
    return mode


class LogProgress:
    """tqdm's ``update``/``close`` interface, writing ``[cel] <desc>: n/total, elapsed, ETA`` lines."""

    def __init__(self, total: int, desc: str, unit: str, every_s: float = LOG_EVERY_S, stream=None):
        self.total, self.desc, self.every_s = total, desc, every_s
        self.units = unit + ("es" if unit.endswith(("s", "sh", "ch", "x")) else "s")
        self.stream = stream or sys.stderr
        self.n, self.start = 0, time.perf_counter()
        self.last = self.start
        self._write("started")

    def _write(self, what: str) -> None:
        print(f"[cel] {self.desc}: {what}", file=self.stream, flush=True)

    def update(self, n: int = 1) -> None:
        self.n += n
        now = time.perf_counter()
        if now - self.last >= self.every_s and self.n < self.total:
            self.last = now
            elapsed = now - self.start
            eta = elapsed / self.n * (self.total - self.n) if self.n else float("nan")
            self._write(f"{self.n}/{self.total} {self.units}, {elapsed:.0f} s elapsed, ETA {eta:.0f} s")

    def close(self) -> None:
        self._write(f"{self.n}/{self.total} {self.units} in {time.perf_counter() - self.start:.0f} s")


class SinkProgress:
    """tqdm's ``update``/``close`` interface, handing (done, total) to a callable after every step."""

    def __init__(self, total: int, sink: ProgressSink):
        self.total, self.sink, self.n = total, sink, 0
        sink(0, total)

    def update(self, n: int = 1) -> None:
        self.n += n
        self.sink(self.n, self.total)

    def close(self) -> None:
        self.sink(self.n, self.total)


class _Off:
    def update(self, n: int = 1) -> None:
        pass

    def close(self) -> None:
        pass


def progress_bar(total: int, desc: str, mode: bool | str | ProgressSink = True, unit: str = "eval"):
    """A progress reporter for ``total`` steps in the given mode (nothing for fewer than two steps), or one that
    hands every step to ``mode`` when it is a callable sink."""
    if callable(mode):
        return SinkProgress(total, mode)
    mode = _mode(mode)
    if mode == "off" or total < 2:
        return _Off()
    if mode == "log":
        return LogProgress(total, desc, unit)
    from tqdm.auto import tqdm

    return tqdm(total=total, desc=desc, unit=unit)
