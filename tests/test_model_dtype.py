"""A model cast or moved after loading: every mask, gate and input the package builds follows it, or a clear error.

PyTorch's CPU sdpa takes a float32 additive mask for float64 queries and silently computes wrong attention with it
(torch 2.13, on AVX2 and AVX-512 CPUs): a mask built from a dtype remembered at loading time made packed HellaSwag
margins depend on the token budget. These tests cast tiny models after loading and compare the packed rows (engine,
attribution) with the unpacked naive path, which hands the model no mask of its own.
"""
import platform
from pathlib import Path

import numpy as np
import pytest
import torch

from cel_utils.evaluation.engine import EngineEvaluator
from cel_utils.evaluation.evaluator import NaiveEvaluator
from cel_utils.evaluation.layout import layout, row_inputs
from cel_utils.models.heads import HeadId
from cel_utils.models.loading import random_model
from cel_utils.models.plumbing import attention_with_mask, base_model
from cel_utils.tasks.splits import load_task_data

INTERVENTIONS = [(), (HeadId(0, 1),), (HeadId(1, 2), HeadId(2, 0))]
BUDGETS = (64, 256, None)  # None: the default (4096), one forward for everything


@pytest.fixture()
def lm(tokenizer):
    """A tiny model of its own (the tests cast it), float32 as loaded."""
    return random_model("llama", tokenizer=tokenizer)


@pytest.fixture(scope="module")
def items(data_dir):
    return {task: load_task_data(task, 4, 4, seed=0, num_fewshot=shots, data_dir=data_dir)
            for task, shots in [("arithmetic", 2), ("boolq", 0), ("hellaswag", 0), ("mbpp", 1)]}


def test_the_dtype_and_device_are_read_from_the_model(lm):
    assert (lm.dtype, lm.device) == (torch.float32, torch.device("cpu"))
    lm.model.double()
    assert lm.dtype == torch.float64
    lm.model.to(torch.bfloat16)
    assert lm.dtype == torch.bfloat16


def test_packed_rows_of_a_model_cast_to_float64_equal_unpacked_ones_at_every_token_budget(lm, items):
    data = items["hellaswag"]
    float32 = NaiveEvaluator(lm, data.task, data.holdout, progress=False).evaluate(INTERVENTIONS)
    lm.model.double()
    reference = NaiveEvaluator(lm, data.task, data.holdout, progress=False).evaluate(INTERVENTIONS)
    for budget in BUDGETS:
        engine = EngineEvaluator(lm, data.task, data.holdout, token_budget=budget, progress=False)
        assert not engine.shortcut and any(row.segments for row in engine.rows)  # packed: the block mask is used
        for ref, out in zip(reference, engine.evaluate(INTERVENTIONS)):
            np.testing.assert_allclose(out.margin, ref.margin, rtol=0, atol=1e-9)
            np.testing.assert_allclose(out.scores, ref.scores, rtol=0, atol=1e-9)
    for ref, low in zip(reference, float32):  # float64 is the same computation, only rounded less
        np.testing.assert_allclose(ref.margin, low.margin, atol=1e-4)


def test_packed_rows_of_a_model_cast_to_bfloat16_match_unpacked_ones(lm, items):
    data = items["hellaswag"]
    lm.model.to(torch.bfloat16)
    reference = NaiveEvaluator(lm, data.task, data.holdout, progress=False).evaluate(INTERVENTIONS)
    for budget in BUDGETS:
        engine = EngineEvaluator(lm, data.task, data.holdout, token_budget=budget, progress=False)
        for ref, out in zip(reference, engine.evaluate(INTERVENTIONS)):
            # bf16 rounds each matmul to 8 bits of mantissa: packed and unpacked rows round differently, but a wrong
            # mask would move log-likelihoods by whole units
            np.testing.assert_allclose(out.scores, ref.scores, atol=0.05 * np.abs(ref.scores).max())


@pytest.mark.parametrize("task", ["arithmetic", "boolq", "hellaswag", "mbpp"])
def test_every_path_computes_in_the_dtype_the_model_was_cast_to(lm, items, task):
    """Engine, naive path and attribution of every task kind on a float64 model agree to float64's precision (and
    MBPP's decoding gives the same completions); a stale float32 anywhere would leave float32's 1e-7 differences."""
    from cel_utils.search.attribution import head_attributions

    data = items[task]
    lm.model.double()
    naive = NaiveEvaluator(lm, data.task, data.holdout, data.fewshot, max_new_tokens=8, progress=False)
    engine = EngineEvaluator(lm, data.task, data.holdout, data.fewshot, max_new_tokens=8, token_budget=128,
                             progress=False)
    reference, outcomes = naive.evaluate(INTERVENTIONS), engine.evaluate(INTERVENTIONS)
    for ref, out in zip(reference, outcomes):
        if task == "mbpp":
            assert [p["completion"] for p in out.predictions] == [p["completion"] for p in ref.predictions]
        else:
            np.testing.assert_allclose(out.margin, ref.margin, rtol=0, atol=1e-9)
    if task != "mbpp":  # attribution's margins are the decision margins, here in float64 too
        attribution = head_attributions(naive, token_budget=64)
        np.testing.assert_allclose(attribution.full_margins, reference[0].margin, rtol=0, atol=1e-9)


def test_a_mask_in_another_dtype_than_the_queries_is_refused_naming_both(lm, items):
    request = NaiveEvaluator(lm, items["hellaswag"].task, items["hellaswag"].holdout, progress=False).requests[0]
    rows = [layout(request, shortcut=False)]
    ids, positions, stale = row_inputs(rows, lm.tokenizer.pad_token_id, torch.float32, lm.device)
    lm.model.double()
    with torch.no_grad(), attention_with_mask(lm.model, stale):
        with pytest.raises(ValueError, match="float32 mask on cpu for torch.float64 queries"):
            base_model(lm.model)(input_ids=ids, position_ids=positions, attention_mask=stale)
    _, _, fresh = row_inputs(rows, lm.tokenizer.pad_token_id, lm.dtype, lm.device)
    with torch.no_grad(), attention_with_mask(lm.model, fresh):  # built in the model's own dtype: accepted
        base_model(lm.model)(input_ids=ids, position_ids=positions, attention_mask=fresh)


def test_a_model_computing_in_two_dtypes_is_refused_when_heads_are_ablated(lm, items):
    from cel_utils.models.ablation import ablated
    from cel_utils.models.plumbing import attention_output_projections

    attention_output_projections(lm.model)[1].double()  # one projection cast alone: its input stays float32
    ids = torch.tensor([[1, 2, 3, 4]])
    with torch.no_grad(), ablated(lm.model, [HeadId(1, 0)], lm.geometry):
        with pytest.raises(ValueError, match=r"layer 1's o_proj input is torch.float32 but its weight is torch.float64"):
            lm.model(ids)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_the_default_attention_kernel_computes_what_the_math_kernel_does(lm, items, dtype):
    """Packed rows (a custom block mask) through the kernel PyTorch picks on this CPU and through the reference math
    kernel: the same margins, so a kernel that misreads a mask fails here on whatever machine it runs."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    data = items["hellaswag"]
    lm.model.to(dtype)
    default = EngineEvaluator(lm, data.task, data.holdout, token_budget=64, progress=False).evaluate(INTERVENTIONS)
    with sdpa_kernel(SDPBackend.MATH):
        math = EngineEvaluator(lm, data.task, data.holdout, token_budget=64, progress=False).evaluate(INTERVENTIONS)
    tolerance = 1e-4 if dtype == torch.float32 else 1e-9
    for a, b in zip(default, math):
        np.testing.assert_allclose(a.scores, b.scores, rtol=0, atol=tolerance)


# --- What the machine computes bf16 with ------------------------------------------------------------------------------

@pytest.mark.parametrize("flags, native", [({"avx2", "fma"}, False), ({"avx2", "avx512f", "avx512_vnni"}, False),
                                           ({"avx512f", "avx512_bf16"}, True), ({"amx_tile", "amx_bf16"}, True),
                                           ({"asimd", "bf16"}, True)])
def test_native_bf16_on_a_cpu_is_read_from_its_flags(monkeypatch, flags, native):
    from cel_utils import hardware

    monkeypatch.setattr(hardware, "cpu_info", lambda: {"model": "test CPU", "flags": flags, "torch_capability": "X"})
    monkeypatch.setattr(hardware, "bf16_time_ratio", lambda device: pytest.fail("flags are known: nothing to time"))
    assert hardware.native_bf16("cpu") is native


@pytest.mark.parametrize("ratio, native", [(0.3, True), (40.0, False)])
def test_where_the_os_lists_no_flags_a_timing_probe_decides(monkeypatch, ratio, native):
    from cel_utils import hardware

    monkeypatch.setattr(hardware, "cpu_info", lambda: {"model": "test CPU", "flags": None, "torch_capability": "X"})
    monkeypatch.setattr(hardware, "bf16_time_ratio", lambda device: ratio)
    assert hardware.native_bf16("cpu") is native


def test_this_machines_cpu_is_described_and_its_bf16_cost_measured():
    from cel_utils.hardware import bf16_time_ratio, cpu_info, machine_summary, native_bf16
    from cel_utils.models.loading import resolve_dtype

    info = cpu_info()
    summary = machine_summary()
    assert info["model"] and info["model"] in summary and info["torch_capability"] in summary
    if platform.machine() in ("x86_64", "AMD64") and Path("/proc/cpuinfo").exists():  # Zen 4 and 5: both "AMD EPYC"
        assert info["kind"].startswith("family ") and info["kind"] in summary
    assert ("no bf16 units" in summary) == (not native_bf16("cpu"))
    ratio = bf16_time_ratio("cpu", rows=32)
    assert 0 < ratio < float("inf")
    assert resolve_dtype("auto", torch.device("cpu")) == torch.float32  # never bf16 on a CPU unless asked


def test_asking_about_a_gpu_where_torch_has_no_cuda_is_an_answer_not_a_crash(monkeypatch):
    """A login node that submits GPU jobs may see CUDA devices it cannot initialise (here: a CPU build of torch made to
    report one); validating `dtype auto` for `device cuda` there must not crash."""
    from cel_utils.hardware import native_bf16
    from cel_utils.models.loading import resolve_dtype

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    if torch.backends.cuda.is_built():
        pytest.skip("this torch has CUDA: the question has a real answer here")
    assert native_bf16("cuda") is False
    assert resolve_dtype("auto", torch.device("cuda")) == torch.float32


def test_a_model_cast_after_its_first_evaluation_is_not_served_the_numbers_stored_for_the_old_dtype(lm, items, tmp_path):
    from cel_utils.evaluation.store import EvalStore

    data = items["hellaswag"]
    engine = EngineEvaluator(lm, data.task, data.holdout, store=EvalStore(tmp_path / "evals"), progress=False)
    float32 = engine.evaluate(INTERVENTIONS)
    lm.model.double()
    float64 = engine.evaluate(INTERVENTIONS)  # the same evaluator, its store context taken before the cast
    reference = NaiveEvaluator(lm, data.task, data.holdout, progress=False).evaluate(INTERVENTIONS)
    for low, high, ref in zip(float32, float64, reference):
        np.testing.assert_allclose(high.margin, ref.margin, rtol=0, atol=1e-9)  # computed in float64, not read back
        assert not np.array_equal(high.margin, low.margin)
