"""Clean passes kept across calls (cel_utils.evaluation.clean_passes): a later call that starts from states an earlier
call's clean pass kept skips its own clean pass and computes the same bits; anything else runs as before."""
import json

import numpy as np
import pytest

import cel_utils.evaluation.engine as engine_module
from cel_utils.evaluation.clean_passes import CleanPasses
from cel_utils.evaluation.engine import EngineEvaluator
from cel_utils.evaluation.means import compute_means
from cel_utils.models.heads import HeadId
from cel_utils.tasks.splits import load_task_data


@pytest.fixture(scope="module")
def tasks(data_dir):
    return {task: load_task_data(task, 5, 6, seed=0, num_fewshot=nf, data_dir=data_dir)
            for task, nf in [("arithmetic_2da", 3), ("boolq", 0), ("hellaswag", 0)]}


@pytest.fixture
def clean_pass_count(monkeypatch):
    """How many clean passes the engine ran (each captures its layer outputs once)."""
    runs = []
    real = engine_module.capture_layer_outputs
    monkeypatch.setattr(engine_module, "capture_layer_outputs", lambda *a, **k: runs.append(1) or real(*a, **k))
    return runs


def same_bits(a, b) -> bool:
    return all(np.array_equal(x.ll, y.ll) and np.array_equal(x.greedy, y.greedy)
               and np.array_equal(x.greedy_margin, y.greedy_margin, equal_nan=True)
               for xs, ys in zip(a, b) for x, y in zip(xs, ys))


def engine(lm, data, items=None, **kwargs):
    return EngineEvaluator(lm, data.task, data.discovery if items is None else items, data.fewshot, batch_size=2,
                           token_budget=256, progress=False, **kwargs)


@pytest.mark.parametrize("family", ["llama", "gemma3_text"])  # gemma3: a mask per layer type, no shared prefix
@pytest.mark.parametrize("task", ["arithmetic_2da", "boolq", "hellaswag"])
def test_a_later_call_starts_from_the_kept_states_with_the_same_bits(tiny_models, tasks, family, task,
                                                                     clean_pass_count):
    lm, data = tiny_models[family], tasks[task]
    first = [(), (HeadId(1, 0),), (HeadId(2, 1),)]
    later = [(HeadId(1, 2),), (HeadId(1, 1), HeadId(2, 0)), (HeadId(2, 3),)]  # start at layers 1 and 2, as first's
    kept = CleanPasses()
    engine(lm, data, clean_passes=kept).continuation_stats(first)
    batches = len(engine(lm, data).batches)
    assert len(clean_pass_count) == batches and kept.bytes > 0
    clean_pass_count.clear()
    reused = engine(lm, data, clean_passes=kept).continuation_stats(later)
    assert clean_pass_count == [] and kept.reused == batches  # no clean pass ran
    assert same_bits(reused, engine(lm, data).continuation_stats(later))
    # a mean-ablated call (the control's) starts from the same states
    means = compute_means(lm, [r.context for r in engine(lm, data).requests])
    clean_pass_count.clear()
    assert same_bits(mean_stats(lm, data, means, later, kept), mean_stats(lm, data, means, later, None))
    assert len(clean_pass_count) == batches  # the second call's only


def mean_stats(lm, data, means, interventions, kept):
    evaluator = engine(lm, data, clean_passes=kept, means=means)
    with evaluator.ablation():
        return evaluator.continuation_stats(interventions)


def test_a_call_that_needs_other_states_or_other_inputs_runs_its_clean_pass(tiny_models, tasks, clean_pass_count):
    lm, data = tiny_models["llama"], tasks["hellaswag"]
    kept = CleanPasses()
    engine(lm, data, clean_passes=kept).continuation_stats([(HeadId(2, 0),)])
    batches = len(clean_pass_count)
    for items, interventions in [(None, [(HeadId(1, 0),)]),  # a layer no earlier pass kept
                                 (None, [(), (HeadId(2, 1),)]),  # the full model: the clean pass is what it scores
                                 (data.holdout, [(HeadId(2, 1),)])]:  # other items: other inputs, another key
        clean_pass_count.clear()
        stats = engine(lm, data, items, clean_passes=kept).continuation_stats(interventions)
        assert len(clean_pass_count) == len(engine(lm, data, items).batches)
        assert same_bits(stats, engine(lm, data, items).continuation_stats(interventions))
    assert batches and kept.reused == 0


def test_what_does_not_fit_is_not_kept(tiny_models, tasks, clean_pass_count):
    lm, data = tiny_models["llama"], tasks["boolq"]
    roomy = CleanPasses()
    engine(lm, data, clean_passes=roomy).continuation_stats([(HeadId(1, 0),), (HeadId(2, 0),)])
    first_batch = sum(state.numel() * state.element_size() for state in next(iter(roomy.entries.values())).values())
    tight = CleanPasses(max_bytes=first_batch)  # room for the first batch's states alone
    engine(lm, data, clean_passes=tight).continuation_stats([(HeadId(1, 0),), (HeadId(2, 0),)])
    batches = len(engine(lm, data).batches)
    assert batches > 1 and tight.bytes == first_batch and tight.declined > 0
    clean_pass_count.clear()
    stats = engine(lm, data, clean_passes=tight).continuation_stats([(HeadId(2, 3),)])
    assert tight.reused == 1 and len(clean_pass_count) == batches - 1
    assert same_bits(stats, engine(lm, data).continuation_stats([(HeadId(2, 3),)]))
    tight.clear()
    assert tight.bytes == 0 and not tight.entries


@pytest.mark.parametrize("family", ["llama", "gemma3_text"])
def test_a_recheck_after_the_fast_pass_starts_from_its_kept_states_with_the_same_bits(tiny_models, tasks, family,
                                                                                      clean_pass_count):
    """The guarded precision recomputes, after its fast pass, the pairs a band widened by a later batch takes in
    (guarded.pair_stats): from the states the fast pass kept, not from a clean pass of each batch again."""
    from cel_utils.evaluation import guarded
    from cel_utils.evaluation.precision import bf16_model

    lm, data = tiny_models[family], tasks["boolq"]
    interventions = [(HeadId(1, 0),), (HeadId(2, 1),), (HeadId(1, 2), HeadId(2, 0))]
    kept = CleanPasses()
    engine(lm, data, clean_passes=kept, above=bf16_model(lm)).continuation_stats(interventions)  # the fast pass
    pairs = [(i, heads) for i in range(len(data.discovery)) for heads in interventions]
    clean_pass_count.clear()
    reused = guarded.pair_stats(engine(lm, data, clean_passes=kept), pairs)
    batches = len(engine(lm, data).batches)
    assert batches > 1 and clean_pass_count == [] and kept.reused == batches
    fresh = guarded.pair_stats(engine(lm, data), pairs)
    assert len(clean_pass_count) == batches  # without kept states, a clean pass per batch
    assert same_bits([reused], [fresh])


def test_another_model_is_never_served_a_models_states(tiny_models, tasks):
    """Siblings carry the kept passes to other models (a bf16 copy, for a screen): those get states of their own."""
    import copy
    import dataclasses

    lm, data = tiny_models["llama"], tasks["boolq"]
    other = dataclasses.replace(lm, model=copy.deepcopy(lm.model))
    for parameter in other.model.parameters():
        parameter.data.mul_(1.5)
    kept = CleanPasses()
    parent = engine(lm, data, clean_passes=kept)
    parent.continuation_stats([(HeadId(1, 0),)])
    stats = parent.sibling(lm=other).continuation_stats([(HeadId(1, 1),)])
    assert kept.reused == 0 and parent.sibling(lm=other).clean_passes is kept
    assert same_bits(stats, engine(other, data).continuation_stats([(HeadId(1, 1),)]))
    assert not same_bits(stats, engine(lm, data).continuation_stats([(HeadId(1, 1),)]))


def test_a_run_writes_the_same_artifact_with_and_without_kept_passes(tmp_path, data_dir, monkeypatch):
    """The run keeps stage 1's passes for stage 2 and the holdout's for the control: the artifact is the one a run
    that keeps nothing writes, and stage 2 and the control did reuse passes."""
    import cel_utils.pipeline.protocol as protocol
    from cel_utils.config import RunConfig

    made = []

    def keeping(size):
        class Recorded(CleanPasses):
            def __init__(self):
                super().__init__(max_bytes=size)
                made.append(self)
        return Recorded

    def search_above_layer_0(discovery, **kwargs):  # a random model's gains tie, and ties go to layer 0's heads,
        above = [head for head in discovery.lm.geometry.all_heads() if head.layer > 0]  # whose passes keep no state
        return real_search(discovery, candidates=above, **kwargs)

    real_search = protocol.run_search
    monkeypatch.setattr(protocol, "run_search", search_above_layer_0)
    texts = {}
    for name, size in [("kept", 1 << 30), ("none", 0)]:
        monkeypatch.setattr(protocol, "CleanPasses", keeping(size))
        config = RunConfig.from_dict({"model": "random:llama:tiny", "task": "hellaswag", "preset": "smoke",
                                      "n_discovery": 6, "n_holdout": 8, "cache": False, "data_dir": data_dir,
                                      "results_dir": str(tmp_path / name)})
        run = protocol.run_cel(config, progress=False)
        artifact = json.loads(run.artifact.read_text())
        for volatile in ("created", "results_dir", "library_versions", "sandbox"):
            artifact.pop(volatile, None)
        artifact["config"].pop("results_dir", None)
        texts[name] = json.dumps(artifact, sort_keys=True)
    assert made[0].reused > 0 and made[1].reused == 0
    assert texts["kept"] == texts["none"]
