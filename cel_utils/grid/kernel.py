"""How a grid cell's notebook kernel is started and where its printed output goes (papermill options).

* Encrypted kernel traffic where the kernel supports it. The kernel talks to papermill over TCP on localhost, and
  ipykernel warns on every start that this is "running over TCP without encryption": true on a shared cluster node,
  where other users' processes can reach this node's localhost ports. jupyter_client (8.10 and later) provisions
  CurveZMQ keys for kernels whose kernelspec declares support (ipykernel's does), which encrypts the traffic and ends
  the warning at its cause. Where jupyter_client or libzmq cannot, the kernel starts as before.
* With ``$CEL_STREAM_NOTEBOOK_OUTPUT`` set (every submitit and Slurm job sets it), what the notebook prints (its
  stages and progress) goes to this process's stdout and stderr as it is printed: in a job, that is the job's log.
"""
from __future__ import annotations

import os
import sys
from typing import Any

STREAM_ENV = "CEL_STREAM_NOTEBOOK_OUTPUT"


def papermill_options() -> dict[str, Any]:
    """Keyword arguments for ``papermill.execute_notebook``."""
    options: dict[str, Any] = {}
    if _can_encrypt():
        from traitlets.config import Config

        options["config"] = Config({"KernelManager": {"transport_encryption": "auto"}})
    if os.environ.get(STREAM_ENV):
        options.update(stdout_file=sys.stdout, stderr_file=sys.stderr)
    return options


def _can_encrypt() -> bool:
    import zmq
    from jupyter_client.manager import KernelManager

    return "transport_encryption" in KernelManager.class_trait_names() and bool(zmq.has("curve"))
