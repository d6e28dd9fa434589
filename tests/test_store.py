"""The evaluation store: exact round trips, damaged records recomputed, and the evaluators reading it back."""
import os
import warnings

import numpy as np
import pytest

import cel_utils.evaluation.engine as engine_module
from cel_utils.evaluation.engine import EngineEvaluator
from cel_utils.evaluation.evaluator import NaiveEvaluator
from cel_utils.evaluation.store import EvalStore
from cel_utils.models.heads import HeadId
from cel_utils.tasks.scoring import ContinuationStats
from cel_utils.tasks.splits import load_task_data


def _stats(seed: int, counts) -> list[ContinuationStats]:
    rng = np.random.default_rng(seed)
    out = []
    for n in counts:
        margin = rng.normal(size=n)
        margin[0] = np.nan  # the shortcut stores NaN margins: they must survive too
        out.append(ContinuationStats(ll=rng.normal(size=n) * 1e-3 - 7.0, greedy=rng.random(n) > 0.5, greedy_margin=margin))
    return out


def _same_stats(a: list[ContinuationStats], b: list[ContinuationStats]) -> bool:
    """Bit for bit, NaNs included."""
    return all(x.ll.tobytes() == y.ll.tobytes() and x.greedy_margin.tobytes() == y.greedy_margin.tobytes()
               and np.array_equal(x.greedy, y.greedy) and x.greedy.dtype == y.greedy.dtype for x, y in zip(a, b)) \
        and len(a) == len(b)


def _records(root):
    return sorted(root.rglob("*.rec"))


def test_stats_and_completions_round_trip_exactly(tmp_path):
    context = EvalStore(tmp_path).context({"test": 1})
    counts = [4, 1, 2]
    records = {"(none)": _stats(0, counts), "L0.H1": _stats(1, counts)}
    context.save_stats("batch", counts, records)
    loaded = context.load_stats("batch", counts)
    assert sorted(loaded) == ["(none)", "L0.H1"]
    assert all(_same_stats(records[label], loaded[label]) for label in records)
    assert context.load_stats("other batch", counts) == {}

    texts = {"L1.H0": ["def f():\n\treturn 1\r\n", "ünïcode [DONE]"], "(none)": ["", "x"]}
    context.save_completions("items", texts)
    assert context.load_completions("items", 2) == texts
    assert context.store.counts()["computed"] == 4


def test_contexts_are_separate_and_described(tmp_path):
    store = EvalStore(tmp_path)
    a, b = store.context({"model": "a"}), store.context({"model": "b"})
    assert a.dir != b.dir and store.context({"model": "a"}).dir == a.dir
    assert '"model": "a"' in (a.dir / "context.json").read_text()
    a.save_stats("batch", [1], {"(none)": _stats(0, [1])})
    assert b.load_stats("batch", [1]) == {}


@pytest.mark.parametrize("damage", ["truncate", "flip a byte", "empty", "garbage", "wrong shape"])
def test_a_damaged_record_is_dropped_with_a_warning(tmp_path, damage):
    context = EvalStore(tmp_path).context({"test": 1})
    counts = [2, 3]
    context.save_stats("batch", counts, {"L0.H0": _stats(0, counts)})
    context.save_stats("batch", counts, {"L0.H1": _stats(1, counts)})
    path = _records(tmp_path)[0]
    data = path.read_bytes()
    if damage == "truncate":
        path.write_bytes(data[: len(data) // 2])
    elif damage == "flip a byte":
        path.write_bytes(data[:-5] + bytes([data[-5] ^ 1]) + data[-4:])
    elif damage == "empty":
        path.write_bytes(b"")
    elif damage == "garbage":
        path.write_bytes(os.urandom(300))
    else:  # an intact record that does not fit the batch it is found in
        context.save_stats("other", [5], {"L0.H0": _stats(0, [5])})
        other = next(p for p in _records(tmp_path) if p.parent.name == "other")
        os.replace(other, path)
    with pytest.warns(RuntimeWarning, match="will be recomputed"):
        loaded = context.load_stats("batch", counts)
    assert len(loaded) == 1  # the intact record survives
    assert not path.exists()  # the damaged one is gone, so the next write starts clean


def test_an_unwritable_store_fails_with_the_fix(tmp_path, monkeypatch):
    blocker = tmp_path / "a file"  # a path under a file cannot be created, even by root
    blocker.write_text("")
    with pytest.raises(PermissionError, match=r"is not writable \(Not a directory\): pass a writable directory, or turn"):
        EvalStore(blocker / "store")
    monkeypatch.setenv("CEL_CACHE_DIR", str(blocker))
    with pytest.raises(PermissionError, match=r"set \$CEL_CACHE_DIR to a writable directory, or turn the store off"):
        EvalStore()


# --- the evaluators -------------------------------------------------------------------------------------------

INTERVENTIONS = [(), (HeadId(0, 0),), (HeadId(0, 3),), (HeadId(1, 2),), (HeadId(2, 1),), (HeadId(0, 1), HeadId(2, 3)),
                 (HeadId(1, 0), HeadId(1, 1))]


@pytest.fixture(scope="module")
def hellaswag(data_dir):
    return load_task_data("hellaswag", 6, 3, seed=0, data_dir=data_dir)


def _engine(lm, data, store, **kwargs):
    return EngineEvaluator(lm, data.task, data.discovery, data.fewshot, batch_size=2, token_budget=4096, progress=False,
                           store=store, **kwargs)


def _margins(outcomes):
    return [o.margin.tobytes() for o in outcomes]


def test_engine_reads_everything_back_without_a_forward(tiny_models, hellaswag, tmp_path, monkeypatch):
    lm = tiny_models["llama"]
    fresh = _engine(lm, hellaswag, None).evaluate(INTERVENTIONS)
    store = EvalStore(tmp_path)
    engine = _engine(lm, hellaswag, store)
    first = engine.evaluate(INTERVENTIONS)
    assert _margins(first) == _margins(fresh)  # the store changes nothing it returns
    assert len(engine.batches) >= 3  # batches of at most 2 of the 6 items
    n_evaluations = len(INTERVENTIONS) * len(engine.batches)
    assert store.counts()["computed"] == n_evaluations and store.counts()["read"] == 0
    n_files = len(_records(tmp_path))
    assert n_files < n_evaluations  # one file per forward, not per evaluation

    def no_forward(*args, **kwargs):
        raise AssertionError("a forward ran although everything was stored")

    monkeypatch.setattr(engine_module, "capture_layer_outputs", no_forward)
    again = _engine(lm, hellaswag, store).evaluate(INTERVENTIONS)
    assert _margins(again) == _margins(first)
    assert [o.correct.tolist() for o in again] == [o.correct.tolist() for o in first]
    assert store.counts()["read"] == n_evaluations and len(_records(tmp_path)) == n_files


def test_engine_recomputes_a_damaged_record_and_only_that(tiny_models, hellaswag, tmp_path):
    lm = tiny_models["llama"]
    store = EvalStore(tmp_path)
    first = _engine(lm, hellaswag, store).evaluate(INTERVENTIONS)
    before = {p: p.read_bytes() for p in _records(tmp_path)}
    victim = max(before, key=lambda p: len(before[p]))  # a stacked forward's record
    victim.write_bytes(before[victim][: len(before[victim]) - 7])  # truncated, as by a crash or a full disk
    store.computed = 0
    with pytest.warns(RuntimeWarning, match="checksum does not match"):
        again = _engine(lm, hellaswag, store).evaluate(INTERVENTIONS)
    assert _margins(again) == _margins(first)
    assert {p: p.read_bytes() for p in _records(tmp_path)} == before  # rewritten, bit for bit
    assert 0 < store.computed < len(INTERVENTIONS)  # one forward's interventions, on one batch


def test_a_context_never_mixes_dtype_evaluator_or_prompt(tiny_models, hellaswag, tmp_path):
    lm = tiny_models["llama"]
    store = EvalStore(tmp_path)
    _engine(lm, hellaswag, store).evaluate(INTERVENTIONS[:2])
    NaiveEvaluator(lm, hellaswag.task, hellaswag.discovery, progress=False, store=store).evaluate(INTERVENTIONS[:2])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        _engine(lm, hellaswag, store, fmt="chat").evaluate(INTERVENTIONS[:2])
    contexts = [p for p in tmp_path.iterdir() if p.is_dir()]
    assert len(contexts) == 3 and store.counts()["read"] == 0


def test_naive_evaluator_stores_one_record_per_intervention(tiny_models, hellaswag, tmp_path):
    lm = tiny_models["llama"]
    store = EvalStore(tmp_path)
    naive = lambda: NaiveEvaluator(lm, hellaswag.task, hellaswag.discovery, progress=False, store=store)  # noqa: E731
    first = naive().evaluate(INTERVENTIONS[:3])
    assert len(_records(tmp_path)) == 3
    again = naive().evaluate(INTERVENTIONS[:3] + INTERVENTIONS[:1])  # a repeat is computed once
    assert _margins(again) == _margins(first) + _margins(first[:1]) and store.counts()["read"] == 3


def test_generation_stores_completions(tiny_models, data_dir, tmp_path, monkeypatch):
    import dataclasses

    from cel_utils.evaluation import generation, kinds

    completions_only = dataclasses.replace(kinds.KINDS["generate"], decide=lambda task, requests, completions, **kw: completions)
    monkeypatch.setitem(kinds.KINDS, "generate", completions_only)  # compare the texts, not the sandbox's verdicts
    lm = tiny_models["llama"]
    data = load_task_data("mbpp", 2, 2, seed=0, num_fewshot=0, data_dir=data_dir)
    store = EvalStore(tmp_path)
    make = lambda: EngineEvaluator(lm, data.task, data.discovery, max_new_tokens=5, progress=False, store=store)  # noqa: E731
    first = make().evaluate(INTERVENTIONS[:4])
    monkeypatch.setattr(generation, "generate", lambda *a, **k: pytest.fail("generated although stored"))
    assert make().evaluate(INTERVENTIONS[:4]) == first
    assert store.counts()["read"] == 4


# Settings outside the model's weights that change what the evaluators compute: each must give its own context, so a
# store filled under one is never read under another (issue 26).
def _eager(lm, monkeypatch):
    monkeypatch.setattr(lm.model.config, "_attn_implementation", "eager")


def _torch_upgraded(lm, monkeypatch):
    import torch

    monkeypatch.setattr(torch, "__version__", "99.0")


def _transformers_upgraded(lm, monkeypatch):
    import transformers

    monkeypatch.setattr(transformers, "__version__", "99.0")


@pytest.mark.parametrize("change", [_eager, _torch_upgraded, _transformers_upgraded])
@pytest.mark.parametrize("evaluator", ["engine", "naive"])
def test_the_kernel_and_library_versions_are_in_the_key(tiny_models, hellaswag, tmp_path, monkeypatch, change, evaluator):
    lm = tiny_models["llama"]
    store = EvalStore(tmp_path)
    make = {"engine": lambda: _engine(lm, hellaswag, store),
            "naive": lambda: NaiveEvaluator(lm, hellaswag.task, hellaswag.discovery, progress=False, store=store)}[evaluator]
    make().evaluate(INTERVENTIONS[:2])
    make().evaluate(INTERVENTIONS[:2])
    served = store.counts()["read"]
    assert served > 0  # unchanged: served (the store works)
    change(lm, monkeypatch)
    make().evaluate(INTERVENTIONS[:2])
    assert store.counts()["read"] == served  # computed anew under the changed setting
    assert len([p for p in tmp_path.iterdir() if p.is_dir()]) == 2


def test_decoding_is_keyed_by_the_eos_ids_it_stops_at(tiny_models, data_dir, tmp_path, monkeypatch):
    import dataclasses

    from cel_utils.evaluation import kinds

    completions_only = dataclasses.replace(kinds.KINDS["generate"], decide=lambda task, requests, completions, **kw: completions)
    monkeypatch.setitem(kinds.KINDS, "generate", completions_only)  # the texts, not the sandbox's verdicts
    lm = tiny_models["llama"]
    data = load_task_data("mbpp", 2, 2, seed=0, num_fewshot=0, data_dir=data_dir)
    store = EvalStore(tmp_path)
    make = lambda: EngineEvaluator(lm, data.task, data.discovery, max_new_tokens=3, progress=False, store=store)  # noqa: E731
    make().evaluate(INTERVENTIONS[:2])
    make().evaluate(INTERVENTIONS[:2])
    assert store.counts()["read"] == 2
    # another eos in the generation config (a model's generation_config.json edited, or another tokenizer): decoding
    # may stop elsewhere, so the completions stored under the old ids are not this model's
    monkeypatch.setattr(lm.model.generation_config, "eos_token_id", [5, 7])
    make().evaluate(INTERVENTIONS[:2])
    assert store.counts()["read"] == 2 and store.counts()["computed"] == 4
