"""Power of the holdout test, the verdict, and the calibration baseline, on numbers made by hand or by simulation."""
import numpy as np
import pytest

from cel_utils.stats import power as pw
from cel_utils.stats.calibration import answer_groups, calibration_baseline, fit_offsets
from cel_utils.tasks.prompts import Request
from cel_utils.tasks.scoring import Outcome


@pytest.mark.parametrize("n_discordant", [6, 20, 57])
def test_the_test_keeps_its_level_and_gains_power_with_the_effect(n_discordant):
    assert pw.mcnemar_power(n_discordant, 0.5) <= pw.ALPHA  # under no effect it rejects at most alpha of the time
    powers = [pw.mcnemar_power(n_discordant, q) for q in (0.55, 0.7, 0.85, 1.0)]
    assert powers == sorted(powers) and powers[-1] == pytest.approx(1.0)


def test_the_smallest_detectable_gain_is_detected_with_80_percent_power_by_simulation():
    n_items, n_discordant = 500, 40
    gain = pw.min_detectable_gain(n_items, n_discordant)
    q = (1 + gain * n_items / (100 * n_discordant)) / 2  # P(help | changed) that gives this gain
    rng = np.random.default_rng(0)
    helped = rng.binomial(n_discordant, q, size=4000)
    from scipy import stats

    region = {x for x in range(n_discordant + 1) if stats.binomtest(x, n_discordant, 0.5).pvalue <= 0.05}
    assert np.mean([h in region for h in helped]) == pytest.approx(0.8, abs=0.03)
    smaller = pw.mcnemar_power(n_discordant, (1 + 0.8 * gain * n_items / (100 * n_discordant)) / 2)
    assert smaller < 0.8  # anything smaller is detected less often
    assert pw.min_detectable_gain(2 * n_items, n_discordant) == pytest.approx(gain / 2)  # same counts, twice the items


def test_too_few_changed_answers_detect_nothing():
    assert pw.min_detectable_gain(500, 5) is None  # 5 of 5 helped: two-sided p = 0.0625
    assert pw.min_detectable_gain(500, 6) is not None and pw.min_detectable_gain(500, 0) is None


def _significance(gain, p, low=-1.0, high=1.0):
    return {"gain_points": gain, "p_value": p, "ci_low": low, "ci_high": high}


def test_verdicts():
    power = pw.power_json(500, 40)
    assert pw.verdict(_significance(4.0, 0.01, 1.0, 7.0), power)["kind"] == "gain"
    assert pw.verdict(_significance(-4.0, 0.01, -7.0, -1.0), power)["kind"] == "loss"
    quiet = pw.verdict(_significance(0.4, 0.7), power)
    assert quiet["kind"] == "no effect" and f"{power['min_detectable_gain_points']:.1f} points" in quiet["text"]
    assert pw.verdict(_significance(0.4, 1.0), pw.power_json(500, 3))["kind"] == "underpowered"
    calibration = {"holdout_gain_points": 5.0, "ablation_vs_calibration": {"gain_points": -1.0, "p_value": 0.5}}
    assert "does not beat the calibration baseline" in pw.verdict(_significance(4.0, 0.01), power, calibration)["text"]


def test_offsets_reach_the_best_discovery_accuracy_a_grid_search_finds():
    rng = np.random.default_rng(1)
    n = 60
    gold = rng.integers(0, 2, n)
    signal = np.where(gold == 1, 1.0, -1.0) + rng.normal(0, 1.2, n)
    scores = np.stack([np.zeros(n), signal - 2.0], axis=1)  # a strong bias towards answer 0 ("no")
    groups = np.tile([0, 1], (n, 1))
    offsets = fit_offsets(scores, gold, groups)
    accuracy = lambda b: np.mean(np.argmax(scores + np.array([0.0, b])[groups], axis=1) == gold)  # noqa: E731
    best_on_grid = max(accuracy(b) for b in np.linspace(-6, 6, 4001))
    assert accuracy(offsets[1]) == best_on_grid > accuracy(0.0)
    assert offsets[0] == 0.0 and 0.5 < offsets[1] < 4.0  # it undoes most of the planted -2


def test_length_buckets_are_fitted_on_discovery_and_reused_on_the_holdout():
    def request(chars):
        return Request("i", (1,), tuple((2,) for _ in chars), 0, tuple(chars), "", tuple("x" * c for c in chars))

    discovery = [request([10, 20, 30, 40]), request([15, 25, 35, 45])]
    groups, edges = answer_groups("length", discovery)
    assert groups.max() == 3 and len(edges) == 3
    held, same = answer_groups("length", [request([1, 100, 20, 30])], edges)
    assert same is edges and held[0, 0] == 0 and held[0, 1] == 3


def test_calibration_baseline_against_the_ablation():
    n = 8

    def outcome(correct, scores=None):
        correct = np.array(correct, bool)
        return Outcome([f"i{j}" for j in range(len(correct))], correct, np.where(correct, 1.0, -1.0), scores=scores)

    requests = [Request("i", (1,), ((2,), (3,)), gold, (2, 3), "", (" no", " yes")) for gold in [1, 0] * (n // 2)]
    scores = np.array([[0.0, -0.5 if r.gold == 1 else -1.5] for r in requests])  # always "no"; yes is 0.5 short
    full = outcome(np.argmax(scores, axis=1) == [r.gold for r in requests], scores)
    ablated = outcome([True] * n)
    result = calibration_baseline("answer", requests, full, requests, full, ablated)
    assert result["discovery_accuracy"] == 1.0 and result["holdout_gain_points"] == pytest.approx(50.0)
    assert result["ablation_vs_calibration"]["gain_points"] == pytest.approx(0.0)
    assert calibration_baseline(None, requests, full, requests, full, ablated) is None
