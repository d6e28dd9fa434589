"""Decision rules on hand-made log-likelihoods, and the metric arithmetic."""
import numpy as np
import pytest

from cel_utils.evaluation.kinds import kind_of
from cel_utils.tasks.prompts import Request
from cel_utils.tasks.scoring import ContinuationStats, relative_error_reduction
from cel_utils.tasks.catalog import get_task


def decide(task, requests, stats):
    """The task's decision, looked up by its kind as the evaluators do."""
    return kind_of(task).decide(task, requests, stats)


def _request(gold, chars):
    return Request(item_id="i", context=(1,), continuations=tuple((2,) for _ in chars), gold=gold,
                   choice_chars=tuple(chars), prompt="", answers=tuple("x" * c for c in chars))


def _stats(lls):
    n = len(lls)
    return ContinuationStats(ll=np.array(lls, float), greedy=np.zeros(n, bool), greedy_margin=np.zeros(n))


def test_acc_and_acc_norm_can_disagree():
    task = get_task("hellaswag")
    # ending 0: ll -4 over 2 chars (-2/char); ending 1: ll -6 over 10 chars (-0.6/char)
    outcome = decide(task, [_request(1, [2, 10, 5, 5])], [_stats([-4, -6, -9, -9])])
    assert outcome.metrics["acc"].tolist() == [False]
    assert outcome.metrics["acc_norm"].tolist() == [True]
    assert outcome.correct.tolist() == [True]  # acc_norm is HellaSwag's primary metric
    assert outcome.margin[0] == pytest.approx(-0.6 - (-9 / 5))  # gold's score minus the best other score


def test_ties_go_to_the_first_choice_like_argmax():
    task = get_task("boolq")
    out = decide(task, [_request(0, [2, 3]), _request(1, [2, 3])], [_stats([-1, -1]), _stats([-1, -1])])
    assert out.correct.tolist() == [True, False]


def test_greedy_match_needs_every_token():
    task = get_task("arithmetic")
    request = Request(item_id="a", context=(1,), continuations=((5, 6),), gold=0, choice_chars=(2,), prompt="", answers=(" 12",))
    good = ContinuationStats(ll=np.array([-0.1]), greedy=np.array([True]), greedy_margin=np.array([0.3]))
    bad = ContinuationStats(ll=np.array([-0.1]), greedy=np.array([False]), greedy_margin=np.array([-0.01]))
    out = decide(task, [request, request], [good, bad])
    assert out.correct.tolist() == [True, False]
    assert out.margin.tolist() == [0.3, -0.01]


def test_relative_error_reduction_matches_the_paper():
    assert relative_error_reduction(70.40, 83.50) == pytest.approx(44.26, abs=0.005)
    assert relative_error_reduction(50.0, 40.0) == pytest.approx(-20.0)
    assert np.isnan(relative_error_reduction(100.0, 100.0))
