"""Statistics behind a CEL gain: numbers in, numbers out (no model here).

* **Paired significance on the holdout.** The full and the ablated model answer the *same* items, so the
  comparison is paired. Only discordant items carry information: ``help`` (wrong -> right) and ``harm``
  (right -> wrong). The exact McNemar test asks whether ``help`` is a fair coin's share of the ``help +
  harm`` discordant items (a two-sided binomial test, :func:`scipy.stats.binomtest`). The gain's confidence
  interval is a paired bootstrap: items are resampled with their (full, ablated) pair kept together, i.e.
  the per-item differences ``ablated - full`` in {-1, 0, 1} are resampled, and the percentile interval of
  their mean is reported (:func:`scipy.stats.bootstrap`, seeded). Where fewer than :data:`EXACT_BELOW` answers
  changed, resamples take only a handful of values and the percentile interval collapses (none changed: [0, 0], as
  if a change of any size were ruled out); there the interval is exact instead (:func:`exact_gain_interval`).
* **A null for the search.** Random head sets of the selected set's size, scored on the same holdout: where
  the selected set's gain falls among them (:func:`null_position`).
* **Stability.** How often each head and each exact set is selected across resampled discovery sets, and
  how much the selections overlap (:func:`jaccard`).
"""
from __future__ import annotations

import itertools
import math
from collections import Counter
from dataclasses import asdict, dataclass
from typing import Iterable, Sequence

import numpy as np
from scipy import stats

from cel_utils.models.heads import HeadId, format_heads, head_set

CONFIDENCE = 0.95
N_BOOTSTRAP = 10_000
CI_STREAM = 101  # the bootstrap interval of a run with seed s is drawn from np.random.default_rng([s, CI_STREAM])
# Below this many changed answers the gain's interval is exact (Clopper-Pearson), not bootstrapped: with D changed
# answers a resample's gain takes at most 2D + 1 values, and at D < 10 the percentile interval's ends sit on them.
EXACT_BELOW = 10
BOOTSTRAP_INTERVAL = "paired bootstrap, percentile"
EXACT_INTERVAL = (f"exact (fewer than {EXACT_BELOW} answers changed): Clopper-Pearson bounds on the share of changed "
                  "answers and on the helped share among them, at half the error rate each")


@dataclass(frozen=True)
class PairedTest:
    """The full vs the ablated model on the same items. Gains and interval ends are in points."""

    n_items: int
    help: int
    harm: int
    gain_points: float
    ci_low: float
    ci_high: float
    confidence: float
    n_resamples: int
    p_value: float  # exact McNemar, two-sided
    interval: str = BOOTSTRAP_INTERVAL  # how ci_low and ci_high were found

    def to_json(self) -> dict:
        fields = asdict(self)
        interval = fields.pop("interval")
        return {**fields, "test": "exact McNemar (two-sided binomial test on the discordant items)", "interval": interval}


def _as_bool(values) -> np.ndarray:
    return np.asarray(values, dtype=bool)


def mcnemar_exact(full_correct, ablated_correct) -> float:
    """Two-sided exact McNemar p-value; 1.0 when no item changed."""
    full, ablated = _as_bool(full_correct), _as_bool(ablated_correct)
    helped, harmed = int((~full & ablated).sum()), int((full & ~ablated).sum())
    if helped + harmed == 0:
        return 1.0
    return float(stats.binomtest(helped, helped + harmed, 0.5, alternative="two-sided").pvalue)


def paired_bootstrap_ci(full_correct, ablated_correct, *, confidence: float = CONFIDENCE,
                        n_resamples: int = N_BOOTSTRAP, seed=0) -> tuple[float, float]:
    """Percentile interval of the gain in points, resampling items with their pair kept together."""
    diff = _as_bool(ablated_correct).astype(float) - _as_bool(full_correct).astype(float)
    if diff.size == 0:
        return float("nan"), float("nan")
    if np.ptp(diff) == 0:  # every item changed the same way (usually: none changed): no spread to resample
        return 100.0 * float(diff[0]), 100.0 * float(diff[0])
    result = stats.bootstrap((diff,), np.mean, n_resamples=n_resamples, confidence_level=confidence,
                             method="percentile", vectorized=True, rng=np.random.default_rng(seed))
    return 100.0 * float(result.confidence_interval.low), 100.0 * float(result.confidence_interval.high)


def _clopper_pearson(successes: int, trials: int, confidence: float) -> tuple[float, float]:
    """The exact two-sided interval of a binomial share; [0, 1] with no trials."""
    if trials == 0:
        return 0.0, 1.0
    interval = stats.binomtest(successes, trials).proportion_ci(confidence_level=confidence, method="exact")
    return float(interval.low), float(interval.high)


def exact_gain_interval(n_items: int, helped: int, harmed: int, confidence: float = CONFIDENCE) -> tuple[float, float]:
    """An exact interval of the gain in points, for few changed answers.

    The gain is ``d (2 q - 1)``: ``d`` the share of items whose answer changes, ``q`` the helped share among them.
    Clopper-Pearson intervals for both, each at half the error rate (Bonferroni), hold together with at least
    ``confidence``; the gain's interval is its range over that box. With no changed answer ``q`` is unconstrained
    (its interval is [0, 1] for certain), so ``d`` takes the whole error rate and the interval is ``[-d_hi, +d_hi]``
    (about 3.7 / n at 95%, the rule of three's kin), never [0, 0]."""
    if n_items == 0:
        return float("nan"), float("nan")
    changed = helped + harmed
    each = confidence if changed == 0 else 1 - (1 - confidence) / 2
    d_low, d_high = _clopper_pearson(changed, n_items, each)
    q_low, q_high = _clopper_pearson(helped, changed, each)
    corners = [d * (2 * q - 1) for d in (d_low, d_high) for q in (q_low, q_high)]
    return 100.0 * min(corners), 100.0 * max(corners)


def paired_test(full_correct, ablated_correct, *, confidence: float = CONFIDENCE, n_resamples: int = N_BOOTSTRAP,
                seed=0) -> PairedTest:
    """Gain, its interval (paired bootstrap; exact below :data:`EXACT_BELOW` changed answers) and the exact McNemar
    p-value, from per-item correctness."""
    full, ablated = _as_bool(full_correct), _as_bool(ablated_correct)
    if full.shape != ablated.shape:
        raise ValueError(f"paired vectors differ in length: {full.shape} vs {ablated.shape}")
    helped, harmed = int((~full & ablated).sum()), int((full & ~ablated).sum())
    if helped + harmed < EXACT_BELOW:
        (low, high), interval = exact_gain_interval(len(full), helped, harmed, confidence), EXACT_INTERVAL
    else:
        low, high = paired_bootstrap_ci(full, ablated, confidence=confidence, n_resamples=n_resamples, seed=seed)
        interval = BOOTSTRAP_INTERVAL
    gain = 100.0 * (int(ablated.sum()) - int(full.sum())) / len(full) if len(full) else float("nan")
    return PairedTest(n_items=len(full), help=helped, harm=harmed, gain_points=gain, ci_low=low, ci_high=high,
                      confidence=confidence, n_resamples=n_resamples, p_value=mcnemar_exact(full, ablated),
                      interval=interval)


MEAN_CHANGE_DIGITS = 4  # significant digits; float32 rounding moves a margin in about the 7th


def _kept(value: float) -> float:
    return float(f"{value:.{MEAN_CHANGE_DIGITS}g}")


def paired_mean_change(before, after, *, confidence: float = CONFIDENCE, n_resamples: int = N_BOOTSTRAP,
                       seed=0) -> dict:
    """The mean per-item change ``after - before`` of a continuous score (the gold answer's margin) with its paired
    bootstrap percentile interval; items whose score is not finite on either side are left out (and counted).

    The mean and the interval are kept to :data:`MEAN_CHANGE_DIGITS` significant digits: the margins are float32
    logits, whose last bits move with the batch a row was scored in (a setting that changes no decision), and the
    artifact must be the same bytes whatever the batch size."""
    before, after = np.asarray(before, dtype=float), np.asarray(after, dtype=float)
    if before.shape != after.shape:
        raise ValueError(f"paired vectors differ in length: {before.shape} vs {after.shape}")
    keep = np.isfinite(before) & np.isfinite(after)
    diff = after[keep] - before[keep]
    if diff.size == 0:
        low = high = mean = float("nan")
    else:
        mean = float(diff.mean())
        if np.ptp(diff) == 0:
            low = high = mean
        else:
            result = stats.bootstrap((diff,), np.mean, n_resamples=n_resamples, confidence_level=confidence,
                                     method="percentile", vectorized=True, rng=np.random.default_rng(seed))
            low, high = float(result.confidence_interval.low), float(result.confidence_interval.high)
    return {"n_items": int(keep.sum()), "n_left_out": int((~keep).sum()), "mean_change": _kept(mean),
            "ci_low": _kept(low), "ci_high": _kept(high), "confidence": confidence, "share_up": float((diff > 0).mean()) if diff.size else float("nan"),
            "interval": BOOTSTRAP_INTERVAL}


# --- the random-set null ----------------------------------------------------------------------------------------

def random_head_sets(heads: Sequence[HeadId], size: int, n_sets: int, seed=0,
                     exclude: Iterable[Iterable[HeadId]] = ()) -> list[tuple[HeadId, ...]]:
    """``n_sets`` distinct head sets of ``size``, drawn uniformly from ``heads`` (fewer if fewer exist).

    Sets in ``exclude`` (the selected set) are never drawn. Deterministic for a given ``seed``.
    """
    heads = sorted(heads)
    if not 0 <= size <= len(heads):
        raise ValueError(f"cannot draw sets of {size} heads from {len(heads)}")
    excluded = {head_set(s) for s in exclude if len(head_set(s)) == size}
    available = math.comb(len(heads), size) - len(excluded)
    rng = np.random.default_rng(seed)
    drawn: dict[tuple[HeadId, ...], None] = {}
    while len(drawn) < min(n_sets, available):
        candidate = head_set(heads[i] for i in rng.choice(len(heads), size=size, replace=False))
        if candidate not in excluded:
            drawn[candidate] = None
    return list(drawn)


def null_position(selected: float, null: Sequence[float]) -> dict:
    """Where ``selected`` falls in a null sample.

    ``percentile``: the share of the null strictly below it, ties counted half (scipy's ``kind="mean"``);
    ``p_value``: the one-sided empirical p-value (1 + #null >= selected) / (1 + n), which counts the
    selected set as one draw of the null so it is never 0.
    """
    null = np.asarray(null, dtype=float)
    if null.size == 0:
        return {"percentile": float("nan"), "p_value": float("nan"), "n": 0}
    return {"percentile": float(stats.percentileofscore(null, selected, kind="mean")),
            "p_value": float((1 + np.sum(null >= selected)) / (1 + null.size)), "n": int(null.size)}


# --- stability ------------------------------------------------------------------------------------------------

def jaccard(a: Iterable[HeadId], b: Iterable[HeadId]) -> float:
    """|a & b| / |a | b|; two empty sets agree (1.0)."""
    a, b = set(a), set(b)
    return len(a & b) / len(a | b) if a | b else 1.0


def mean_pairwise_jaccard(selections: Sequence[Iterable[HeadId]]) -> float:
    pairs = [jaccard(a, b) for a, b in itertools.combinations(selections, 2)]
    return float(np.mean(pairs)) if pairs else float("nan")


def selection_frequencies(selections: Sequence[Iterable[HeadId]]) -> tuple[dict[str, float], dict[str, float]]:
    """Share of selections containing each head, and share equal to each exact set; most frequent first."""
    n = len(selections)
    if n == 0:
        return {}, {}
    heads = Counter((h,) for s in selections for h in head_set(s))
    sets = Counter(head_set(s) for s in selections)

    def ordered(counter: Counter) -> dict[str, float]:  # ties in (layer, head) order, like the ranking key
        return {format_heads(key): count / n for key, count in sorted(counter.items(), key=lambda kv: (-kv[1], kv[0]))}

    return ordered(heads), ordered(sets)
