"""The guarded precision for generation (issue 27, MBPP): bf16 decoding, rows near a tie decoded again in fp32."""
import functools

import numpy as np
import pytest
import torch

from cel_utils.evaluation.engine import EngineEvaluator
from cel_utils.evaluation.generation import generate
from cel_utils.evaluation.guarded import Guard, GuardedEvaluator
from cel_utils.evaluation.guarded_generation import guarded_completions, stacked_completions
from cel_utils.evaluation.precision import bf16_model
from cel_utils.models.ablation import ablated, head_mask
from cel_utils.models.heads import HeadId
from cel_utils.tasks.splits import load_task_data
from test_precision import _interventions, _perturbed  # the full model and n single heads; noisy weights

TINY_TOKENS = 8  # a random model never says [DONE]: every row decodes this many tokens


def _evaluators(lm, fast_model, data, items, max_new_tokens):
    make = functools.partial(EngineEvaluator, task=data.task, items=items, fewshot=data.fewshot,
                             max_new_tokens=max_new_tokens, progress=False)
    return make(lm), make(fast_model)


def _fp32(lm, requests, interventions, max_new_tokens) -> list[list[str]]:
    """fp32's completions, one intervention at a time (the naive path's calls), apart from the stacking under test."""
    return [generate(lm, requests, heads, max_new_tokens=max_new_tokens) for heads in interventions]


@pytest.fixture(scope="module")
def tiny_mbpp(tiny_models, data_dir):
    lm = tiny_models["llama"]
    data = load_task_data("mbpp", 4, 1, seed=0, data_dir=data_dir)
    interventions = _interventions(lm.geometry, 4)
    exact, _ = _evaluators(lm, lm, data, data.discovery, TINY_TOKENS)
    return lm, data, interventions, _fp32(lm, exact.requests, interventions, TINY_TOKENS)


def test_a_band_set_too_small_falls_back_to_fp32_and_says_so(tiny_mbpp):
    lm, data, interventions, reference = tiny_mbpp
    noisy = _perturbed(lm)
    exact, fast = _evaluators(lm, noisy, data, data.discovery, TINY_TOKENS)
    assert _fp32(noisy, exact.requests, interventions, TINY_TOKENS) != reference, "nothing to catch: the test is void"
    # a band of zero trusts every low-precision margin; auditing every row then meets a decoding it got wrong
    guard = Guard(multiple=0.0, audit_pairs=3, audit_share=1.0)
    with pytest.warns(RuntimeWarning, match="an audited bf16 decision .* differed .* computed in fp32"):
        completions = guarded_completions(exact, fast, guard, interventions)
    assert completions == reference
    rows = len(interventions) * len(data.discovery)
    assert guard.fell_back.startswith("mbpp: ") and "band 0)" in guard.fell_back
    assert guard.differed > 0 and guard.pairs == 0 and guard.fp32_pairs == rows
    assert guard.largest_error > 0  # the audit compared two decodings that differ
    assert guarded_completions(exact, fast, guard, interventions[:2]) == reference[:2]  # after the fall-back: fp32
    assert guard.fp32_pairs == rows + 2 * len(data.discovery)


def test_rows_inside_the_band_are_decoded_again_in_fp32(tiny_mbpp):
    """A band wide enough to take in every row: each one is fp32's re-decoding, and the rows the noisy model decoded
    otherwise are counted as caught."""
    lm, data, interventions, reference = tiny_mbpp
    exact, fast = _evaluators(lm, _perturbed(lm), data, data.discovery, TINY_TOKENS)
    plain = stacked_completions(fast, interventions)
    wrong = sum(a != b for got, want in zip(plain, reference) for a, b in zip(got, want))
    assert wrong > 0
    guard = Guard(multiple=1e6, audit_pairs=3)
    assert guarded_completions(exact, fast, guard, interventions) == reference
    rows = len(interventions) * len(data.discovery)
    assert not guard.fell_back and guard.pairs == guard.rechecked == rows and guard.caught == wrong


def test_real_bf16_on_a_tiny_model_decides_as_fp32(tiny_mbpp):
    """The fast evaluator as the guarded precision builds it (fp32's ``lm``, the bf16 copy as ``above``): the rows are
    decoded with the bf16 copy."""
    lm, data, interventions, reference = tiny_mbpp
    exact, _ = _evaluators(lm, lm, data, data.discovery, TINY_TOKENS)
    fast = EngineEvaluator(lm, data.task, data.discovery, data.fewshot, max_new_tokens=TINY_TOKENS, progress=False,
                           above=bf16_model(lm))
    plain = stacked_completions(fast, interventions)
    assert plain != reference, "bf16 decodes every row as fp32 does: nothing to catch"  # ties of bf16's coarse logits
    guard = Guard(audit_pairs=6, audit_share=0.5)
    first = guarded_completions(exact, fast, guard, interventions)
    second = guarded_completions(exact, fast, guard, interventions[::-1])  # a later call: audits a share only
    assert first == reference and second == reference[::-1] and not guard.fell_back
    assert guard.pairs == 2 * len(interventions) * len(data.discovery) and guard.largest_error > 0
    assert guard.audited + guard.rechecked >= 6 and guard.caught > 0
    # ... and through the guarded evaluator, as a run calls it: pass@1's completions are fp32's
    outcomes = GuardedEvaluator(exact, fast, Guard(audit_pairs=6)).evaluate(interventions)
    assert [[p["completion"] for p in outcome.predictions] for outcome in outcomes] == reference


def test_generate_reports_each_rows_smallest_top2_gap(tiny_models, data_dir):
    """The reported gaps are those of a plain forward over the whole sequence at each step, recomputed here; asking
    for them changes no completion."""
    lm = tiny_models["llama"]
    data = load_task_data("mbpp", 2, 1, seed=0, data_dir=data_dir)
    exact, _ = _evaluators(lm, lm, data, data.discovery, 5)
    sets = [(), (HeadId(0, 1),)]
    requests = exact.requests * len(sets)
    masks = torch.cat([head_mask(heads, lm.geometry).expand(len(exact.requests), -1, -1) for heads in sets])
    plain = generate(lm, requests, row_masks=masks, max_new_tokens=5)
    completions, decoded = generate(lm, requests, row_masks=masks, max_new_tokens=5, gaps=True)
    assert completions == plain
    for row, (request, found) in enumerate(zip(requests, decoded)):
        heads = sets[row // len(exact.requests)]
        assert len(found.tokens) == len(found.gaps) == 5
        gaps = []
        for step in range(len(found.tokens)):
            ids = torch.tensor([list(request.context) + found.tokens[:step]])
            with torch.no_grad(), ablated(lm.model, heads, lm.geometry):
                logits = lm.model(input_ids=ids).logits[0, -1].float()
            top = logits.topk(2).values
            assert int(logits.argmax()) == found.tokens[step]
            gaps.append(float(top[0] - top[1]))
        np.testing.assert_allclose(found.gaps, gaps, rtol=1e-4, atol=1e-5)
        assert found.margin == pytest.approx(min(gaps), rel=1e-4, abs=1e-5)
        assert found.margin > 0


@pytest.mark.slow
def test_guarded_decodes_as_fp32_on_the_default_model(default_model, data_dir):
    """On MBPP nearly every row comes inside the band (a row's margin is its smallest top-2 gap over tens of steps, and
    bf16's error on a gap is ~0.2-0.35 on this model), so the guard rechecks every one of these 9 rows: what is
    checked is that the completions plain bf16 got wrong were caught, and none slipped through."""
    data = load_task_data("mbpp", 3, 1, seed=0, num_fewshot=3, data_dir=data_dir)
    interventions = _interventions(default_model.geometry, 2)
    exact, fast = _evaluators(default_model, bf16_model(default_model), data, data.discovery, 64)
    reference = stacked_completions(exact, interventions)  # the engine's own fp32 stacking
    plain = stacked_completions(fast, interventions)  # the same bf16 decoding the guarded call starts from
    wrong = sum(a != b for got, want in zip(plain, reference) for a, b in zip(got, want))
    guard = Guard(audit_pairs=3)
    completions = guarded_completions(exact, fast, guard, interventions)
    assert completions == reference
    record = guard.to_json()
    assert record["pairs"] == len(interventions) * len(data.discovery) and not record["fell_back_to_fp32"]
    assert record["largest_error"] > 0  # bf16 was decoded and audited, not fp32 twice
    # every row plain bf16 decoded otherwise was rechecked in fp32 (none was audited outside the band: no fall-back)
    assert record["bf16_decisions_caught"] == wrong
    assert record["share_rechecked"] > 0
