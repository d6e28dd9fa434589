"""The artifact's format as types: the contract between a run and everything read from it afterwards.

A run's artifact (``kind: cel-run``), a model's transfer matrix (``cel-transfer``) and a strategies comparison
(``cel-strategies``) are JSON objects; their sections are declared here as :class:`typing.TypedDict` s, so a type checker
sees every read (``tests/test_schema.py`` runs mypy over the readers and fails on a key the schema does not declare),
and at run time they are plain dicts: an artifact's bytes are exactly what :func:`json.dumps` writes of them.

Every artifact is read through :func:`cel_utils.pipeline.artifacts.from_json`, which checks that the sections are there
(a clear error names a missing one) and upgrades an older file in **one** place,
:func:`~cel_utils.pipeline.artifacts.migrate_v1`: version 1 grew sections while its number
stayed 1 (the control, the floors, the precision record, the discovery flips, ...), and an artifact written before a
section existed gets that section as ``None`` (or the value its absence meant, as for ``config.ablation``). A reader
therefore never needs ``.get`` with a fallback for an old file: what may be absent is typed ``X | None``.
"""
# No `from __future__ import annotations` here: NotRequired must be seen at class creation (Python 3.11 does not
# find it in string annotations, and would call every key required).
from typing import Any, NotRequired, TypedDict

from cel_utils.pipeline.stats_schema import Margin, PairedTest, Power, Reliability, Verdict

SCHEMA_VERSION = 2
RUN, TRANSFER, STRATEGIES = "cel-run", "cel-transfer", "cel-strategies"


# -- pieces shared by several sections ---------------------------------------------------------------------------------

class HeadScore(TypedDict):
    """One evaluated head set on the discovery items (a stage-1 or stage-2 row)."""
    heads: list[str]
    accuracy: float
    gain_points: float
    n_correct: int
    harm: int
    help: int


class Geometry(TypedDict):
    n_layers: int
    n_heads: int
    n_kv_heads: int
    head_dim: int


# -- a run's artifact --------------------------------------------------------------------------------------------------

class ModelSection(TypedDict):
    spec: str
    name: str
    source: dict[str, Any] | None  # how the weights were found (a gguf file and its sha256, a hub id, ...)
    fingerprint: str
    dtype: str
    device: str
    geometry: Geometry
    model_type: str


class Audit(TypedDict):
    """The guarded precision's audit (:meth:`cel_utils.evaluation.guard.Guard.to_json`)."""
    multiple: float
    band: float | None  # the widest: multiple x the largest error seen anywhere
    largest_error: float | None
    # per third of the layers by the first ablated layer (None where no pair had a depth: decoding): each third's band
    # and the errors it was set from (a third with fewer than guard.GROUP_EVIDENCE has the widest band); since issue 46
    depth_bands: NotRequired[list[float] | None]
    depth_evidence: NotRequired[list[int] | None]
    group_evidence: NotRequired[int]  # the audited pairs a third needs for a band of its own
    initial_audit_pairs: int
    audit_share: float
    pairs: int
    rechecked: int
    share_rechecked: float | None
    audited: int
    bf16_decisions_caught: int
    audited_decisions_differed: int
    fell_back_to_fp32: str | None
    pairs_after_fall_back: int


class Precision(TypedDict):
    setting: str
    resolved: str
    approximate: bool
    audit: Audit | None


class Prompt(TypedDict):
    format: str
    bos: bool


class TaskSection(TypedDict):
    name: str
    kind: str
    metric: str
    metrics: list[str]


class Split(TypedDict):
    source: str | None
    path: NotRequired[str | None]
    dataset: NotRequired[str | None]
    config: NotRequired[str | None]
    split: NotRequired[str | None]
    rows: NotRequired[int]


class Data(TypedDict):
    """Where the items came from (:func:`cel_utils.tasks.data.load_task_data`'s provenance)."""
    source: str
    splits: NotRequired[list[Split]]
    seed: NotRequired[int]
    n_discovery: int | None
    n_holdout: NotRequired[int]
    num_fewshot: NotRequired[int]
    fewshot_ids: NotRequired[list[str]]
    fallback: NotRequired[str]
    discovery_candidates_dropped_as_duplicates: NotRequired[int]


class Discovery(TypedDict):
    item_ids: list[str]
    full_accuracy: float
    full_correct: list[int]
    full_metrics: dict[str, float]


class Stage1Method(TypedDict):
    """Exact (every head scored), or which screen passed how many heads on (:mod:`cel_utils.search.screening`)."""
    method: str
    screen: NotRequired[str]
    keep: NotRequired[int]
    n_heads: NotRequired[int]
    forward_equivalents: NotRequired[float]
    order: NotRequired[list[str]]
    scores: NotRequired[list[list[float]]]
    candidates: NotRequired[int]
    boundary_items: NotRequired[int]


class Frozen(TypedDict):
    heads: list[str]
    label: str
    discovery: HeadScore


class DiscoveryFlips(TypedDict):
    """The discovery items each scored set flipped (:mod:`cel_utils.pipeline.discovery_flips`)."""
    items: dict[str, dict[str, Any]]
    sets: dict[str, dict[str, dict[str, int]]]


class Example(TypedDict):
    direction: str
    item: str
    prompt_end: str
    gold: str
    full: str
    ablated: str


class Holdout(TypedDict):
    heads: list[str]
    heads_label: str
    full_accuracy: float
    ablated_accuracy: float
    gain_points: float
    relative_error_reduction: float
    harm: int
    help: int
    n_items: int
    full_metrics: dict[str, float]
    ablated_metrics: dict[str, float]
    # Per item; None where an artifact predates them (its page then shows no test, no answer shares)
    item_ids: list[str] | None
    full_correct: list[int] | None
    ablated_correct: list[int] | None
    full_metric_vectors: dict[str, list[int]] | None
    ablated_metric_vectors: dict[str, list[int]] | None
    full_predictions: list[Any] | None  # an answer index (multiple choice), a code completion and its status, or None
    ablated_predictions: list[Any] | None
    examples: list[Example]


class BestConstant(TypedDict):
    answer: str
    accuracy: float
    what: str


class Floors(TypedDict):
    """The trivial accuracies on the holdout items (:mod:`cel_utils.tasks.floors`)."""
    n_items: int
    chance: float | None
    best_constant: BestConstant | None
    labels: list[str] | None
    labels_shared: bool
    gold_shares: list[float] | None
    note: NotRequired[str]


class Means(TypedDict):
    items: str
    n_items: int
    n_tokens: int
    sha256: str
    what: str


class Control(TypedDict):
    """The frozen set under the other ablation on the same holdout items (:mod:`cel_utils.pipeline.control`)."""
    ablation: str
    search_ablation: str
    means: Means
    heads: list[str]
    heads_label: str
    n_items: int
    accuracy: float
    metrics: dict[str, float]
    correct: list[int]
    predictions: list[Any]
    vs_full: PairedTest
    vs_search: PairedTest
    margin: Margin | None


class Sandbox(TypedDict):
    protections: list[str]
    unguarded: list[str]
    warning: str | None


class RunArtifact(TypedDict):
    """One CEL run (model, task, seed): :func:`cel_utils.pipeline.protocol.build_artifact` writes it."""
    schema_version: int
    kind: str
    config: dict[str, Any]  # dataclasses.asdict(RunConfig): cel_utils.config declares every setting once
    model: ModelSection
    precision: Precision | None
    prompt: Prompt | None
    task: TaskSection
    data: Data
    discovery: Discovery
    stage1: list[HeadScore]
    stage1_method: Stage1Method
    pool: list[str]
    stage2: list[HeadScore]
    frozen: Frozen
    discovery_flips: DiscoveryFlips | None
    holdout: Holdout
    floors: Floors | None
    control: Control | None
    n_interventions_evaluated: int
    reliability: Reliability | None
    sandbox: Sandbox | None
    versions: dict[str, str]
    # Only in version-1 artifacts written before the run info existed (pipeline.artifacts.run_info_path): their
    # wall times, inline. Kept by the migration so that their pages still show them; never written now.
    timings: NotRequired[dict[str, float]]


# -- a model's transfer matrix -----------------------------------------------------------------------------------------

class TransferCell(TypedDict):
    source: str
    target: str
    diagonal: bool
    heads: list[str]
    heads_label: str
    n_items: int
    n_holdout: int
    item_indices: list[int]
    full_accuracy: float
    ablated_accuracy: float
    gain_points: float
    full_correct: list[int]
    ablated_correct: list[int]
    help: int
    harm: int
    significance: PairedTest
    power: Power
    verdict: Verdict


class TransferModel(TypedDict):
    name: str
    spec: str
    fingerprint: str
    dtype: str
    geometry: Geometry


class TransferArtifact(TypedDict):
    """:func:`cel_utils.pipeline.transfer.run_transfer` writes it: every frozen set of a model on every task."""
    schema_version: int
    kind: str
    model: TransferModel
    seed: int
    tasks: list[str]
    metrics: dict[str, str]
    inputs: dict[str, Any]  # the run artifacts it was computed from, by sha256, and the subset sizes
    cells: list[TransferCell]
    versions: dict[str, str]


# -- a comparison of search strategies ---------------------------------------------------------------------------------

class StrategiesArtifact(TypedDict):
    """:func:`cel_utils.pipeline.strategies_run.compare_strategies` writes it: other searches against Algorithm 1."""
    schema_version: int
    kind: str
    config: dict[str, Any]  # dataclasses.asdict(StrategiesConfig)
    beam_width: int
    attribution_candidates: int
    model: dict[str, Any]
    task: dict[str, Any]
    data: Data
    n_discovery: int
    n_holdout: int
    full: dict[str, float]
    strategies: list[dict[str, Any]]  # one row per strategy: its set, discovery and holdout gains, cost
    screening: dict[str, Any] | None  # the screens' recall of exhaustive stage 1, where it was measured
    attribution_skipped: str | None
    cost_unit: str


# -- reading and writing ------------------------------------------------------------------------------------------------
