"""``explore(...)``: the one call that opens the explorer in a notebook cell, and the Voila app's reading of its
environment variables (``make explore``)."""
from __future__ import annotations

import os
from pathlib import Path
from typing import Mapping

from cel_utils.config import DEFAULT_MODEL
from cel_utils.explore.session import ExploreSession
from cel_utils.explore.widgets import Explorer
from cel_utils.models.loading import LoadedModel

# What the Voila app (notebooks/explore.ipynb) reads, each naming one argument of explore()
ENVIRONMENT = {"CEL_EXPLORE_MODEL": "model", "CEL_EXPLORE_TASK": "task", "CEL_EXPLORE_SEED": "seed",
               "CEL_EXPLORE_PRESET": "preset", "CEL_EXPLORE_ARTIFACT": "artifact"}


def explore(model: str = DEFAULT_MODEL, task: str = "hellaswag", seed: int = 0, preset: str = "cpu", *,
            artifact: str | Path | None = None, lm: LoadedModel | None = None, **settings) -> Explorer:
    """The head explorer for ``model`` on ``task`` with the settings a run of (model, task, seed, preset) uses (any
    other run setting may be given); with ``artifact``, for the run that wrote it: its settings, items and sets.
    ``lm``: an already loaded model (it must be the one ``model`` names)."""
    from transformers.utils import logging

    # the loader's progress bars would stay on the app's page above the explorer
    shown = logging.is_progress_bar_enabled()
    logging.disable_progress_bar()
    try:
        if artifact is not None:
            return Explorer(ExploreSession.from_artifact(artifact, lm), artifact=str(artifact))
        return Explorer(ExploreSession.open(model, task, seed, preset, lm, **settings))
    finally:
        if shown:
            logging.enable_progress_bar()


def arguments_from_environment(env: Mapping[str, str] | None = None) -> dict:
    """explore()'s arguments from ``CEL_EXPLORE_*`` variables (unset or empty: the default)."""
    env = os.environ if env is None else env
    args = {name: env[var] for var, name in ENVIRONMENT.items() if env.get(var)}
    if "seed" in args:
        try:
            args["seed"] = int(args["seed"])
        except ValueError:
            raise ValueError(f"CEL_EXPLORE_SEED={args['seed']!r} is not a whole number: set it to a seed, e.g. 0") from None
    return args
