"""How a grid cell's notebook kernel is started and where its printed output goes (papermill options).

* Encrypted kernel traffic where the kernel supports it. The kernel talks to papermill over TCP on localhost, and
  ipykernel warns on every start that this is "running over TCP without encryption": true on a shared cluster node,
  where other users' processes can reach this node's localhost ports. jupyter_client (8.10 and later) provisions
  CurveZMQ keys for kernels whose kernelspec declares support (ipykernel's does), which encrypts the traffic and ends
  the warning at its cause. Where jupyter_client or libzmq cannot, the kernel starts as before.
* What the notebook prints (its stages and progress lines) goes to this process's stdout and stderr as it is printed,
  when asked: a local grid run with progress on asks (``make book`` shows each run's stages under the grid's bar), and
  so does every submitit and Slurm job (there it is the job's log).
"""
from __future__ import annotations

import sys
from typing import Any


def papermill_options(stream: bool = False) -> dict[str, Any]:
    """Keyword arguments for ``papermill.execute_notebook``; with ``stream``, the kernel's output streams here."""
    options: dict[str, Any] = {}
    if _can_encrypt():
        from traitlets.config import Config

        options["config"] = Config({"KernelManager": {"transport_encryption": "auto"}})
    if stream:
        options.update(stdout_file=_AroundBars(sys.stdout), stderr_file=_AroundBars(sys.stderr))
    return options


class _AroundBars:
    """Where papermill writes the kernel's output: through ``tqdm.write``, which clears a progress bar drawn in the same
    terminal (the grid's) before the text and draws it again after, instead of the text landing on the bar's line."""

    def __init__(self, stream):
        self.stream = stream

    def write(self, text: str) -> None:
        from tqdm import tqdm

        tqdm.write(text, file=self.stream, end="")

    def flush(self) -> None:
        self.stream.flush()


def _can_encrypt() -> bool:
    import zmq
    from jupyter_client.manager import KernelManager

    return "transport_encryption" in KernelManager.class_trait_names() and bool(zmq.has("curve"))
