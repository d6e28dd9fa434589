"""The statistical sections of a run's artifact, as types: the paired test, its power and verdict, the margin change,
the random-set null, the stability analysis, the calibration baseline, and the ``reliability`` section that holds them
(:func:`cel_utils.stats.reliability.assess_run` writes it). :mod:`cel_utils.pipeline.schema` declares the rest of the
artifact with these; they sit apart only because the whole was long.
"""
# No `from __future__ import annotations` here: NotRequired must be seen at class creation (see schema.py).
from typing import NotRequired, TypedDict


class PairedTest(TypedDict):
    """:class:`cel_utils.stats.significance.PairedTest` as stored: gain, interval and exact McNemar p."""
    n_items: int
    help: int
    harm: int
    gain_points: float
    ci_low: float
    ci_high: float
    confidence: float
    n_resamples: int
    p_value: float
    test: str
    interval: str


class Power(TypedDict):
    alpha: float
    power: float
    n_items: int
    n_discordant: int
    min_detectable_gain_points: float | None


class Verdict(TypedDict):
    kind: str
    text: str
    at_floor: NotRequired[bool]


class Margin(TypedDict):
    """The gold answer's margin, ablated - full (:mod:`cel_utils.stats.reliability`), a secondary measure."""
    unit: str
    n_items: int
    n_left_out: int
    mean_change: float
    ci_low: float
    ci_high: float
    confidence: float
    share_up: float
    interval: str


class Quantiles(TypedDict):
    min: float
    q25: float
    median: float
    q75: float
    max: float


class Null(TypedDict):
    """Random head sets of the frozen set's size on the holdout (or a seeded subset of it)."""
    size: int
    n_sets: int
    sets: list[str]
    gains_points: list[float]
    selected_gain_points: float
    percentile: float
    p_value: float
    n: int
    quantiles: Quantiles
    n_items: NotRequired[int]
    item_indices: NotRequired[list[int]]


class WinnersCurse(TypedDict):
    discovery_gain_points: float
    holdout_gain_points: float
    gap_points: float


class Stability(TypedDict):
    method: str
    n_resamples: int
    selections: list[str]
    discovery_gains_points: list[float]
    holdout_gains_points: list[float]
    head_frequency: dict[str, float]
    set_frequency: dict[str, float]
    frozen_set_frequency: float
    mean_jaccard: float
    mean_jaccard_to_frozen: float
    holdout_gain_quantiles: Quantiles
    mean_gap_points: float
    distinct_selections: int


class Calibration(TypedDict):
    """The calibration baseline (:mod:`cel_utils.stats.calibration`): per-answer offsets fitted on discovery."""
    groups: str
    n_groups: NotRequired[int]
    cross_validated_accuracy: NotRequired[dict[str, float]]
    folds: NotRequired[int]
    offsets: list[float]
    length_edges: NotRequired[list[float] | None]
    discovery_accuracy: float
    holdout_accuracy: float
    holdout_gain_points: float
    holdout_correct: list[int]
    test: PairedTest
    ablation_vs_calibration: PairedTest


class Reliability(TypedDict):
    """:func:`cel_utils.stats.reliability.assess_run`; a part is None where it was not run or cannot be computed."""
    significance: PairedTest | None
    power: Power | None
    verdict: Verdict | None
    winners_curse: WinnersCurse | None
    null: Null | None
    stability: Stability | None
    calibration: Calibration | None
    margin: Margin | None
    cost: NotRequired[dict[str, int]]
