"""The guarded precision (issue 27): bf16 compute, fp32 recheck inside an audited band, fp32's decisions."""
import copy
import dataclasses
import functools
import json
import warnings

import numpy as np
import pytest
import torch

from cel_utils.book import run_page
from cel_utils.config import RunConfig
from cel_utils.evaluation.engine import EngineEvaluator
from cel_utils.evaluation.guard import DEPTH_GROUPS, GROUP_EVIDENCE, depth_group
from cel_utils.evaluation.guarded import Guard, GuardedEvaluator
from cel_utils.evaluation.kinds import kind_of
from cel_utils.evaluation.precision import bf16_model, resolve_precision, warn_if_bf16_is_slow
from cel_utils.evaluation.store import EvalStore
from cel_utils.pipeline import protocol
from cel_utils.pipeline.protocol import run_cel
from cel_utils.tasks.catalog import get_task
from cel_utils.tasks.splits import load_task_data


def _interventions(geometry, n: int):
    """The full model, then ``n`` single heads spread over the layers."""
    heads = geometry.all_heads()
    return [()] + [(heads[j],) for j in np.linspace(0, len(heads) - 1, n).astype(int)]


def ref_metric(outcome) -> str:
    """The primary metric's name: the one whose vector is ``correct``."""
    return next(name for name, values in outcome.metrics.items() if values is outcome.correct)


def _same_decisions(reference, candidate) -> None:
    """The primary metric's decisions and the chosen answers are fp32's (secondary metrics are not guarded)."""
    for ref, out in zip(reference, candidate):
        assert np.array_equal(ref.correct, out.correct)
        assert ref.predictions == out.predictions
        assert np.array_equal(ref.metrics[ref_metric(ref)], out.metrics[ref_metric(ref)])


def _flips(reference, candidate) -> int:
    return sum(int((ref.correct != out.correct).sum()) + sum(a != b for a, b in zip(ref.predictions, out.predictions))
               for ref, out in zip(reference, candidate))


def _perturbed(lm, scale: float = 0.3, seed: int = 0):
    """A copy of ``lm`` with noise on its weights: a stand-in for bf16 that is wrong far more often than bf16 is on a tiny
    random model (where bf16 moves no decision), so that a band too small meets decisions it got wrong."""
    model = copy.deepcopy(lm.model)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.add_(scale * parameter.std().nan_to_num(0) * torch.randn(parameter.shape, generator=generator))
    return dataclasses.replace(lm, model=model)


def test_a_band_set_too_small_falls_back_to_fp32_and_says_so(tiny_models, data_dir):
    lm = tiny_models["llama"]
    data = load_task_data("boolq", 8, 3, seed=0, data_dir=data_dir)
    interventions = _interventions(lm.geometry, 6)
    make = functools.partial(EngineEvaluator, task=data.task, items=data.discovery, progress=False)
    exact = make(lm).evaluate(interventions)
    assert _flips(exact, make(_perturbed(lm)).evaluate(interventions)) > 0, "nothing to catch: the test would be void"
    # a band of zero trusts every low-precision margin; auditing every pair then meets a decision it got wrong
    guard = Guard(multiple=0.0, audit_pairs=4, audit_share=1.0)
    evaluator = GuardedEvaluator(make(lm), make(_perturbed(lm)), guard)
    with pytest.warns(RuntimeWarning, match="computed in fp32"):
        outcomes = evaluator.evaluate(interventions)
    _same_decisions(exact, outcomes)
    assert guard.fell_back and guard.differed > 0 and guard.to_json()["fell_back_to_fp32"] == guard.fell_back
    evaluator.evaluate(interventions[:3])  # after the fall-back, fp32 alone
    assert guard.fp32_pairs == (len(interventions) + 3) * len(data.discovery)


def test_a_run_that_falls_back_records_it_in_its_artifact(tiny_models, data_dir, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("CEL_DATA_DIR", data_dir)
    settings = dict(model="random:llama:tiny", task="boolq", n_discovery=6, n_holdout=6, p=2, k=2, batch_size=4,
                    n_random_sets=2, n_resamples=0, cache=False)
    lm = tiny_models["llama"]
    from cel_utils import hardware

    monkeypatch.setattr(hardware, "bf16_time_ratio", lambda device: 1.6)  # as on a Xeon without AMX: said, run anyway
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        reference = json.loads(run_cel(RunConfig(**settings, results_dir="fp32"), lm=lm,
                                       progress=False).artifact.read_text())
    assert not [w for w in caught if "bf16 matmul" in str(w.message)]  # fp32 computes no bf16
    monkeypatch.setattr(protocol, "Guard", functools.partial(Guard, multiple=0.0, audit_share=1.0))
    monkeypatch.setattr(protocol, "bf16_model", _perturbed)
    with pytest.warns(UserWarning, match="precision guarded computes in bfloat16, but a bf16 matmul took 1.6x"), \
            pytest.warns(RuntimeWarning, match="computed in fp32"):
        run = run_cel(RunConfig(**settings, precision="guarded", results_dir="guarded"), lm=lm, progress=False)
    artifact = json.loads(run.artifact.read_text())
    assert artifact["precision"]["resolved"] == "guarded"
    assert "an audited bf16 decision differed" in artifact["precision"]["audit"]["fell_back_to_fp32"]
    assert reference["precision"]["audit"] is None
    assert "FELL BACK TO FP32: boolq: an audited bf16 decision differed" in run_page.precision_text(artifact)
    assert run_page.precision_text(reference) == "fp32"
    for section in ("discovery", "stage1", "stage2", "frozen"):
        assert artifact[section] == reference[section], section
    assert artifact["holdout"]["full_correct"] == reference["holdout"]["full_correct"]
    assert artifact["holdout"]["ablated_correct"] == reference["holdout"]["ablated_correct"]


@pytest.mark.slow  # each task kind's margin once: choice under acc_norm (HellaSwag; BoolQ's acc is the same path with
@pytest.mark.parametrize("task, fewshot", [("hellaswag", 0), ("arithmetic_1dc", 3)])  # a plainer metric), greedy
def test_guarded_decides_as_fp32_on_the_default_model(default_model, data_dir, task, fewshot):
    data = load_task_data(task, 8, 3, seed=0, num_fewshot=fewshot, data_dir=data_dir)
    interventions = _interventions(default_model.geometry, 3)
    make = functools.partial(EngineEvaluator, task=data.task, items=data.discovery, fewshot=data.fewshot, progress=False)
    exact = make(default_model).evaluate(interventions)
    guard = Guard(audit_pairs=8)
    fast = make(default_model, above=bf16_model(default_model))
    outcomes = GuardedEvaluator(make(default_model), fast, guard).evaluate(interventions)
    _same_decisions(exact, outcomes)
    record = guard.to_json()
    assert record["pairs"] == len(interventions) * len(data.discovery) and not record["fell_back_to_fp32"]
    assert record["largest_error"] > 0  # bf16 was computed and audited, not fp32 twice
    assert record["share_rechecked"] < 1  # most decisions were bf16's


@pytest.mark.parametrize("precision, ratio, warned", [("guarded", 1.6, True), ("bf16", 3.0, True),
                                                     ("guarded", 0.3, False), ("fp32", 1.6, False)])
def test_bf16_where_it_was_measured_no_faster_than_fp32_is_said(monkeypatch, precision, ratio, warned):
    """A flag is not a speed (an Intel Xeon listing avx512_bf16 without AMX: a bf16 matmul 1.6-1.7x fp32's time):
    a run in bf16 or guarded hears the measured ratio where it is 1 or more; fp32 measures nothing."""
    from cel_utils import hardware

    timed = []
    monkeypatch.setattr(hardware, "bf16_time_ratio", lambda device: timed.append(device) or ratio)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        warn_if_bf16_is_slow(precision, "cpu")
    said = [str(w.message) for w in caught if "bf16 matmul" in str(w.message)]
    assert len(said) == warned and set(timed) == (set() if precision == "fp32" else {"cpu"})
    if said:
        assert f"precision {precision} computes in bfloat16" in said[0] and f"took {ratio:.1f}x" in said[0]
        assert "use precision fp32" in said[0]


def test_auto_is_guarded_only_where_guarded_pays(monkeypatch):
    from cel_utils import hardware

    # guarded where it was measured faster than fp32 (AMX), not on AVX512-BF16 alone (0.9x fp32 there, issue 46)
    for flags, expected in [({"avx2", "avx512f"}, "fp32"), ({"avx512_bf16"}, "fp32"),
                            ({"avx512f", "avx512_bf16", "amx_bf16"}, "guarded")]:
        monkeypatch.setattr(hardware, "cpu_info", lambda flags=flags: {"model": "test", "flags": flags})
        assert resolve_precision("auto", "cpu") == expected
    assert resolve_precision("bf16", "cpu") == "bf16"
    # with AMX: guarded for multiple choice; fp32 for arithmetic (guarded was slower there) and for decoding
    # (where the guard rechecks nearly every row)
    assert protocol.run_precision(RunConfig(task="boolq", precision="auto"), "cpu") == "guarded"
    assert protocol.run_precision(RunConfig(task="hellaswag", precision="auto"), "cpu") == "guarded"
    assert protocol.run_precision(RunConfig(task="arithmetic_1dc", precision="auto"), "cpu") == "fp32"
    assert protocol.run_precision(RunConfig(task="arithmetic_1dc", precision="guarded"), "cpu") == "guarded"
    assert protocol.run_precision(RunConfig(task="mbpp", precision="auto"), "cpu") == "fp32"
    assert protocol.run_precision(RunConfig(task="mbpp", precision="guarded"), "cpu") == "guarded"
    assert protocol.run_precision(RunConfig(task="boolq", precision="auto", engine="naive"), "cpu") == "fp32"
    assert resolve_precision("auto", "cpu", kind_of(get_task("boolq")), "naive") == "fp32"  # rechecks need the engine
    assert resolve_precision("auto", "cpu", kind_of(get_task("mbpp"))) == "fp32"
    with pytest.raises(ValueError, match="choose from"):
        resolve_precision("fp16", "cpu")
    with pytest.raises(ValueError, match="dtype"):
        RunConfig(task="boolq", precision="guarded", dtype="bfloat16").validate()


@pytest.mark.parametrize("fast", ["bf16 copy", "fast pass"])
def test_bf16_numbers_are_never_served_as_fp32_ones(tiny_models, data_dir, tmp_path, fast):
    lm = tiny_models["llama"]
    data = load_task_data("boolq", 6, 3, seed=0, data_dir=data_dir)
    store = EvalStore(tmp_path)
    interventions = _interventions(lm.geometry, 3)
    make = functools.partial(EngineEvaluator, task=data.task, items=data.discovery, progress=False, store=store)
    (make(bf16_model(lm)) if fast == "bf16 copy" else make(lm, above=bf16_model(lm))).evaluate(interventions)
    assert store.read == 0 and store.computed > 0
    make(lm).evaluate(interventions)
    assert store.read == 0  # the fp32 evaluator found nothing of bf16's
    make(lm).evaluate(interventions)
    assert store.read > 0  # ... and its own records the second time


@pytest.mark.parametrize("task, fewshot", [("hellaswag", 0), ("arithmetic_1dc", 3)])  # packed answers; a shared prefix
def test_the_fast_pass_is_fp32_below_the_ablated_layers(tiny_models, data_dir, task, fewshot):
    """The guarded precision's fast pass: the full model is fp32's own numbers, bit for bit; an ablated pair is bf16's
    approximation of fp32 (close, and not the bits of either the fp32 model or the whole-model bf16 copy)."""
    lm = tiny_models["llama"]
    data = load_task_data(task, 6, 3, seed=0, num_fewshot=fewshot, data_dir=data_dir)
    interventions = _interventions(lm.geometry, 3)
    make = functools.partial(EngineEvaluator, task=data.task, items=data.discovery, fewshot=data.fewshot, progress=False)
    fp32, copy16 = make(lm).continuation_stats(interventions), make(bf16_model(lm)).continuation_stats(interventions)
    fast_evaluator = make(lm, above=bf16_model(lm))
    assert fewshot == 0 or fast_evaluator.prefix, "the shared prefix's path is not exercised"
    fast = fast_evaluator.continuation_stats(interventions)
    for ours, theirs in zip(fast[0], fp32[0]):  # the full model
        assert np.array_equal(ours.ll, theirs.ll) and np.array_equal(ours.greedy_margin, theirs.greedy_margin, equal_nan=True)
    for u in range(1, len(interventions)):
        ours, theirs, copied = (np.concatenate([s.ll for s in per[u]]) for per in (fast, fp32, copy16))
        assert not np.array_equal(ours, theirs) and not np.array_equal(ours, copied)
        assert np.allclose(ours, theirs, rtol=0.05, atol=0.05)



@pytest.mark.parametrize("task, fewshot", [("boolq", 0), ("arithmetic_1dc", 3)])  # one-token answers; a shared prefix
def test_rechecks_run_inside_the_fast_pass_and_give_the_scattered_rechecks_numbers(tiny_models, data_dir, monkeypatch,
                                                                                  task, fewshot):
    """Issue 46: a batch's rechecks start from the clean pass the fast pass holds (no clean pass of their own), and
    compute, bit for bit, what a recheck with its own clean pass computes."""
    from cel_utils.evaluation import guarded

    lm = tiny_models["llama"]
    data = load_task_data(task, 10, 3, seed=0, num_fewshot=fewshot, data_dir=data_dir)
    interventions = _interventions(lm.geometry, 5)
    make = functools.partial(EngineEvaluator, task=data.task, items=data.discovery, fewshot=data.fewshot, progress=False,
                             batch_size=4)
    exact = make(lm)
    assert len(exact.batches) > 1, "one batch: the per-batch path is not exercised"
    scattered = []
    monkeypatch.setattr(guarded, "pair_stats", lambda engine, pairs: scattered.append(pairs) or [])
    guard = Guard(multiple=1e9, audit_pairs=0)  # every pair inside the band: all rechecked, a batch at a time
    guard.see(1.0)
    outcomes = GuardedEvaluator(exact, make(lm, above=bf16_model(lm)), guard).evaluate(interventions)
    assert scattered == [] and guard.rechecked == (len(interventions) - 1) * len(data.discovery)
    # each pair's error counted in the third of the layers its intervention starts in
    thirds = [depth_group(min(h.layer for h in heads), lm.geometry.n_layers) for heads in interventions[1:]]
    assert guard.to_json()["depth_evidence"] == [thirds.count(d) * len(data.discovery) for d in range(DEPTH_GROUPS)]
    monkeypatch.undo()
    # in the order the guard hands them over (batch by batch; rows stacked in another order round otherwise)
    pairs = [(i, heads) for batch in exact.batches for heads in interventions[1:] for i in batch]
    alone = dict(zip(pairs, guarded.pair_stats(make(lm), pairs)))
    for u, heads in enumerate(interventions[1:], start=1):
        recomputed = exact.decide([alone[i, heads] for i in range(len(data.discovery))])
        assert np.array_equal(outcomes[u].margin, recomputed.margin, equal_nan=True)  # bits, not closeness
    _same_decisions(exact.evaluate(interventions), outcomes)


def test_a_band_widened_by_a_later_batch_rechecks_the_earlier_ones():
    """The guard takes a call a batch at a time; whatever the order, every pair inside the final band is rechecked, and
    what lies outside it and was computed counts as audited."""
    rng = np.random.default_rng(0)
    margins = rng.uniform(0, 1, (6, 20))
    error = np.full(margins.shape, 0.01)
    error[5, 19] = 0.3  # the last batch's last pair: a large error, seen late
    guard = Guard(audit_pairs=8, audit_share=0.0)
    check = guard.call(margins.shape, exact_rows=[0])
    recomputed: list = []

    def recheck(pairs):
        recomputed.extend(pairs)
        return [float(error[pair]) for pair in pairs]

    for items in np.array_split(np.arange(20), 4):  # four batches, in order
        pairs = [(u, int(i)) for u in range(6) for i in items]
        check.part(pairs, [margins[pair] for pair in pairs], recheck)
    if (5, 19) not in recomputed:  # it must be seen for the test to mean anything: make it audited
        check._compute([(5, 19)], recheck)
    assert guard.band == pytest.approx(0.6)
    differing = check.finish(recheck, lambda pair: False)
    inside = {(int(u), int(i)) for u, i in zip(*np.nonzero(margins <= guard.band)) if u != 0}
    assert inside <= set(recomputed) and not any(u == 0 for u, _ in recomputed)
    assert len(recomputed) == len(set(recomputed))  # no pair computed twice
    assert guard.rechecked == len(inside) and guard.audited == len(set(recomputed) - inside) and differing == []
    assert guard.pairs == margins.size


def test_each_third_of_the_layers_has_its_own_band():
    """A large error among interventions that start low in the model widens their band alone: pairs starting higher keep
    the band of their own errors, and every pair inside its own band, and none outside it, counts as rechecked."""
    rng = np.random.default_rng(1)
    depths = [None, 0, 0, 1, 1, 2, 2]  # the full model's row is exact
    margins = rng.uniform(0, 1, (len(depths), 60))
    error = np.where(np.array([d == 0 for d in depths])[:, None], 0.2, np.full(margins.shape, 0.01))
    error[1, 7] = 0.3
    guard = Guard(audit_pairs=300, audit_share=0.0)  # of 360 open pairs: every third well past GROUP_EVIDENCE
    computed: list = []

    def recheck(pairs):
        computed.extend(pairs)
        return [float(error[pair]) for pair in pairs]

    differing = guard.check(margins, recheck, lambda pair: False, exact_rows=[0], depths=depths)
    if (1, 7) not in computed:
        pytest.skip("the large error was not drawn into the audit")
    assert [guard.depth_band(d) for d in range(3)] == pytest.approx([0.6, 0.02, 0.02])
    bands = np.array([0.0] + [guard.depth_band(d) for d in depths[1:]])
    inside = {(int(u), int(i)) for u, i in zip(*np.nonzero(margins <= bands[:, None])) if u != 0}
    assert inside <= set(computed) and guard.rechecked == len(inside) and differing == []
    # one band for the run would have rechecked the higher thirds' pairs up to 0.6 as well
    assert guard.rechecked < int((margins[1:] <= guard.band).sum())


def test_a_third_with_little_evidence_has_the_widest_band():
    guard = Guard()
    guard.see(0.3, 0)
    for _ in range(GROUP_EVIDENCE - 1):
        guard.see(0.01, 1)
    assert guard.depth_band(1) == guard.band == pytest.approx(0.6) and guard.depth_band(None) == guard.band
    guard.see(0.01, 1)
    assert guard.depth_band(1) == pytest.approx(0.02) and guard.depth_band(2) == guard.band


def test_the_run_page_prints_each_thirds_band_from_the_record():
    guard = Guard()
    guard.see(0.3, 0)
    for _ in range(GROUP_EVIDENCE):
        guard.see(0.01, 1)
    guard.pairs, guard.rechecked = 200, 30
    record = guard.to_json()
    text = run_page.precision_text({"precision": {"setting": "auto", "resolved": "guarded", "audit": record}})
    assert "bands 0.6, 0.02, 0.6 for interventions starting in the lowest, middle and top third" in text
    assert f"fewer than {record['group_evidence']} audited pairs" in text and "15.0% rechecked" in text
    one = Guard()
    one.see(0.3)
    text = run_page.precision_text({"precision": {"setting": "guarded", "resolved": "guarded", "audit": one.to_json()}})
    assert "band 0.6 = 2 x the largest audited error 0.3" in text and "bands" not in text
