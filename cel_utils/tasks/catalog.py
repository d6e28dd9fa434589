"""Every task by the name a configuration gives it: the built-in ones (:data:`cel_utils.tasks.specs.TASKS`) and
lm-evaluation-harness's (:mod:`cel_utils.tasks.lmeval`). It sits above both, so that the task specs need not import
the adapter that builds on them.
"""
from __future__ import annotations

from cel_utils.tasks.specs import TASKS, TaskSpec


def get_task(name: str) -> TaskSpec:
    """A built-in task by name, or an lm-evaluation-harness task spelled ``lmeval:<name>`` or ``lmeval:<file>.yaml``
    (:mod:`cel_utils.tasks.lmeval`)."""
    if isinstance(name, str) and name.startswith("lmeval:"):
        from cel_utils.tasks.lmeval import lmeval_task  # lm-eval is imported only for its tasks

        return lmeval_task(name)
    if name not in TASKS:
        raise ValueError(f"unknown task {name!r}: choose from {', '.join(TASKS)}, or an lm-evaluation-harness task as "
                         "lmeval:<name> or lmeval:<file>.yaml (`cel list --lmeval <part of a name>` lists them)")
    return TASKS[name]
