"""The head explorer: a model, a task's items and a head set, live, in a notebook cell or as a Voila app.

``from cel_utils import explore`` then ``explore(model="smollm2-135m-instruct", task="hellaswag")`` (or
``explore(artifact="results/....json")``) opens it. The layers: :mod:`.session` computes (with the runs' evaluator,
store, ablation and paired test), :mod:`.runs` reads a run's sets from its artifact, :mod:`.render` writes HTML,
:mod:`.widgets` holds the controls and :mod:`.app` the entry point.
"""
import sys
import types


class _CallableModule(types.ModuleType):
    """``cel_utils.explore`` is both this package and the entry point: ``from cel_utils import explore`` finds the
    package (Python binds a package's submodules as its attributes), so the package itself calls through to
    :func:`cel_utils.explore.app.explore`."""

    def __call__(self, *args, **kwargs):
        from cel_utils.explore.app import explore

        return explore(*args, **kwargs)


sys.modules[__name__].__class__ = _CallableModule


def __getattr__(name: str):
    if name == "explore":  # `from cel_utils.explore import explore` also works
        from cel_utils.explore.app import explore

        return explore
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
