"""Claims made among many tests: families, Holm's adjustment, simultaneous intervals, and non-inferiority.

A book of CEL runs makes many tests at once. Each run's paired test is sound alone, but among eight of them one p below
0.05 is expected four times in ten even if no ablation did anything. The book therefore groups its tests in
*families* and adjusts within each:

* the **primary verdicts**, one per (model, task) run shown together (a lone ``cel run`` is a family of one);
* each model's **off-diagonal transfer cells** (every frozen set on every other task of that model).

Within a family, :func:`holm` adjusts the p-values (Holm's step-down: it controls the chance of any false "significant"
in the family at the verdicts' level, whatever the dependence between the tests, and rejects everything Bonferroni does
and sometimes more). Holm is used for the transfer family too, rather than Benjamini-Hochberg: the matrix's sentences
claim "this set hurts that task" cell by cell, which is a family-wise claim, and its non-inferiority bounds need
simultaneous coverage, which the false-discovery rate does not give. An interval quoted against another number (the
paper's gains, a non-inferiority margin) is the Bonferroni interval, at confidence ``1 - alpha / m``
(:func:`family_confidence`): Holm gives p-values, not intervals, and Bonferroni's intervals hold together.

**Non-inferiority** turns "not shown to hurt" into a claim with a size: harm larger than :data:`MARGIN_POINTS` is ruled
out where the family-adjusted one-sided lower bound of the gain clears ``-MARGIN_POINTS``
(:func:`noninferiority`). The margin was fixed before any transfer cell was read, as the smallest gain the paper
reports in its Table 1 (SmolLM3-3B on HellaSwag, +1.29 points): a deletion that may cost another task more than the
smallest enhancement the paper counts cannot be called free.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np

from cel_utils.stats.power import ALPHA
from cel_utils.stats.significance import CI_STREAM, CONFIDENCE, paired_test

# The non-inferiority margin in points, declared before data: Table 1's smallest gain (data/paper_table1.csv, checked
# by tests/test_claims.py).
MARGIN_POINTS = 1.29
HOLM = "Holm"


def holm(p_values: Sequence[float]) -> list[float]:
    """Holm's step-down adjusted p-values, in the given order (each at most 1; NaN stays NaN and counts no test)."""
    p = np.asarray(p_values, dtype=float)
    finite = np.flatnonzero(np.isfinite(p))
    adjusted = np.full(p.shape, np.nan)
    m = finite.size
    running = 0.0
    for rank, index in enumerate(finite[np.argsort(p[finite], kind="stable")]):
        running = max(running, min(1.0, (m - rank) * p[index]))
        adjusted[index] = running
    return [float(x) for x in adjusted]


def family_confidence(m: int, confidence: float = CONFIDENCE) -> float:
    """Each interval's confidence so that ``m`` of them hold together with ``confidence`` (Bonferroni)."""
    return 1 - (1 - confidence) / max(1, m)


@dataclass(frozen=True)
class Adjusted:
    """One test's place in its family: raw and adjusted p, the family's size and name, and the simultaneous interval."""

    family: str
    m: int
    p_raw: float
    p_adjusted: float
    ci_low: float  # at family_confidence(m)
    ci_high: float
    confidence: float
    method: str = HOLM

    @property
    def significant(self) -> bool:
        return self.p_adjusted <= ALPHA

    def to_json(self) -> dict:
        return {"family": self.family, "m": self.m, "p_raw": self.p_raw, "p_adjusted": self.p_adjusted,
                "method": self.method, "ci_low": self.ci_low, "ci_high": self.ci_high, "confidence": self.confidence}


def adjust_family(family: str, tests: Sequence[tuple[Sequence, Sequence, object]]) -> list[Adjusted]:
    """Every test of a family adjusted: ``tests`` are (full correct, ablated correct, seed) per member, in order; the
    p-values are the members' exact McNemar ones, the intervals their paired intervals at the family's confidence (same
    seed stream as each member's own interval)."""
    m = len(tests)
    confidence = family_confidence(m)
    raw = [paired_test(full, ablated).p_value for full, ablated, _ in tests]
    adjusted = holm(raw)
    out = []
    for (full, ablated, seed), p, q in zip(tests, raw, adjusted):
        wide = paired_test(full, ablated, confidence=confidence, seed=[seed, CI_STREAM])
        out.append(Adjusted(family, m, p, q, wide.ci_low, wide.ci_high, confidence))
    return out


def noninferiority(full_correct, ablated_correct, *, m: int = 1, margin: float = MARGIN_POINTS, seed: int = 0) -> dict:
    """Whether harm larger than ``margin`` points is ruled out: the one-sided lower bound of the gain at level
    ``alpha / m`` (the lower end of the two-sided interval at ``1 - 2 alpha / m``, bootstrap or exact as the paired
    test chooses) against ``-margin``."""
    level = 1 - 2 * ALPHA / max(1, m)
    test = paired_test(full_correct, ablated_correct, confidence=level, seed=[seed, CI_STREAM])
    bound = test.ci_low
    return {"margin_points": margin, "m": m, "alpha": ALPHA, "one_sided_level": 1 - ALPHA / max(1, m),
            "lower_bound_points": bound, "harm_ruled_out": bool(bound > -margin),
            "harm_not_ruled_out_points": max(0.0, -bound), "interval": test.interval}
