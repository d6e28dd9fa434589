"""cel_utils: Capability Enhancement Localization toolkit.

The subpackages are layers; each imports only from the ones above it in this list:

    checks, paths      one integer check, one way to write a file, one cache folder
    sandbox/           running model-written code (MBPP) in a locked-down process, and its cache (stdlib and paths)
    hardware           the CPU's model and flags, native bf16 and its measured cost on a device
    models/            heads, model plumbing (the intervention site), ablation, loading, random test models
    tasks/             task specs, data and splits, prompts, decisions and metrics
    evaluation/        the task-kind registry, evaluators (naive and the exact engine), generation, store
    search/            ranking, Algorithm 1, attribution patching, other search strategies
    config, presets    RunConfig: every run setting, declared once (checked against the layers above); the presets' tables
    stats/             significance, the random-set null and stability of a run
    pipeline/          one run end to end (run_cel), its artifact and examples, strategies runs, export
    book/              pages from artifacts (run page, results page, plots), titles, the book build
    grid/              a notebook over (model, task, seed) cells, locally or on Slurm
    explore/           the head explorer (ipywidgets; `from cel_utils import explore`), live on a loaded model
    cli                `cel` / `python -m cel_utils`
    theory/            the toy model of the paper's section 4 (stands apart: numpy and sympy only)

``from cel_utils import RunConfig, run_cel, load_model`` gives the three entry points without importing the rest.
"""
import os as _os

# OpenMP busy-waiting threads stall badly when cores are shared (measured up to 20x on 2 cores);
# this must be set before torch is first imported, so it lives at the package root.
_os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

__version__ = "0.2.0"
_ENTRY_POINTS = {"RunConfig": "cel_utils.config", "run_cel": "cel_utils.pipeline.protocol",
                 "load_model": "cel_utils.models.loading"}


def __getattr__(name: str):
    """The entry points, imported on first use (importing the package itself stays cheap: no torch)."""
    if name in _ENTRY_POINTS:
        import importlib

        return getattr(importlib.import_module(_ENTRY_POINTS[name]), name)
    raise AttributeError(f"module 'cel_utils' has no attribute {name!r}")
