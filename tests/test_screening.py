"""Screened stage 1: every screen orders all heads; with m = all heads the screened search is the exact one; resampled
screens index the per-item numbers; attribution per item, and on MBPP's reference solutions."""
import numpy as np
import pytest
import torch

from cel_utils.evaluation.engine import EngineEvaluator
from cel_utils.evaluation.evaluator import NaiveEvaluator
from cel_utils.evaluation.outcomes import OutcomeTable
from cel_utils.models.heads import HeadId
from cel_utils.search.algorithm import run_search
from cel_utils.search.attribution import gated_margins, head_attributions
from cel_utils.search.screening import SCREENS, Screen, run_screen
from cel_utils.tasks.splits import load_task_data

# Numerics-sensitive (attribution, screens against exact search): every test under both attention kernels (conftest).
pytestmark = pytest.mark.usefixtures("attention_backend")


@pytest.fixture(scope="module")
def discovery(tiny_models, data_dir):
    data = load_task_data("hellaswag", 8, 4, seed=0, data_dir=data_dir)
    # the engine: the naive path unembeds every position over the whole vocabulary, 4x these tests' time
    return EngineEvaluator(tiny_models["llama"], data.task, data.discovery, data.fewshot, progress=False)


@pytest.mark.parametrize("method", SCREENS)
def test_with_every_head_passed_on_the_screened_search_is_the_exact_one(discovery, method):
    table = OutcomeTable(discovery)
    exact = run_search(table, p=3, k=2)
    screen = run_screen(method, discovery)
    assert sorted(screen.order()) == discovery.lm.geometry.all_heads()  # every head, once
    screened = run_search(table, p=3, k=2, screen=screen, keep=len(screen.heads))
    assert screened.frozen == exact.frozen and screened.stage1 == exact.stage1 and screened.stage2 == exact.stage2
    assert screened.stage1_json()["keep"] == 12 and exact.stage1_json() == {"method": "exact"}


def test_a_screened_search_evaluates_only_the_heads_the_screen_passes_on(discovery):
    table = OutcomeTable(discovery)
    screen = run_screen("attribution", discovery)
    result = run_search(table, p=2, k=2, screen=screen, keep=4)
    top = screen.order()[:4]
    assert [s.heads[0] for s in result.stage1] and {s.heads[0] for s in result.stage1} == set(top)
    assert set(table.evaluated) == {()} | {(h,) for h in top} | set(map(tuple, [s.heads for s in result.stage2
                                                                                if len(s.heads) == 2]))
    with pytest.raises(ValueError, match="passes on m=4 heads, fewer than the pool size p=5"):
        run_search(table, p=5, k=2, screen=screen, keep=4)


def test_screens_rank_by_their_numbers_and_resample_by_indexing_them():
    heads = [HeadId(0, 0), HeadId(0, 1), HeadId(1, 0)]
    per_item = np.array([[0.5, -1.0, 0.1], [0.5, 3.0, 0.1], [-2.0, 0.0, 0.1]])
    screen = Screen("attribution", heads, per_item, full_margins=np.array([-0.2, 1.0, -0.05]))
    assert screen.order() == [HeadId(0, 1), HeadId(1, 0), HeadId(0, 0)]  # means 0.667, 0.1, -0.333
    assert screen.view(np.array([0, 0, 2])).order() == [HeadId(1, 0), HeadId(0, 0), HeadId(0, 1)]
    flips = Screen("attribution-flips", heads, per_item, full_margins=np.array([-0.2, 1.0, -0.05]))
    # item 0 (margin -0.2) moves above 0 under L0.H0 and L1.H0 is too small (-0.1); item 2 (-0.05) moves under L1.H0;
    # item 1 (1.0) falls below 0 under no head; L0.H1 flips nothing but has the largest mean
    assert list(flips.scores()) == [1, 0, 1]
    assert flips.order() == [HeadId(1, 0), HeadId(0, 0), HeadId(0, 1)]  # a tie on flips goes to the larger mean
    bf16 = Screen("bf16", heads, np.array([[1, 0, 1], [0, 0, -1], [0, 1, 1]]))
    assert list(bf16.scores()) == [1, 1, 1] and bf16.order() == [HeadId(0, 0), HeadId(0, 1), HeadId(1, 0)]  # harm
    assert bf16.view(np.array([2])).order() == [HeadId(0, 1), HeadId(1, 0), HeadId(0, 0)]


def test_attribution_per_item_is_each_items_own_gradient(discovery):
    result = head_attributions(discovery)
    assert result.per_item.shape == (8, 3, 4)
    one = head_attributions(NaiveEvaluator(discovery.lm, discovery.task, discovery.items[2:3], progress=False))
    np.testing.assert_allclose(one.per_item[0], result.per_item[2], rtol=1e-4, atol=1e-6)  # batching changes nothing


def _attribution_row_per_answer(evaluator, request) -> tuple[np.ndarray, float]:
    """Reference: each answer scored in a row of its own, the context written out in full (no packing, no sharing)."""
    from cel_utils.models.plumbing import base_model, scaled_head_outputs, unembed
    from cel_utils.search import attribution

    lm, geometry = evaluator.lm, evaluator.lm.geometry
    _, margin = attribution._target(evaluator)
    gates = torch.ones(geometry.n_layers, geometry.n_heads, requires_grad=True)
    factors = {layer: gates[layer].repeat_interleave(geometry.head_dim)[None] for layer in range(geometry.n_layers)}
    n, logits = len(request.context), []
    with scaled_head_outputs(lm.model, factors):
        for answer in request.continuations:
            ids = torch.tensor([list(request.context) + list(answer[:-1])])
            hidden = base_model(lm.model)(input_ids=ids).last_hidden_state[0]
            logits.append(unembed(lm.model, hidden[n - 1:n - 1 + len(answer)]).float())
    value = margin(evaluator.task, request, logits)
    value.backward()
    return -gates.grad.double().numpy(), float(value.detach())


@pytest.mark.parametrize("task", ["boolq", "hellaswag"])
def test_an_item_is_one_row_with_the_numbers_of_a_row_per_answer(tiny_models, data_dir, task):
    """BoolQ's one-token answers are read from one row (the context), HellaSwag's endings packed after one copy of the
    context: one forward and backward per item, and the per-item attribution and margin of a row per answer."""
    from cel_utils.search import attribution

    data = load_task_data(task, 6, 1, seed=0, data_dir=data_dir)
    evaluator = EngineEvaluator(tiny_models["llama"], data.task, data.discovery, data.fewshot, progress=False)
    rows = [attribution._row(r) for r in evaluator.requests]
    # the context once, then what each answer adds: one row per item
    assert [len(row.tokens) for row in rows] == [len(r.context) + sum(len(c) - 1 for c in r.continuations)
                                                 for r in evaluator.requests]
    result = head_attributions(evaluator)
    for item, request in enumerate(evaluator.requests):
        per_item, full_margin = _attribution_row_per_answer(evaluator, request)
        np.testing.assert_allclose(result.per_item[item], per_item, rtol=1e-4, atol=1e-6)
        assert result.full_margins[item] == pytest.approx(full_margin, rel=1e-5, abs=1e-6)
    assert np.abs(result.per_item).max() > 0


def test_mbpp_is_screened_by_the_reference_solutions_likelihood(tiny_models, data_dir):
    from cel_utils.tasks.prompts import reference_requests
    from cel_utils.tasks.scoring import loglikelihoods_naive

    lm = tiny_models["llama"]
    data = load_task_data("mbpp", 2, 1, seed=0, data_dir=data_dir)
    evaluator = NaiveEvaluator(lm, data.task, data.discovery, data.fewshot, progress=False)
    requests = reference_requests(data.task, data.discovery, data.fewshot, lm.tokenizer, "plain")
    assert lm.tokenizer.decode(requests[0].continuations[0]).endswith("[DONE]")
    head = HeadId(2, 1)
    gates = torch.ones(3, 4)
    gates[head.layer, head.head] = 0.0
    stats = loglikelihoods_naive(lm, requests, [head])  # the exact reference log-likelihood with the head ablated
    exact = [s.ll[0] / len(r.continuations[0]) for s, r in zip(stats, requests)]
    np.testing.assert_allclose(gated_margins(evaluator, gates), exact, rtol=1e-4)
    assert np.abs(run_screen("attribution", evaluator).scores()).max() > 0
    with pytest.raises(ValueError, match="use the attribution screen"):
        run_screen("attribution-flips", evaluator)


def test_the_boundary_screen_evaluates_its_candidates_exactly_on_the_items_nearest_the_boundary(discovery):
    table = OutcomeTable(discovery)
    heads = discovery.lm.geometry.all_heads()
    exact = table.evaluate([()] + [(h,) for h in heads])
    flips = run_screen("attribution-flips", discovery)
    screen = run_screen("boundary", discovery, candidates=5, items=3)
    assert set(screen.order()[:5]) == set(flips.order()[:5])  # the candidates, whatever their boundary scores
    assert screen.order()[5:] == [h for h in flips.order() if h not in flips.order()[:5]]  # the rest as flips had them
    near = np.argsort(np.abs(exact[0].margin))[:3]
    assert sorted(screen.boundary) == sorted(near)  # the items the full model is closest to changing
    for head in flips.order()[:5]:  # each candidate's number is its exact gain count on those items
        outcome = exact[1 + heads.index(head)]
        want = int(outcome.correct[near].sum()) - int(exact[0].correct[near].sum())
        assert screen.scores()[heads.index(head)] == want
    assert screen.to_json(4)["candidates"] == 5 and screen.to_json(4)["boundary_items"] == 3
    resampled = screen.view(np.array([0, 0, 1, 2, 3, 4, 5, 6]))
    assert set(resampled.order()[:5]) == set(screen.order()[:5])  # a resample re-ranks the same candidates


@pytest.mark.parametrize("native, ratio", [(True, 0.25), (False, 3.0), (True, 1.5)])
def test_the_bf16_screens_cost_is_the_bf16_time_ratio_measured_on_the_device(discovery, monkeypatch, native, ratio):
    """No assumed speed: the screen's cost in float32 forwards scales by the measured ratio, and where bf16 was measured
    no faster than float32 (no bf16 units, or units slower than float32's, as on a Xeon with AVX512-BF16 and no AMX)
    it says so and names the screens that are cheap there."""
    import warnings

    from cel_utils import hardware
    from cel_utils.search import screening

    monkeypatch.setattr(hardware, "native_bf16", lambda device: native)
    monkeypatch.setattr(hardware, "bf16_time_ratio", lambda device: ratio)
    evaluated = []  # the exact bf16 evaluations are the engine's, tested above: here only what they cost

    def single_head_gains(evaluator, heads, desc):
        evaluated.append(evaluator.lm.dtype)
        return np.zeros((len(evaluator.items), len(heads)), int), 100.0

    monkeypatch.setattr(screening, "_single_head_gains", single_head_gains)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        screen = run_screen("bf16", discovery)
    assert evaluated == [torch.bfloat16] and discovery.lm.dtype == torch.float32  # on a bf16 copy of the model
    assert screen.forward_equivalents == pytest.approx(100.0 * ratio)
    said = [str(w.message) for w in caught if "bf16 units" in str(w.message)]
    assert len(said) == (ratio >= 1)
    if said:
        assert f"{ratio:.1f}x float32's time" in said[0] and "attribution and boundary screens" in said[0]
        assert ("no faster than float32" in said[0]) == native and ("has no bf16 units" in said[0]) == (not native)
