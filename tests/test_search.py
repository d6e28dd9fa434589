"""Algorithm 1 on a synthetic evaluator whose answers are known in advance."""
import itertools
import math

import numpy as np
import pytest

from cel_utils.heads import HeadId, head_set
from cel_utils.search import Score, evaluate_holdout, n_stage2, rank, rank_key, run_search

from fakes import GEOMETRY, XorEvaluator




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


def test_search_finds_the_planted_pair_and_never_sees_the_holdout():
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
    assert holdout.calls == []
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
