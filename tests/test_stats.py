"""Paired significance, the random-set null, stability by resampling, and the memo of per-item outcomes.

Everything here runs on synthetic evaluators whose per-item answers are known in advance (no model).
"""
import math
from pathlib import Path

import numpy as np
import pytest
from fakes import GEOMETRY, XorEvaluator
from scipy import stats as scipy_stats

from cel_utils.evaluation.outcomes import OutcomeTable, Resampled, take
from cel_utils.models.heads import HeadId, format_heads, head_set
from cel_utils.search.algorithm import evaluate_holdout, run_search
from cel_utils.stats.reliability import assess_run, resample_indices, resampled_searches
from cel_utils.stats.significance import (
    jaccard,
    mcnemar_exact,
    mean_pairwise_jaccard,
    null_position,
    paired_bootstrap_ci,
    paired_test,
    random_head_sets,
    selection_frequencies,
)

REPO = Path(__file__).resolve().parents[1]
from cel_utils.tasks.scoring import Outcome


def random_flips(n_items, seed, rate=0.15):
    rng = np.random.default_rng(seed)
    return {h: rng.random(n_items) < rate for h in GEOMETRY.all_heads()}


# --- paired significance -----------------------------------------------------------------------------------------

def test_mcnemar_is_the_binomial_test_on_discordant_items():
    full = np.array([1, 1, 0, 0, 0, 0, 0, 0, 1, 1], bool)
    ablated = np.array([0, 1, 1, 1, 1, 1, 1, 0, 1, 1], bool)  # 5 helped, 1 harmed
    assert mcnemar_exact(full, ablated) == pytest.approx(2 * 7 / 64)  # P(X <= 1) + P(X >= 5), X ~ Bin(6, 1/2)
    assert mcnemar_exact(full, full) == 1.0
    test = paired_test(full, ablated, seed=0)
    assert (test.help, test.harm, test.n_items) == (5, 1, 10)
    assert test.gain_points == pytest.approx(40.0)
    assert test.ci_low <= test.gain_points <= test.ci_high
    assert paired_test(full, ablated, seed=0) == test  # seeded: identical


def test_bootstrap_interval_matches_a_plain_paired_bootstrap():
    rng = np.random.default_rng(3)
    full = rng.random(400) < 0.5
    ablated = np.where(rng.random(400) < 0.2, ~full, full)
    low, high = paired_bootstrap_ci(full, ablated, n_resamples=4000, seed=1)
    diff = ablated.astype(float) - full.astype(float)
    draws = np.random.default_rng(2).integers(0, 400, (4000, 400))
    means = 100 * diff[draws].mean(axis=1)
    assert low == pytest.approx(np.quantile(means, 0.025), abs=1.0)
    assert high == pytest.approx(np.quantile(means, 0.975), abs=1.0)


def test_no_change_gives_an_exact_interval_not_a_point():
    same = np.array([1, 0, 1, 1], bool)
    test = paired_test(same, same)
    assert (test.p_value, test.gain_points) == (1.0, 0.0)
    # nothing changed on 4 items: at 95% up to 1 - 0.025^(1/4) = 60% of answers could change either way
    assert test.ci_low == pytest.approx(-60.24, abs=0.01) and test.ci_high == -test.ci_low
    assert test.interval.startswith("exact")
    with pytest.raises(ValueError, match="differ in length"):
        paired_test(same, same[:3])


# --- the random-set null ---------------------------------------------------------------------------------------------

def test_random_head_sets_are_distinct_seeded_and_exclude_the_selection():
    heads = GEOMETRY.all_heads()
    frozen = (HeadId(0, 0), HeadId(1, 1))
    sets = random_head_sets(heads, 2, 20, seed=[0, 1], exclude=[frozen])
    assert len(sets) == len(set(sets)) == 20 and all(len(s) == 2 for s in sets) and frozen not in sets
    assert random_head_sets(heads, 2, 20, seed=[0, 1], exclude=[frozen]) == sets
    assert random_head_sets(heads, 2, 20, seed=[0, 2], exclude=[frozen]) != sets
    assert len(random_head_sets(heads, 11, 100, seed=0)) == math.comb(12, 11)  # fewer exist than asked for
    assert len(random_head_sets(heads[:3], 1, 5, seed=0, exclude=[(heads[0],)])) == 2


def test_null_position():
    null = [-2.0, -1.0, 0.0, 0.0, 1.0, 3.0]
    position = null_position(1.0, null)
    assert position["percentile"] == pytest.approx(scipy_stats.percentileofscore(null, 1.0, kind="mean"))
    assert position["p_value"] == pytest.approx((1 + 2) / 7)  # 1.0 and 3.0 are >= 1.0
    assert null_position(5.0, null)["p_value"] == pytest.approx(1 / 7)
    assert math.isnan(null_position(1.0, [])["p_value"])


# --- stability ---------------------------------------------------------------------------------------------------

def test_jaccard_and_frequencies():
    a, b, c = (HeadId(0, 0), HeadId(1, 1)), (HeadId(1, 1),), (HeadId(2, 0),)
    assert jaccard(a, b) == 0.5 and jaccard(a, c) == 0.0 and jaccard((), ()) == 1.0
    assert mean_pairwise_jaccard([a, b, c]) == pytest.approx((0.5 + 0 + 0) / 3)
    heads, sets = selection_frequencies([a, b, b, c])
    assert heads == {"L1.H1": 0.75, "L0.H0": 0.25, "L2.H0": 0.25}
    assert list(sets) == ["L1.H1", "L0.H0+L1.H1", "L2.H0"] and sets["L1.H1"] == 0.5


def test_resample_indices():
    boot = resample_indices(10, 3, "bootstrap", seed=4)
    assert [len(i) for i in boot] == [10, 10, 10] and resample_indices(10, 3, "bootstrap", seed=4)[2].tolist() == boot[2].tolist()
    halves = resample_indices(11, 4, "halves", seed=4)
    assert len(halves[0]) == 6 and len(halves[1]) == 5
    assert sorted(np.concatenate(halves[:2]).tolist()) == list(range(11))  # complementary halves
    assert set(halves[2].tolist()) != set(halves[0].tolist())
    with pytest.raises(ValueError, match="unknown resampling method"):
        resample_indices(10, 2, "jackknife")


def test_outcome_table_evaluates_each_intervention_once_in_one_call():
    inner = XorEvaluator(np.zeros(6, bool), random_flips(6, 0, rate=0.5))
    table = OutcomeTable(inner)
    a, b = (HeadId(0, 1),), (HeadId(2, 2), HeadId(0, 1))
    first = table.evaluate([(), a, b, a])
    assert inner.calls == [[(), a, head_set(b)]]  # duplicates and order: each missing one once
    again = table.evaluate([b, (HeadId(3, 0),), ()])
    assert inner.calls[1] == [(HeadId(3, 0),)]
    assert again[0] is first[2] and table.evaluated == [(), a, head_set(b), (HeadId(3, 0),)]
    assert table.lm.geometry == GEOMETRY  # an evaluator itself
    view = Resampled(table, [5, 5, 0])
    (sub,) = view.evaluate([a])
    assert sub.item_ids == ["i5", "i5", "i0"] and np.array_equal(sub.correct, first[1].correct[[5, 5, 0]])
    assert len(inner.calls) == 2


def test_resampled_search_equals_algorithm_1_on_the_resampled_items_and_batches_new_subsets():
    n = 40
    base = np.random.default_rng(9).random(n) < 0.4
    flips = random_flips(n, 1)
    table = OutcomeTable(XorEvaluator(base, flips))
    original = run_search(table, p=4, k=3)
    calls_after_search = len(table.evaluator.calls)
    indices = resample_indices(n, 6, "bootstrap", seed=0) + [np.arange(n)]
    searches = resampled_searches(table, 4, 3, indices)
    assert len(table.evaluator.calls) - calls_after_search <= 1  # every new subset in one batched call
    assert searches[-1].frozen == original.frozen  # the identity resample is the run itself
    for idx, found in zip(indices, searches):
        fresh = XorEvaluator(base[idx], {h: m[idx] for h, m in flips.items()})
        direct = run_search(fresh, p=4, k=3)
        assert found.frozen == direct.frozen and found.best == direct.best
        assert [s.heads for s in found.stage2] == [s.heads for s in direct.stage2]


def _synthetic_run(n_disc: int = 30, n_hold: int = 50):
    """A search and holdout on synthetic items, with a planted head that helps on both."""
    flips_d, flips_h = random_flips(n_disc, 2), random_flips(n_hold, 3)
    planted = HeadId(2, 1)
    flips_h[planted] = np.zeros(n_hold, bool)
    flips_h[planted][:10] = True  # the planted head helps on 10 holdout items, harms none
    flips_d[planted] = np.zeros(n_disc, bool)
    flips_d[planted][:12] = True
    discovery = OutcomeTable(XorEvaluator(np.zeros(n_disc, bool), flips_d))
    holdout_eval = XorEvaluator(np.zeros(n_hold, bool), flips_h)
    search = run_search(discovery, p=3, k=2)
    return search, evaluate_holdout(holdout_eval, search.frozen), discovery, holdout_eval, flips_h


def test_assess_run_end_to_end_on_synthetic_data():
    search, holdout, discovery, holdout_eval, flips_h = _synthetic_run()
    n_hold = len(holdout.full.correct)
    kwargs = dict(n_random_sets=15, n_resamples=8, resample="bootstrap", seed=5)
    result = assess_run(search, holdout, discovery, holdout_eval, **kwargs)
    assert len(holdout_eval.calls) == 2  # the holdout run, then every null set and selection in one call
    sig = result["significance"]
    assert sig["gain_points"] == pytest.approx(holdout.gain) and sig["help"] == holdout.score.help
    assert result["winners_curse"]["gap_points"] == pytest.approx(search.best.gain - holdout.gain)
    null = result["null"]
    assert null["n_sets"] == 15 and null["size"] == len(search.frozen)
    assert format_heads(search.frozen) not in null["sets"]
    stab = result["stability"]
    assert len(stab["selections"]) == 8 and len(stab["holdout_gains_points"]) == 8
    assert sum(stab["set_frequency"].values()) == pytest.approx(1.0)
    assert 0.0 <= stab["mean_jaccard"] <= 1.0
    assert result["cost"]["extra_holdout_evaluations"] == len(holdout_eval.calls[1])
    # deterministic for a fixed seed; a plain evaluator (not a table) gives the same answer, at more cost
    again = assess_run(search, holdout, discovery, XorEvaluator(np.zeros(n_hold, bool), flips_h), **kwargs)
    assert {k: v for k, v in again.items() if k not in ("timings", "cost")} == \
           {k: v for k, v in result.items() if k not in ("timings", "cost")}
    plain = assess_run(search, holdout, discovery.evaluator, holdout_eval, **kwargs)
    assert plain["stability"] == result["stability"]
    off = assess_run(search, holdout, discovery, holdout_eval, **{**kwargs, "n_random_sets": 0, "n_resamples": 0})
    assert off["null"] is None and off["stability"] is None


def test_a_null_on_a_seeded_random_subset_of_the_holdout_is_the_null_of_a_holdout_of_those_items():
    from cel_utils.stats.reliability import null_item_indices

    search, holdout, discovery, holdout_eval, flips_h = _synthetic_run()
    kwargs = dict(n_random_sets=15, n_resamples=4, resample="bootstrap", seed=5)
    whole = assess_run(search, holdout, discovery, holdout_eval, **kwargs)
    indices = null_item_indices(50, 20, seed=5)
    # a random subset (not the holdout's first items, which need not be a random sample), seeded, in holdout order
    assert len(set(indices)) == 20 and list(indices) == sorted(indices) and list(indices) != list(range(20))
    assert np.array_equal(null_item_indices(50, 20, seed=5), indices)
    assert not np.array_equal(null_item_indices(50, 20, seed=6), indices)

    def subset(numbers) -> XorEvaluator:
        return XorEvaluator(np.zeros(len(numbers), bool), {h: m[numbers] for h, m in flips_h.items()}, indices=numbers)

    null_eval = subset(indices)
    part = assess_run(search, holdout, discovery, holdout_eval, **kwargs, null_evaluator=null_eval, null_indices=indices)
    assert len(null_eval.calls) == 1 and len(null_eval.calls[0]) == 15  # only the random sets: the rest is sliced
    short = subset(indices)
    alone = assess_run(search, evaluate_holdout(short, search.frozen), discovery, short, **{**kwargs, "n_resamples": 0})
    assert part["null"] == {**alone["null"], "n_items": 20, "item_indices": indices.tolist()}
    assert part["null"]["selected_gain_points"] != whole["null"]["selected_gain_points"]  # compared on the 20 items
    assert part["stability"] == whole["stability"]  # the resampled selections are still scored on the whole holdout
    assert part["cost"]["null_evaluations"] == 15
    with pytest.raises(ValueError, match="the holdout items at null_indices"):
        assess_run(search, holdout, discovery, holdout_eval, **kwargs, null_evaluator=subset(indices + 1),
                   null_indices=indices)


def test_take_keeps_every_field():
    outcome = Outcome(item_ids=["a", "b", "c"], correct=np.array([1, 0, 1], bool), margin=np.array([1.0, -2.0, 3.0]),
                      metrics={"acc": np.array([1, 0, 1], bool)}, predictions=[0, 1, 2])
    sub = take(outcome, [2, 0])
    assert sub.item_ids == ["c", "a"] and sub.predictions == [2, 0] and sub.margin.tolist() == [3.0, 1.0]


# --- what the results page and the run page show ---------------------------------------------------------------------

def test_the_results_page_places_the_papers_gains_against_each_runs_interval_and_discloses_the_looks(tmp_path):
    from test_report import make_artifact

    from cel_utils.book import results_page
    from cel_utils.book.facts import PAPER_TABLE

    paper = results_page.read_paper_table(REPO / PAPER_TABLE)
    artifact = make_artifact(task="boolq", full=0.4, ablated=0.42, n_items=500)
    artifact["reliability"] = {"significance": {"gain_points": 2.0, "ci_low": -0.5, "ci_high": 2.4, "p_value": 0.09,
                                                "confidence": 0.95}}
    page = results_page.results_markdown([artifact], paper)
    # BoolQ's printed gains: SmolLM3 +2.35 (inside [-0.5, +2.4]), Qwen2.5 +2.14 (inside), Llama +2.54 (above)
    assert ("SmolLM3-3B +2.35 (inside); Qwen2.5-3B-Instruct +2.14 (inside); Llama-3.2-3B-Instruct +2.54 (above)"
            == results_page.paper_gains_against("boolq", -0.5, 2.4, paper))
    assert "its interval holds the paper's gains of SmolLM3-3B, Qwen2.5-3B-Instruct but not the others" in page
    assert results_page.paper_gains_against("arithmetic_1dc", -2.0, 1.0, paper).endswith(
        "(the paper pools ten arithmetic configs)")
    assert "How often these holdouts were looked at" in page and "after an earlier main job had scored" in page


def test_the_book_draws_with_a_seed_no_preset_decision_saw_and_its_page_says_so():
    """Issue 26: the main job's holdouts were drawn with seed 0, whose holdout scores some preset decisions had seen;
    the book draws with BOOK_SEED, `cel main` defaults to it (and `grid` keeps 0), and the page calls those runs single
    looks without the seed-0 caveat."""
    from test_report import make_artifact

    from cel_utils.book import results_page
    from cel_utils.cli import parser
    from cel_utils.presets import BOOK_MODELS, BOOK_SEED

    assert BOOK_SEED != 0
    main = parser().parse_args(["main"])
    assert main.seeds == [BOOK_SEED] and main.models == list(BOOK_MODELS)
    assert parser().parse_args(["grid"]).seeds == [0]
    artifact = make_artifact(task="boolq", full=0.4, ablated=0.42, n_items=500)
    artifact["config"]["seed"] = BOOK_SEED
    page = results_page.results_markdown([artifact], [])
    assert f"draws its items with seed {BOOK_SEED}, which no screen or *m* decision has seen" in page
    assert "after an earlier main job had scored" not in page  # the seed-0 caveat is for seed-0 runs only


def test_a_page_words_the_verdict_from_the_artifacts_numbers_not_its_stored_text():
    """An artifact written before the verdicts were corrected stores "no effect larger than 2.9 points"; its pages
    must say what its interval supports."""
    from test_report import make_artifact

    from cel_utils.book import run_page

    artifact = make_artifact(task="hellaswag", full=0.4, ablated=0.416, n_items=500)
    artifact["reliability"] = {
        "significance": {"gain_points": 1.6, "ci_low": -0.4, "ci_high": 3.6, "p_value": 0.18, "confidence": 0.95},
        "power": {"alpha": 0.05, "power": 0.8, "n_items": 500, "n_discordant": 26, "min_detectable_gain_points": 2.9},
        "verdict": {"kind": "no effect", "text": "no effect larger than 2.9 points either way"}}
    text = run_page.verdict_of(artifact)["text"]
    assert "no effect larger" not in text and "effects outside [-0.4, +3.6] points are ruled out" in text
    del artifact["reliability"]["significance"], artifact["reliability"]["power"]
    artifact["holdout"]["full_correct"] = None  # an artifact older than the per-item outcomes (the schema's migration)
    assert run_page.verdict_of(artifact)["text"].startswith("no effect larger")  # no numbers: the stored words


def test_a_calibration_baseline_that_failed_on_the_holdout_is_not_a_baseline_beaten():
    from test_report import make_artifact

    from cel_utils.book import run_page

    artifact = make_artifact(task="boolq", full=0.4, ablated=0.5, n_items=500)
    failed = {"n_groups": 4, "folds": 5, "holdout_accuracy": 0.342, "holdout_gain_points": -5.8,
              "ablation_vs_calibration": {"gain_points": 7.4, "p_value": 0.00064}}
    artifact["reliability"] = {"calibration": failed}
    row = run_page.reliability_table(artifact).loc["calibration baseline (offsets fitted on discovery)"].iloc[0]
    assert row.startswith("34.2% on the holdout (-5.80 points") and "ablation minus calibration" not in row
    artifact["reliability"] = {"calibration": {**failed, "holdout_accuracy": 0.592, "holdout_gain_points": 19.2,
                                               "ablation_vs_calibration": {"gain_points": -8.4, "p_value": 0.0044}}}
    row = run_page.reliability_table(artifact).loc["calibration baseline (offsets fitted on discovery)"].iloc[0]
    assert row.endswith("ablation minus calibration -8.40, McNemar p = 0.004")


def test_results_page_shows_interval_p_value_null_and_stability(tmp_path):
    from test_report import make_artifact

    from cel_utils.book import results_page, run_page
    from cel_utils.pipeline.artifacts import write_json

    old = make_artifact(full=0.5, ablated=0.75, n_items=8)  # written before the reliability section existed
    old["holdout"]["full_correct"] = [1, 1, 1, 1, 0, 0, 0, 0]
    old["holdout"]["ablated_correct"] = [1, 1, 1, 1, 1, 1, 0, 0]
    write_json(tmp_path / "results" / "old.json", old)
    sig = run_page.significance(old)  # recomputed from the stored vectors, with the run's seed
    assert sig["help"] == 2 and sig["harm"] == 0 and sig["p_value"] == pytest.approx(0.5)
    assert sig == paired_test(old["holdout"]["full_correct"], old["holdout"]["ablated_correct"], seed=[0, 101]).to_json()

    new = make_artifact(task="boolq", full=0.5, ablated=0.75, n_items=8)
    new["reliability"] = {
        "power": None, "verdict": None, "calibration": None, "margin": None,  # not run here
        "significance": {**sig, "ci_low": -2.5, "ci_high": 50.0, "p_value": 0.0123},
        "winners_curse": {"discovery_gain_points": 50.0, "holdout_gain_points": 25.0, "gap_points": 25.0},
        "null": {"size": 2, "n_sets": 4, "sets": ["L0.H1+L1.H0"] * 4, "gains_points": [-12.5, 0.0, 0.0, 12.5],
                 "selected_gain_points": 25.0, "percentile": 100.0, "p_value": 0.2, "n": 4,
                 "quantiles": {"min": -12.5, "q25": 0.0, "median": 0.0, "q75": 0.0, "max": 12.5}},
        "stability": {"method": "bootstrap", "n_resamples": 4, "selections": ["L0.H0+L1.H2"] * 3 + ["L1.H2"],
                      "discovery_gains_points": [50.0] * 4, "holdout_gains_points": [25.0] * 3 + [12.5],
                      "head_frequency": {"L1.H2": 1.0, "L0.H0": 0.75}, "set_frequency": {"L0.H0+L1.H2": 0.75, "L1.H2": 0.25},
                      "frozen_set_frequency": 0.75, "mean_jaccard": 0.75, "mean_jaccard_to_frozen": 0.875,
                      "holdout_gain_quantiles": {"min": 12.5, "q25": 21.9, "median": 25.0, "q75": 25.0, "max": 25.0},
                      "mean_gap_points": 28.1, "distinct_selections": 2}}
    write_json(tmp_path / "results" / "new.json", new)
    page = results_page.write_results_page(tmp_path / "results", tmp_path / "results.md").read_text()
    assert "| tiny-model, boolq (seed 0) | 50.0 -> 75.0 (+25.0) | n/a | [-2.5, +50.0] | 0.012 |" in page
    # Across the runs, in words: the winner's curse and what 4 random sets can show; each run's checks on its page.
    assert "than on the holdout in 1 of 1 runs, by +25.0 to +25.0 points" in page
    assert "not beyond chance in 1 of 1 runs with random sets; with as few as 4 sets the smallest p a run can reach " \
           "is 0.20" in page
    assert "## Is the gain real?" not in page and "Jaccard" not in page  # not repeated on the results page
    assert "frozen set re-selected in 75%" in run_page.reliability_table(new).loc["selection stability"].iloc[0]
    old_row = next(line for line in page.splitlines() if line.startswith("| tiny-model, arithmetic_2da"))
    assert old_row.split(" | ")[4] == "0.50"  # the old artifact: its test recomputed from the stored vectors

    assert "exact McNemar p = 0.012" in run_page.reliability_sentence(new)
    assert "100th percentile" in run_page.reliability_sentence(new)
    table = run_page.stability_table(new)
    assert list(table.index) == ["L0.H0+L1.H2 (frozen)", "L1.H2"] and list(table["holdout gain (points)"]) == [25.0, 12.5]
    assert run_page.reliability_table(new).loc["exact McNemar p (two-sided)"].iloc[0] == "0.012"
    assert "not run" not in " ".join(run_page.reliability_table(new)[""])
    # a part the preset turned off is named as not run, not left out in silence
    off = {**new, "config": {**new["config"], "n_random_sets": 0, "n_resamples": 0},
           "reliability": {**new["reliability"], "null": None, "stability": None}}
    rows = run_page.reliability_table(off)[""]
    assert rows["selection stability"].startswith("not run (n_resamples = 0")
    assert rows["random sets of the same size"].startswith("not run (n_random_sets = 0")

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from cel_utils.book import plots

    for figure in (plots.null_histogram(new), plots.stability_figure(new), plots.null_histogram(old),
                   plots.stability_figure(old)):
        plt.close(figure)


@pytest.mark.parametrize("bad, message", [({"n_random_sets": -1}, "n_random_sets must be a non-negative integer"),
                                          ({"n_resamples": 2.5}, "n_resamples must be a non-negative integer"),
                                          ({"resample": "jackknife"}, "unknown resample 'jackknife': choose from bootstrap, halves")])
def test_run_config_checks_the_new_parameters(tmp_path, bad, message):
    from cel_utils.config import RunConfig

    with pytest.raises(ValueError, match=message):
        RunConfig(results_dir=str(tmp_path), **bad).validate()
    assert RunConfig(results_dir=str(tmp_path), n_random_sets=0, n_resamples=0, resample="halves").validate()
