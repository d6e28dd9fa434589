"""How far to trust one run's gain, beyond the point estimate the paper reports.

:func:`assess_run` adds to a finished run (search + holdout), in this order of cost:

1. **significance** (free): the exact McNemar p-value and a paired bootstrap interval of the holdout gain
   (:func:`cel_utils.stats.paired_test`), and beside it the paired change of the gold answer's margin
   (:func:`margin_change`), a secondary measure;
2. **winner's curse** (free): discovery gain minus holdout gain of the frozen set. The search picked the best
   of hundreds of interventions on the discovery items, so its discovery gain is biased upwards;
3. **random-set null** (``n_random_sets`` holdout evaluations): the holdout gains of random head sets of the
   frozen set's size, and where the frozen set's gain falls among them. They may be scored on a seeded random subset
   of the holdout only (:func:`null_item_indices`; a random subset whatever order the holdout's items come in); the
   frozen set is then compared on the same items, from the per-item outcomes the holdout already has;
4. **stability** (``n_resamples`` reruns of Algorithm 1): the whole selection is rerun on resampled discovery
   sets (``bootstrap``: n items drawn with replacement; ``halves``: pairs of complementary random halves, so
   consecutive selections come from disjoint items). Per-item outcomes on the discovery set are
   deterministic, so a resample only indexes the vectors of the run's discovery :class:`OutcomeTable`; what
   a resample needs that the run never evaluated (the subsets of its own pool) is evaluated once, on all
   discovery items, in one batched call for all resamples. Each distinct selection is then scored on the
   holdout, batched together with the null's random sets. A run with a screened stage 1 is resampled screened too:
   the screen's per-item numbers are indexed like the outcomes, and only heads a resampled screen passes on that the
   run never evaluated cost an exact evaluation.

Every draw is seeded from the run's seed, so a run is reproducible to the bit.
"""
from __future__ import annotations

import time

import numpy as np

from cel_utils.config import RESAMPLE_METHODS
from cel_utils.evaluation.evaluator import EvaluatorProtocol, Intervention
from cel_utils.evaluation.outcomes import OutcomeTable, Resampled, take
from cel_utils.models.heads import format_heads, head_set
from cel_utils.search.algorithm import HoldoutResult, SearchResult, run_search
from cel_utils.search.ranking import pool_subsets, rank_singles, score
from cel_utils.search.screening import Screen
from cel_utils.stats.power import discordant, power_json, verdict
from cel_utils.stats.significance import (
    CI_STREAM,
    jaccard,
    mean_pairwise_jaccard,
    null_position,
    paired_mean_change,
    paired_test,
    random_head_sets,
    selection_frequencies,
)

# Independent random streams per use, all derived from the run's seed (stats.CI_STREAM = 101 for the interval,
# calibration.CV_STREAM = 104 for its folds).
_NULL_STREAM, _RESAMPLE_STREAM, _NULL_ITEMS_STREAM = 102, 103, 105
MARGIN_STREAM = 106  # the margin change's bootstrap interval


def null_item_indices(n_holdout: int, n_items: int, seed: int = 0) -> np.ndarray:
    """Which holdout items (sorted indices) the random-set null is scored on: a seeded random subset of ``n_items``.

    Drawn here, not taken as the holdout's first items: with a train split the holdout is the validation split in
    dataset order, whose first items are not a random sample."""
    return np.sort(np.random.default_rng([seed, _NULL_ITEMS_STREAM]).choice(n_holdout, n_items, replace=False))


def resample_indices(n_items: int, n_resamples: int, method: str = "bootstrap", seed: int = 0) -> list[np.ndarray]:
    """Item indices of each resampled discovery set.

    ``bootstrap``: ``n_items`` draws with replacement. ``halves``: resamples 2j and 2j+1 are the two halves of
    one random permutation (disjoint; the first takes the extra item when ``n_items`` is odd).
    """
    if method not in RESAMPLE_METHODS:
        raise ValueError(f"unknown resampling method {method!r}: choose from {RESAMPLE_METHODS}")
    out = []
    for b in range(n_resamples):
        if method == "bootstrap":
            out.append(np.random.default_rng([seed, _RESAMPLE_STREAM, b]).integers(0, n_items, n_items))
        else:
            order = np.random.default_rng([seed, _RESAMPLE_STREAM, b // 2]).permutation(n_items)
            half = (n_items + 1) // 2
            out.append(np.sort(order[:half] if b % 2 == 0 else order[half:]))
    return out


def pools_of(discovery: OutcomeTable, indices: np.ndarray, p: int, screen: Screen | None = None,
             keep: int | None = None) -> list[Intervention]:
    """Stage 1 of Algorithm 1 on resampled items: the top ``p`` single heads by the paper's ranking, among all heads
    or, with a screen, among the screen's top ``keep`` on the same resampled items."""
    heads = discovery.lm.geometry.all_heads() if screen is None else screen.view(indices).top(keep)
    outcomes = discovery.evaluate([()] + [(head,) for head in heads], desc=f"stage 1: full + {len(heads)} heads")
    ranked = rank_singles(heads, [take(o, indices) for o in outcomes[1:]], take(outcomes[0], indices))
    return [s.heads for s in ranked[:p]]


def resampled_searches(discovery: OutcomeTable, p: int, k: int, indices: list[np.ndarray], screen: Screen | None = None,
                       keep: int | None = None) -> list[SearchResult]:
    """Algorithm 1 (:func:`cel_utils.search.run_search`, unchanged) on each resampled discovery set, screened as the
    run was (the screen's per-item numbers are resampled too, no new screening pass).

    What the resamples need beyond the run's own evaluations (heads a resampled screen passes on, subsets of the
    resampled pools) is evaluated in one batched call per stage, on all discovery items; that is only a batching
    step: ``run_search`` then makes the selections, and would evaluate anything the first pass missed.
    """
    if screen is not None:
        singles = [(h,) for idx in indices for h in screen.view(idx).top(keep)]
        todo = discovery.missing(singles)
        if todo:
            discovery.evaluate(todo, desc=f"stability: {len(todo)} heads the resampled screens pass on")
    wanted = []
    for idx in indices:
        wanted += pool_subsets([heads[0] for heads in pools_of(discovery, idx, p, screen, keep)], k)
    todo = discovery.missing(wanted)
    if todo:
        discovery.evaluate(todo, desc=f"stability: {len(todo)} subsets of the resampled pools")
    return [run_search(Resampled(discovery, idx), p=p, k=k, screen=None if screen is None else screen.view(idx),
                       keep=keep) for idx in indices]


def _holdout_subset(evaluator: EvaluatorProtocol, holdout: HoldoutResult, frozen, indices: np.ndarray) -> OutcomeTable:
    """A table over the holdout items at ``indices`` (``evaluator`` evaluates exactly those, in that order) that already
    knows the full model's and the frozen set's outcomes there (sliced from the holdout's, no evaluation)."""
    ids = [item.id for item in evaluator.items]
    if ids != [holdout.full.item_ids[i] for i in indices]:
        raise ValueError("the null's evaluator must evaluate the holdout items at null_indices, in the holdout's order")
    return OutcomeTable(evaluator, known={(): take(holdout.full, indices), frozen: take(holdout.ablated, indices)})


def _quantiles(values) -> dict[str, float]:
    values = np.asarray(values, dtype=float)
    if values.size == 0:
        return {}
    q = np.quantile(values, [0.0, 0.25, 0.5, 0.75, 1.0])
    return dict(zip(("min", "q25", "median", "q75", "max"), map(float, q)))


def margin_change(holdout: HoldoutResult, unit: str | None, seed: int = 0) -> dict | None:
    """The secondary measure beside the accuracy verdict: the paired change of the gold answer's margin over the
    holdout items (ablated - full), with its bootstrap interval. It sees every item move, not only those whose answer
    flipped, so it detects smaller effects, but its unit is the task's score, not accuracy; it never replaces the
    verdict. None where the margin only says right or wrong (``unit`` None: code that passed or failed)."""
    if unit is None:
        return None
    return {"unit": unit, **paired_mean_change(holdout.full.margin, holdout.ablated.margin, seed=[seed, MARGIN_STREAM])}


def _margin_unit(evaluator: EvaluatorProtocol) -> str | None:
    """What the evaluator's margins measure (its task kind says), None for an evaluator without a task."""
    from cel_utils.evaluation.kinds import kind_of

    task = getattr(evaluator, "task", None)
    return None if task is None else kind_of(task).margin_unit(task)


def assess_run(search: SearchResult, holdout: HoldoutResult, discovery: OutcomeTable | EvaluatorProtocol,
               holdout_evaluator: EvaluatorProtocol, *, n_random_sets: int, n_resamples: int,
               resample: str = "bootstrap", seed: int = 0, calibration: dict | None = None,
               null_evaluator: EvaluatorProtocol | None = None, null_indices: np.ndarray | None = None,
               floors: dict | None = None) -> dict:
    """Significance, winner's curse, random-set null and stability of one run, as the artifact stores them.

    ``calibration`` is the run's calibration baseline (:func:`cel_utils.stats.calibration.calibration_baseline`), stored
    and weighed in the verdict. ``discovery`` should be the table the search ran on (then only the resampled pools' new subsets cost
    anything); a plain evaluator is wrapped, and then stage 1 is evaluated again. ``null_evaluator``, if given,
    evaluates the holdout items at ``null_indices`` (:func:`null_item_indices`), and the random sets are scored on
    those only (default: the whole holdout).
    """
    timings: dict[str, float] = {}
    start = time.perf_counter()
    table = discovery if isinstance(discovery, OutcomeTable) else OutcomeTable(discovery, known={(): search.full})
    frozen = head_set(holdout.heads)
    significance = paired_test(holdout.full.correct, holdout.ablated.correct, seed=[seed, CI_STREAM])
    power = power_json(len(holdout.full.correct), discordant(holdout.full.correct, holdout.ablated.correct))
    result = {
        "significance": significance.to_json(),
        "winners_curse": {"discovery_gain_points": search.best.gain, "holdout_gain_points": holdout.gain,
                          "gap_points": search.best.gain - holdout.gain},
        "null": None, "stability": None,
        "power": power, "calibration": calibration,
        "verdict": verdict(significance.to_json(), power, calibration, floors=floors,
                           accuracies=(holdout.full_accuracy, holdout.ablated_accuracy)),
        "margin": margin_change(holdout, _margin_unit(holdout_evaluator), seed),
    }

    searches, n_before = [], len(table.evaluated)
    if n_resamples:
        indices = resample_indices(len(search.full.correct), n_resamples, resample, seed)
        searches = resampled_searches(table, search.p, search.k, indices, search.screen, search.keep)
    discovery_evaluations = len(table.evaluated) - n_before
    timings["stability_discovery_s"] = time.perf_counter() - start

    start = time.perf_counter()
    geometry = table.lm.geometry
    null_sets = random_head_sets(geometry.all_heads(), len(frozen), n_random_sets, seed=[seed, _NULL_STREAM],
                                 exclude=[frozen]) if n_random_sets else []
    selections = [s.frozen for s in searches]
    held = OutcomeTable(holdout_evaluator, known={(): holdout.full, frozen: holdout.ablated})
    null_table = held if null_evaluator is None else _holdout_subset(null_evaluator, holdout, frozen, null_indices)
    if null_table is held:  # one batched call, as before null_evaluator existed
        held.evaluate(null_sets + selections, desc="holdout: random sets and resampled selections")
    else:
        null_table.evaluate(null_sets, desc=f"holdout: random sets on {len(null_table.items)} items")
        held.evaluate(selections, desc="holdout: resampled selections")
    full = holdout.full

    def holdout_gain(heads, table: OutcomeTable = held) -> float:
        return score(heads, table.evaluate_one(heads), table.evaluate_one(())).gain

    if null_sets:
        gains = [holdout_gain(s, null_table) for s in null_sets]
        selected = holdout_gain(frozen, null_table)
        result["null"] = {"size": len(frozen), "n_sets": len(null_sets), "sets": [format_heads(s) for s in null_sets],
                          "gains_points": gains, "selected_gain_points": selected,
                          **null_position(selected, gains), "quantiles": _quantiles(gains)}
        if null_table is not held:  # only then, so that artifacts of whole-holdout nulls keep their bytes
            result["null"]["n_items"] = len(null_table.items)
            result["null"]["item_indices"] = [int(i) for i in null_indices]
    if searches:
        head_freq, set_freq = selection_frequencies(selections)
        holdout_gains = [holdout_gain(s) for s in selections]
        discovery_gains = [s.best.gain for s in searches]
        result["stability"] = {
            "method": resample, "n_resamples": n_resamples,
            "selections": [format_heads(s) for s in selections],
            "discovery_gains_points": discovery_gains,  # on each resample's own items (in-sample)
            "holdout_gains_points": holdout_gains,
            "head_frequency": head_freq, "set_frequency": set_freq,
            "frozen_set_frequency": set_freq.get(format_heads(frozen), 0.0),
            "mean_jaccard": mean_pairwise_jaccard(selections),
            "mean_jaccard_to_frozen": float(np.mean([jaccard(s, frozen) for s in selections])),
            "holdout_gain_quantiles": _quantiles(holdout_gains),
            "mean_gap_points": float(np.mean(np.subtract(discovery_gains, holdout_gains))),
            "distinct_selections": len(set(selections)),
        }
    timings["null_and_stability_holdout_s"] = time.perf_counter() - start
    result["cost"] = {"extra_discovery_evaluations": discovery_evaluations,
                      "extra_holdout_evaluations": len(held.evaluated), "holdout_items": len(full.correct),
                      "discovery_items": len(search.full.correct)}
    if null_table is not held:
        result["cost"]["null_evaluations"] = len(null_table.evaluated)
    result["timings"] = timings
    return result
