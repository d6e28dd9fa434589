"""Algorithm 1 on a synthetic evaluator whose answers are known in advance."""
import itertools
import math

import numpy as np
import pytest
from fakes import XorEvaluator

from cel_utils.models.heads import HeadId, head_set
from cel_utils.search.algorithm import evaluate_holdout, run_search
from cel_utils.search.ranking import Score, n_stage2, rank, rank_key


def _flip(*items, n=10):
    mask = np.zeros(n, bool)
    mask[list(items)] = True
    return mask


def test_ranking_key_order():
    a = Score((HeadId(0, 0),), n_correct=6, n_items=10, gain_count=2, harm=1, help=3)
    b = Score((HeadId(0, 1),), n_correct=6, n_items=10, gain_count=2, harm=0, help=2)  # same gain, less harm
    c = Score((HeadId(0, 2), HeadId(1, 0)), n_correct=7, n_items=10, gain_count=3, harm=2, help=5)  # higher gain
    d = Score((HeadId(2, 0),), n_correct=6, n_items=10, gain_count=2, harm=0, help=2)  # ties b, later id
    e = Score((HeadId(0, 1), HeadId(3, 0)), n_correct=6, n_items=10, gain_count=2, harm=0, help=2)  # ties b, more heads
    assert rank([a, b, d, e, c]) == [c, b, d, e, a]
    # lexicographic by (layer, head), not by the printed string: L2 before L10
    f = Score((HeadId(10, 0),), 5, 10, 0, 0, 0)
    g = Score((HeadId(2, 0),), 5, 10, 0, 0, 0)
    assert rank([f, g]) == [g, f]
    assert rank_key(b) < rank_key(a)


def test_search_finds_the_planted_pair_and_the_holdout_scores_it_once():
    base = np.array([1, 1, 1, 0, 0, 0, 0, 0, 1, 1], bool)
    flips = {
        HeadId(1, 1): _flip(3, 4, 0),  # +2 -1 alone
        HeadId(2, 0): _flip(5, 6, 7),  # +3 alone: the best single head
        HeadId(3, 2): _flip(3, 4),  # +2 alone, no harm
        HeadId(0, 0): _flip(0, 1, 2),  # -3
    }
    discovery = XorEvaluator(base, flips)
    holdout = XorEvaluator(base, flips)
    result = run_search(discovery, p=3, k=2)
    assert [s.heads for s in result.stage1[:3]] == [(HeadId(2, 0),), (HeadId(3, 2),), (HeadId(1, 1),)]
    assert result.pool == [(HeadId(2, 0),), (HeadId(3, 2),), (HeadId(1, 1),)]
    assert result.frozen == (HeadId(2, 0), HeadId(3, 2))  # +5, no harm
    assert result.best.gain == pytest.approx(50.0) and result.best.harm == 0
    assert len(result.stage2) == 3 + math.comb(3, 2)
    # stage 1 ran once with the full model and all 12 heads; stage 2 only the pairs (singles reused)
    assert len(discovery.calls[0]) == 1 + 12 and discovery.calls[0][0] == ()
    assert sorted(discovery.calls[1]) == sorted(head_set(c) for c in itertools.combinations(
        [HeadId(2, 0), HeadId(3, 2), HeadId(1, 1)], 2))
    held = evaluate_holdout(holdout, result.frozen)
    assert holdout.calls == [[(), (HeadId(2, 0), HeadId(3, 2))]]
    assert held.full_accuracy == pytest.approx(0.5) and held.ablated_accuracy == pytest.approx(1.0)
    assert held.relative_error_reduction == pytest.approx(100.0)
    assert (held.score.harm, held.score.help) == (0, 5)


def test_a_single_head_wins_when_no_subset_beats_it():
    base = np.zeros(10, bool)
    flips = {HeadId(0, 1): _flip(0, 1), HeadId(1, 2): _flip(0, 1, 2), HeadId(2, 2): _flip(2)}
    result = run_search(XorEvaluator(base, flips), p=3, k=3)
    assert result.frozen == (HeadId(1, 2),)  # {L0.H1, L2.H2} also gains 3, but has more heads
    assert len(result.stage2) == n_stage2(3, 3) + 3 == 3 + 3 + 1


@pytest.mark.parametrize("p,k,message", [(2, 3, "smaller than the budget"), (13, 3, "larger than the model's 12 heads"),
                                          (0, 1, "positive integer"), (3, 0, "positive integer")])
def test_bad_search_parameters(p, k, message):
    with pytest.raises(ValueError, match=message):
        run_search(XorEvaluator(np.zeros(4, bool), {}), p=p, k=k)


def test_the_protocol_evaluates_the_holdout_only_after_the_search_froze_its_set(tiny_models, data_dir, tmp_path,
                                                                                monkeypatch):
    """The holdout cannot leak into the selection: run_cel builds both evaluators up front (so bad items fail early),
    but no holdout item is scored until Algorithm 1 has returned its frozen set."""
    from cel_utils.config import RunConfig
    from cel_utils.pipeline import protocol

    log, real_make, real_search = [], protocol.make_evaluator, protocol.run_search

    def make_evaluator(lm, data, items, *args, **kwargs):
        evaluator = real_make(lm, data, items, *args, **kwargs)
        name = "holdout" if items is data.holdout else "discovery"
        real_evaluate = evaluator.evaluate
        evaluator.evaluate = lambda *a, **k: log.append(name) or real_evaluate(*a, **k)
        return evaluator

    def run_search(*args, **kwargs):
        result = real_search(*args, **kwargs)
        log.append("frozen")
        return result

    monkeypatch.setattr(protocol, "make_evaluator", make_evaluator)
    monkeypatch.setattr(protocol, "run_search", run_search)
    config = RunConfig(model="random:llama:tiny", task="boolq", n_discovery=4, n_holdout=4, p=2, k=2, n_random_sets=2,
                       n_resamples=0, cache=False, data_dir=data_dir, results_dir=str(tmp_path))
    protocol.run_cel(config, lm=tiny_models["llama"], progress=False)
    assert "discovery" in log and "holdout" in log
    assert "holdout" not in log[:log.index("frozen")]
