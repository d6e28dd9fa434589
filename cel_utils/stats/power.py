"""What a holdout comparison could have detected, and the one-line verdict of a run.

The paired test of a run (:func:`cel_utils.stats.significance.paired_test`) is the exact McNemar test: of the D items
whose answer the ablation changed, it asks whether "helped" is a fair coin's share. Given D (as observed) and the
holdout size n, a gain of g points means help - harm = g n / 100 among the D, i.e. P(help | changed) =
(1 + g n / (100 D)) / 2. :func:`min_detectable_gain` is the smallest such gain that the two-sided test at level alpha
rejects with the given power. When even "every changed item was helped" is not significant (D <= 5 at alpha = 0.05),
no gain is detectable at that discordance: the comparison is underpowered.

:func:`verdict` puts a run into one of: a significant gain, a significant loss, not significant, or underpowered. A
non-significant result says only what its interval supports: effects outside the 95% interval are ruled out, effects
inside it are not. The smallest detectable change describes the design (what this holdout could have seen), not the
result, so the verdict gives it as design information and never as a bound on the effect. With a calibration baseline
the ablation is compared with the better of the full model and the calibrated one on the holdout: a baseline that is
worse than the full model there has failed, and the verdict says so instead of claiming the ablation beats it.
"""
from __future__ import annotations

from functools import lru_cache

import numpy as np
from scipy import stats

ALPHA = 0.05
POWER = 0.8


@lru_cache(maxsize=4096)
def _rejection_region(n_discordant: int, alpha: float) -> tuple[int, ...]:
    """Counts of helped items (out of ``n_discordant``) for which the exact two-sided McNemar test rejects."""
    return tuple(x for x in range(n_discordant + 1)
                 if stats.binomtest(x, n_discordant, 0.5, alternative="two-sided").pvalue <= alpha)


def mcnemar_power(n_discordant: int, p_help: float, alpha: float = ALPHA) -> float:
    """The probability that the exact test rejects when each changed item was helped with probability ``p_help``."""
    region = _rejection_region(n_discordant, alpha)
    return float(stats.binom.pmf(region, n_discordant, p_help).sum()) if region else 0.0


def min_detectable_gain(n_items: int, n_discordant: int, *, alpha: float = ALPHA, power: float = POWER) -> float | None:
    """The smallest gain in points the test detects with ``power`` at this size and discordance; None when none is."""
    if n_discordant < 1 or mcnemar_power(n_discordant, 1.0, alpha) < power:
        return None
    low, high = 0.5, 1.0  # P(help | changed): the power rises with it (bisection on a monotone function)
    for _ in range(50):
        middle = (low + high) / 2
        low, high = (middle, high) if mcnemar_power(n_discordant, middle, alpha) < power else (low, middle)
    return 100.0 * n_discordant * (2 * high - 1) / n_items


def power_json(n_items: int, n_discordant: int) -> dict:
    """What the artifact stores about the power of a holdout comparison."""
    mdg = min_detectable_gain(n_items, n_discordant)
    return {"alpha": ALPHA, "power": POWER, "n_items": n_items, "n_discordant": n_discordant,
            "min_detectable_gain_points": mdg}


def verdict(significance: dict, power: dict, calibration: dict | None = None, *, floors: dict | None = None,
            accuracies: tuple[float, float] | None = None, family: dict | None = None) -> dict:
    """One line for a run: ``kind`` (gain, loss, not significant, underpowered), ``text``, and ``at_floor``.

    ``family`` (:meth:`cel_utils.stats.multiplicity.Adjusted.to_json`) places the test among others: "significant"
    then needs the family-adjusted p, and the interval quoted as ruling effects out is the family-adjusted one; without
    it the run is a family of one. ``floors`` (:mod:`cel_utils.tasks.floors`) with the full and ablated
    ``accuracies`` put the floor first: a full model that does not beat its best trivial answer says so before
    anything else."""
    gain, p = significance["gain_points"], significance["p_value"]
    low, high = significance["ci_low"], significance["ci_high"]
    level = round(100 * significance.get("confidence", 0.95))
    alone = f"{level}% CI [{low:+.1f}, {high:+.1f}], p = {p:.2g}"
    many = family is not None and family["m"] > 1
    if many:
        q, (low, high) = family["p_adjusted"], (family["ci_low"], family["ci_high"])
        ci = (f"{alone}; among the {family['m']} tests of its family ({family['family']}): {family['method']} p = "
              f"{q:.2g}, family-adjusted {100 * family['confidence']:.1f}% CI [{low:+.1f}, {high:+.1f}]")
    else:
        q, ci = p, alone
    mdg = power["min_detectable_gain_points"]
    if q <= power["alpha"]:
        kind = "gain" if gain > 0 else "loss"
        text = f"a significant {kind}: {gain:+.1f} points ({ci})"
    elif mdg is None:
        kind = "underpowered"
        text = (f"underpowered: the ablation changed {power['n_discordant']} of {power['n_items']} holdout answers, too "
                f"few for the test to detect any gain ({gain:+.1f} points observed, {ci})")
    else:
        kind = "not significant"
        lead = (f"not significant among the {family['m']} tests of its family, though p = {p:.2g} alone"
                if many and p <= power["alpha"] else "not significant")
        text = (f"{lead}: {gain:+.1f} points ({ci}); effects outside [{low:+.1f}, {high:+.1f}] points are ruled out "
                f"at 95% confidence{' for the family together' if many else ''}, effects inside it are not (the "
                f"design: this holdout detects a change of {mdg:.1f} points with {100 * power['power']:.0f}% power)")
    if calibration:
        text += "; " + calibration_clause(calibration, power["alpha"])
    floor = floor_clause(floors, accuracies, significance["n_items"], power["alpha"]) if floors and accuracies else None
    if floor:
        text = f"{floor}; {text}"
    return {"kind": kind, "text": text, "at_floor": floor is not None}


def floor_name(floors: dict) -> tuple[str, float]:
    """The best trivial answer in words, and its accuracy (a fraction): the best constant answer, or chance."""
    from cel_utils.tasks.floors import floor_of

    best, chance = floors.get("best_constant"), floors.get("chance")
    if best and (chance is None or best["accuracy"] >= chance):
        answer = best["answer"]
        label = f"always answering {answer}" if answer.startswith("ending") else f'always answering "{answer}"'
        return label.replace("answering ending", "choosing ending"), best["accuracy"]
    if chance is not None:
        return "chance", chance
    return "solving nothing", floor_of(floors)


def above_floor_p(accuracy: float, n_items: int, floor: float) -> float:
    """One-sided exact binomial p that an accuracy on ``n_items`` items is above ``floor`` (a fixed rate)."""
    k = round(accuracy * n_items)
    if floor <= 0:
        return 0.0 if k > 0 else 1.0
    if floor >= 1:
        return 1.0
    return float(stats.binomtest(k, n_items, floor, alternative="greater").pvalue)


def floor_clause(floors: dict, accuracies: tuple[float, float], n_items: int, alpha: float = ALPHA) -> str | None:
    """``'at its floor: ...'`` when the full model is not shown to beat its best trivial answer on these items
    (one-sided exact binomial test at ``alpha``), with where the ablated model lands; None when it beats it."""
    name, floor = floor_name(floors)
    full, ablated = accuracies
    p_full = above_floor_p(full, n_items, floor)
    if p_full <= alpha:
        return None
    where = "below" if full < floor else "not significantly above" if full > floor else "exactly at"

    def pct(x: float) -> str:
        return f"{100 * x:.1f}%"

    p_ablated = above_floor_p(ablated, n_items, floor)
    then = ("still below it" if ablated < floor else "above it" if p_ablated <= alpha
            else "at it" if ablated == floor else "not significantly above it")
    return (f"at its floor: the full model's {pct(full)} is {where} {name} ({pct(floor)}), and the ablated model's "
            f"{pct(ablated)} is {then}")


def calibration_clause(calibration: dict, alpha: float = ALPHA) -> str:
    """The ablation against the better of the full model and the calibrated one, on the holdout.

    A baseline that does no better than the full model on the holdout (its offsets, fitted on discovery, did not
    carry over) has failed: then the full model, already tested above, is the baseline to beat, and nothing is
    claimed about beating the calibration.
    """
    baseline = calibration["holdout_gain_points"]
    if calibration.get("n_groups") == 1:
        return ("no calibration offsets helped on held-out discovery items (cross-validated), so the full model is the "
                "baseline to beat")
    if baseline <= 0:
        return (f"the calibration baseline fails on the holdout ({baseline:+.1f} points against the full model), so the "
                "full model is the baseline to beat")
    versus = calibration["ablation_vs_calibration"]
    difference, p = versus["gain_points"], versus["p_value"]
    if p <= alpha:
        word = "beats" if difference > 0 else "does worse than"
    else:
        word = "does not beat"
    return (f"it {word} the calibration baseline ({baseline:+.1f} points; ablation - calibration {difference:+.1f}, "
            f"p = {p:.2g})")


def discordant(full_correct, ablated_correct) -> int:
    full, ablated = np.asarray(full_correct, bool), np.asarray(ablated_correct, bool)
    return int((full != ablated).sum())
