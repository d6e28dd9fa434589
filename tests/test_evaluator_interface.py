"""One evaluator interface (issue 43): every evaluator the search, the screens and the statistics are handed declares
what they use (``EvaluatorProtocol``), none forwards what it does not declare, and an evaluator made like another
(``sibling``, the screens' one way to make one) carries every setting the other was built with."""
import inspect

import numpy as np
import pytest
import torch

from cel_utils.evaluation.engine import EngineEvaluator
from cel_utils.evaluation.evaluator import Evaluator, EvaluatorProtocol, NaiveEvaluator
from cel_utils.evaluation.guarded import Guard, GuardedEvaluator
from cel_utils.evaluation.means import HeadMeans
from cel_utils.evaluation.outcomes import OutcomeTable, Resampled
from cel_utils.evaluation.precision import bf16_model
from cel_utils.evaluation.store import EvalStore
from cel_utils.search import screening
from cel_utils.search.screening import run_screen
from cel_utils.search.strategies import Ledger
from cel_utils.tasks.splits import load_task_data

RESAMPLE = [4, 4, 0, 2]


@pytest.fixture(scope="module")
def data(data_dir):
    return load_task_data("boolq", 6, 2, seed=0, data_dir=data_dir)


def _unusual(lm, store: EvalStore | None) -> dict:
    """A value other than the default for every keyword setting an engine evaluator takes."""
    geometry = lm.geometry
    means = HeadMeans(torch.zeros(geometry.n_layers, geometry.n_heads * geometry.head_dim), n_items=1, n_tokens=1)
    return dict(fmt="chat", bos="always", batch_size=3, max_new_tokens=7, exec_timeout_s=2.5, exec_memory_mb=512,
                progress=False, store=store, means=means, token_budget=1000, above=bf16_model(lm))


def _keyword_settings(cls: type) -> set[str]:
    """The keyword settings of ``cls``'s constructor, its base classes' included."""
    names = set()
    for klass in cls.__mro__:
        if "__init__" in vars(klass):
            names |= {name for name, parameter in inspect.signature(klass.__init__).parameters.items()
                      if parameter.default is not inspect.Parameter.empty}
    return names - {"fewshot"}  # the items' context, passed with the items


def _carries(sibling: Evaluator, parent: Evaluator) -> None:
    assert type(sibling) is type(parent)
    assert sibling.settings.keys() == parent.settings.keys()
    for name, value in parent.settings.items():
        assert sibling.settings[name] is value, name
    assert (sibling.fmt, sibling.bos, sibling.batch_size, sibling.max_new_tokens, sibling.exec_timeout_s,
            sibling.exec_memory_mb) == ("chat", True, 3, 7, 2.5, 512)
    assert sibling.means is parent.means and sibling.task is parent.task and sibling.fewshot == parent.fewshot


def test_every_evaluator_implements_the_interface_and_forwards_nothing_else(tiny_models, data):
    lm = tiny_models["llama"]
    engine = EngineEvaluator(lm, data.task, data.discovery, progress=False)
    table = OutcomeTable(engine)
    guarded = GuardedEvaluator(engine, EngineEvaluator(lm, data.task, data.discovery, progress=False,
                                                       above=bf16_model(lm)), Guard())
    evaluators = [NaiveEvaluator(lm, data.task, data.discovery, progress=False), engine, table,
                  Resampled(table, RESAMPLE), guarded, OutcomeTable(guarded), Ledger(table)]
    for evaluator in evaluators:
        assert isinstance(evaluator, EvaluatorProtocol), type(evaluator).__name__
        assert not hasattr(type(evaluator), "__getattr__"), type(evaluator).__name__
        assert evaluator.lm is lm and evaluator.task is data.task and evaluator.kind is engine.kind
    for wrapper in (table, guarded, OutcomeTable(guarded), Ledger(table)):
        assert wrapper.items == engine.items and wrapper.requests == engine.requests
        assert wrapper.n_tokens == engine.n_tokens
    view = Resampled(table, RESAMPLE)
    assert view.items == [data.discovery[i] for i in RESAMPLE]
    assert view.requests == [engine.requests[i] for i in RESAMPLE]
    assert view.n_tokens == sum(engine.requests[i].n_tokens for i in RESAMPLE)
    assert view.evaluate_one(()).item_ids == [data.discovery[i].id for i in RESAMPLE]
    with pytest.raises(AttributeError):  # what the interface does not name is not forwarded to the wrapped evaluator
        table.token_budget


@pytest.mark.parametrize("cls", [NaiveEvaluator, EngineEvaluator])
def test_a_sibling_carries_every_setting_its_evaluator_was_built_with(tiny_models, data, tmp_path, cls):
    lm = tiny_models["llama"]
    store = EvalStore(tmp_path)
    settings = _unusual(lm, store)
    parent = cls(lm, data.task, data.discovery, data.fewshot,
                 **{name: value for name, value in settings.items() if name in _keyword_settings(cls)})
    assert set(parent.settings) == _keyword_settings(cls)  # a setting added to a constructor is recorded, so carried
    sub = data.discovery[1:3]
    table = OutcomeTable(parent)
    for made in (parent.sibling(sub), table.sibling(sub), Resampled(table, [1, 2]).sibling()):
        _carries(made, parent)
        assert made.items == sub and made.store is store
    assert parent.sibling(with_store=False).store is None and parent.sibling(with_store=False).items == parent.items
    other = bf16_model(lm)
    assert parent.sibling(lm=other).lm is other
    if cls is EngineEvaluator:
        made = table.sibling(sub)
        assert made.token_budget == 1000 and made.above is settings["above"]
    guarded = GuardedEvaluator(parent, parent, Guard()) if cls is EngineEvaluator else None
    if guarded is not None:  # a guarded evaluator's sibling is fp32's engine: the same decisions, outside the audit
        _carries(OutcomeTable(guarded).sibling(sub), parent)


@pytest.mark.parametrize("method", ["boundary", "bf16"])
def test_the_screens_evaluate_on_siblings_with_every_setting_of_the_run(tiny_models, data, monkeypatch, method):
    """The boundary and bf16 screens build their own evaluators: with the run's settings (an evaluator built otherwise
    dropped the token budget), on fp32's engine under the guarded precision."""
    lm = tiny_models["llama"]
    kwargs = dict(batch_size=3, max_new_tokens=7, exec_timeout_s=2.5, progress=False, token_budget=1000)
    exact = EngineEvaluator(lm, data.task, data.discovery, **kwargs)
    fast = EngineEvaluator(lm, data.task, data.discovery, above=bf16_model(lm), **kwargs)
    made = []

    def single_head_gains(evaluator, heads, desc):
        made.append(evaluator)
        return np.zeros((len(evaluator.items), len(heads)), int), 1.0

    monkeypatch.setattr(screening, "_single_head_gains", single_head_gains)
    run_screen(method, OutcomeTable(GuardedEvaluator(exact, fast, Guard())), candidates=2, items=2)
    (evaluator,) = made
    assert type(evaluator) is EngineEvaluator and evaluator.above is evaluator.lm  # exact, no fast pass
    assert (evaluator.batch_size, evaluator.max_new_tokens, evaluator.exec_timeout_s, evaluator.token_budget) == \
        (3, 7, 2.5, 1000)
    if method == "boundary":
        assert evaluator.lm is lm and len(evaluator.items) == 2
    else:
        assert evaluator.lm.dtype == torch.bfloat16 and evaluator.items == data.discovery
