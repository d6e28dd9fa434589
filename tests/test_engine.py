"""The fast engine decides exactly as the naive path: every family, every task kind, any batch size."""
import numpy as np
import pytest
import torch

from cel_utils.evaluation.engine import MAX_PADDING, EngineEvaluator
from cel_utils.evaluation.evaluator import NaiveEvaluator
from cel_utils.models.heads import HeadId
from cel_utils.models.plumbing import base_model, capture_layer_outputs, start_at_layer
from cel_utils.models.random_models import FAMILIES
from cel_utils.evaluation.prefix import sliding_window
from cel_utils.tasks.splits import load_task_data

TIE = 1e-4  # |margin| below this is a float tie: either decision is right


def _interventions(geometry):
    last = geometry.n_layers - 1
    return [(), (HeadId(0, 0),), (HeadId(1, 2),), (HeadId(last, geometry.n_heads - 1),),
            (HeadId(0, 1), HeadId(last, 0)), (HeadId(1, 0), HeadId(1, 1), HeadId(2, 3))]


def assert_same_decisions(reference, candidate):
    assert len(reference) == len(candidate)
    for ref, out in zip(reference, candidate):
        assert ref.item_ids == out.item_ids
        clear = np.abs(ref.margin) > TIE
        assert clear.mean() > 0.5, "too many ties for the comparison to mean anything"
        assert np.array_equal(ref.correct[clear], out.correct[clear])
        np.testing.assert_allclose(out.margin, ref.margin, atol=1e-3)


@pytest.fixture(scope="module")
def task_data(data_dir):
    return {task: load_task_data(task, 3, 3, seed=0, num_fewshot=nf, data_dir=data_dir)
            for task, nf in [("arithmetic", 1), ("boolq", 0), ("hellaswag", 0)]}


@pytest.mark.parametrize("family", sorted(FAMILIES))
@pytest.mark.parametrize("task", ["arithmetic", "boolq", "hellaswag"])
def test_engine_matches_naive(tiny_models, task_data, family, task):
    lm, data = tiny_models[family], task_data[task]
    interventions = _interventions(lm.geometry)
    reference = NaiveEvaluator(lm, data.task, data.discovery, data.fewshot, progress=False).evaluate(interventions)
    for batch_size, budget in [(1, 4096), (4, 4096), (4, 64)]:  # budget 64 forces one intervention per forward
        engine = EngineEvaluator(lm, data.task, data.discovery, data.fewshot, batch_size=batch_size,
                                 token_budget=budget, progress=False)
        assert_same_decisions(reference, engine.evaluate(interventions))


def test_boolq_reads_two_vocabulary_rows_and_hellaswag_packs_answers(tiny_models, task_data):
    lm = tiny_models["llama"]
    boolq = EngineEvaluator(lm, task_data["boolq"].task, task_data["boolq"].discovery, progress=False)
    hellaswag = EngineEvaluator(lm, task_data["hellaswag"].task, task_data["hellaswag"].discovery, progress=False)
    assert boolq.shortcut and not hellaswag.shortcut
    for row, request in zip(hellaswag.rows, hellaswag.requests):
        naive_tokens = sum(len(request.context) + len(c) - 1 for c in request.continuations)
        assert len(row.tokens) == naive_tokens - 3 * len(request.context)  # the context once, not four times


@pytest.mark.parametrize("task", ["hellaswag", "arithmetic"])
def test_only_a_kind_that_reads_the_greedy_statistics_gets_them_and_the_log_likelihoods_are_the_same_bits(
        tiny_models, task_data, task):
    import dataclasses

    lm, data = tiny_models["llama"], task_data[task]
    interventions = _interventions(lm.geometry)
    own = EngineEvaluator(lm, data.task, data.discovery, data.fewshot, progress=False)
    forced = EngineEvaluator(lm, data.task, data.discovery, data.fewshot, progress=False)
    forced.kind = dataclasses.replace(forced.kind, reads_greedy=True)  # the engine before multiple choice skipped them
    assert not own.shortcut  # HellaSwag's multi-token answers: the path that scores every vocabulary row
    ours, theirs = ([s for per in e.continuation_stats(interventions) for s in per] for e in (own, forced))
    assert all(x.ll.tobytes() == y.ll.tobytes() for x, y in zip(ours, theirs))
    margins, forced_margins = (np.concatenate([s.greedy_margin for s in stats]) for stats in (ours, theirs))
    assert np.isfinite(forced_margins).all()
    if own.kind.reads_greedy:  # arithmetic: teacher-forced greedy match decides by them
        assert task == "arithmetic" and margins.tobytes() == forced_margins.tobytes()
    else:
        assert task == "hellaswag" and np.isnan(margins).all()


def test_batches_bound_padding_and_cover_every_item_once(tiny_models, data_dir):
    lm = tiny_models["llama"]
    data = load_task_data("boolq", 12, 3, seed=0, data_dir=data_dir)  # passages of very different lengths
    engine = EngineEvaluator(lm, data.task, data.discovery, batch_size=8, progress=False)
    assert sorted(i for batch in engine.batches for i in batch) == list(range(12))
    lengths = [[len(engine.rows[i].tokens) for i in batch] for batch in engine.batches]
    assert len(engine.batches) > 12 // 8 + 1, "these lengths should need more batches than the batch size alone"
    for batch in lengths:
        assert len(batch) <= 8 and min(batch) >= (1 - MAX_PADDING) * max(batch)


@pytest.mark.parametrize("family", ["llama", "gpt2", "gemma3_text"])
def test_replaying_kept_states_reproduces_the_full_forward(tiny_models, family):
    lm = tiny_models[family]
    ids = torch.randint(0, 1000, (2, 7), generator=torch.Generator().manual_seed(0))
    base = base_model(lm.model)
    with torch.no_grad(), capture_layer_outputs(lm.model, [0, 1]) as kept:
        full = base(input_ids=ids).last_hidden_state
    for layer in (1, 2):
        with torch.no_grad(), start_at_layer(lm.model, layer, kept[layer - 1]):
            resumed = base(input_ids=ids).last_hidden_state
        torch.testing.assert_close(resumed, full, rtol=0, atol=1e-6)
    with torch.no_grad():
        torch.testing.assert_close(base(input_ids=ids).last_hidden_state, full, rtol=0, atol=0)  # layers restored


def test_generation_stacks_interventions_without_changing_outputs(tiny_models, data_dir, monkeypatch):
    import dataclasses

    from cel_utils.evaluation import kinds

    completions_only = dataclasses.replace(kinds.KINDS["generate"], decide=lambda task, requests, completions, **kw: completions)
    monkeypatch.setitem(kinds.KINDS, "generate", completions_only)  # compare the texts, not the sandbox's verdicts
    lm = tiny_models["llama"]
    data = load_task_data("mbpp", 2, 2, seed=0, num_fewshot=0, data_dir=data_dir)
    interventions = _interventions(lm.geometry)[:4]
    naive = NaiveEvaluator(lm, data.task, data.discovery, max_new_tokens=6, progress=False)
    engine = EngineEvaluator(lm, data.task, data.discovery, max_new_tokens=6, batch_size=8, progress=False)
    assert engine.evaluate(interventions) == naive.evaluate(interventions)


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_a_shared_few_shot_prefix_is_computed_once_per_head_set_with_the_same_decisions(tiny_models, data_dir, family):
    lm = tiny_models[family]
    data = load_task_data("arithmetic_2da", 4, 3, seed=0, num_fewshot=3, data_dir=data_dir)
    interventions = _interventions(lm.geometry)
    reference = NaiveEvaluator(lm, data.task, data.discovery, data.fewshot, progress=False).evaluate(interventions)
    for batch_size, budget in [(4, 4096), (2, 64)]:
        engine = EngineEvaluator(lm, data.task, data.discovery, data.fewshot, batch_size=batch_size,
                                 token_budget=budget, progress=False)
        windowed = sliding_window(lm) is not None  # sliding-window attention (gemma3, mistral): not reused
        assert (len(engine.prefix) >= 32) != windowed and all(len(r.tokens) < 32 for r in engine.rows) != windowed
        assert_same_decisions(reference, engine.evaluate(interventions))


def test_the_prefix_clean_pass_runs_once_per_call_however_many_forwards(tiny_models, data_dir, monkeypatch):
    import cel_utils.evaluation.engine as engine_module
    import cel_utils.evaluation.guarded as guarded_module
    import cel_utils.evaluation.prefix as prefix_module

    lm = tiny_models["llama"]
    data = load_task_data("arithmetic_2da", 4, 3, seed=0, num_fewshot=3, data_dir=data_dir)
    interventions = _interventions(lm.geometry)
    real, passes, stacked = prefix_module.clean_prefix, [], []
    counted = lambda *args: passes.append(1) or real(*args)  # noqa: E731
    real_states = prefix_module.prefix_states
    for module in (engine_module, guarded_module):  # the engine's forwards, and the guarded precision's pair recheck
        monkeypatch.setattr(module, "clean_prefix", counted)
        monkeypatch.setattr(module, "prefix_states", lambda *a, **k: stacked.append(1) or real_states(*a, **k))
    engine = EngineEvaluator(lm, data.task, data.discovery, data.fewshot, batch_size=2, token_budget=64, progress=False)
    assert len(engine.prefix) >= 32
    engine.continuation_stats(interventions)
    assert len(stacked) > 3 and len(passes) == 1  # many stacked forwards, one clean pass over the prefix
    passes.clear(), stacked.clear()
    guarded_module.pair_stats(engine, [(i, heads) for i in range(len(data.discovery)) for heads in interventions[1:]])
    assert len(stacked) > 3 and len(passes) == 1


def test_out_of_memory_halves_the_token_budget_and_keeps_the_decisions(tiny_models, task_data, monkeypatch):
    import cel_utils.evaluation.engine as engine_module

    lm, data = tiny_models["llama"], task_data["hellaswag"]
    interventions = _interventions(lm.geometry)
    reference = EngineEvaluator(lm, data.task, data.discovery, data.fewshot, progress=False).evaluate(interventions)
    real, calls = engine_module.base_model, []

    def flaky(model):  # the first forward runs out of memory, as a too large stack would on a GPU
        calls.append(1)
        if len(calls) == 1:
            raise torch.OutOfMemoryError("CUDA out of memory (simulated)")
        return real(model)

    monkeypatch.setattr(engine_module, "base_model", flaky)
    engine = EngineEvaluator(lm, data.task, data.discovery, data.fewshot, token_budget=1024, progress=False)
    assert_same_decisions(reference, engine.evaluate(interventions))
    assert engine.budget_halvings == [512] and engine.token_budget == 512


def test_packed_answers_run_in_sdpa_when_the_kernel_takes_no_mask(tiny_models, task_data, monkeypatch):
    from types import SimpleNamespace

    from cel_utils.models import plumbing

    switched = []
    model = SimpleNamespace(config=SimpleNamespace(_attn_implementation="flash_attention_2"))
    model.set_attn_implementation = lambda name: switched.append(name) or setattr(model.config, "_attn_implementation", name)
    monkeypatch.setattr(plumbing, "attention_modules", lambda model: [])  # a stand-in model has no layers to check
    with plumbing.attention_with_mask(model, None):  # no custom mask: the kernel is left alone
        assert model.config._attn_implementation == "flash_attention_2"
    with plumbing.attention_with_mask(model, torch.zeros(1, 1, 2, 2)):  # as if loaded with flash attention (no CUDA)
        assert model.config._attn_implementation == "sdpa"
    assert switched == ["sdpa", "flash_attention_2"]
    eager = tiny_models["llama"]
    data = task_data["hellaswag"]
    interventions = _interventions(eager.geometry)
    reference = NaiveEvaluator(eager, data.task, data.discovery, data.fewshot, progress=False).evaluate(interventions)
    eager.model.set_attn_implementation("eager")  # eager takes the block mask as it is
    try:
        engine = EngineEvaluator(eager, data.task, data.discovery, data.fewshot, progress=False)
        assert_same_decisions(reference, engine.evaluate(interventions))
    finally:
        eager.model.set_attn_implementation("sdpa")
