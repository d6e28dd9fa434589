"""What one run in the sandbox gives back (statuses: see the package docstring, cel_utils.sandbox)."""
from __future__ import annotations

from dataclasses import dataclass

STATUSES = ("passed", "failed", "exception", "syntax_error", "early_exit", "timeout", "killed", "error")


@dataclass(frozen=True)
class ExecResult:
    status: str                     # one of STATUSES
    passed: bool
    returncode: int | None          # of the process that ran the candidate; -N for signal N; None if unknown
    duration_s: float               # wall clock, interpreter start-up included
    stdout: str                     # last TAIL_BYTES (cel_utils.sandbox.run)
    stderr: str                     # last TAIL_BYTES, ending with a "[sandbox] ..." note
    protections: tuple[str, ...]    # the layers that were active, see the package docstring
    cpu_s: float | None = None      # CPU time of the process that ran the candidate; None if unknown
