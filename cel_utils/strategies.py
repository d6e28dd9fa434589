"""Search strategies side by side on the same discovery and holdout items.

* ``exhaustive`` -- the paper's Algorithm 1 (:func:`cel_utils.search.run_search`): every head alone, the top
  p form a pool, every subset of the pool of size 2..k;
* ``greedy`` -- forward selection over *all* heads: add the head that ranks best with the current set, stop
  at k heads or when no addition ranks above the best set so far;
* ``beam`` -- the same with the ``beam_width`` best sets kept at each size (width 1 is greedy);
* ``attribution pool`` -- attribution patching (:mod:`cel_utils.attribution`) ranks every head from one
  forward and backward pass; only its top ``attribution_candidates`` heads are evaluated exactly, and
  Algorithm 1 runs on them (``run_search`` restricted to those candidates);
* ``attribution top-k`` -- the k heads with the largest estimated margin gain, with no exact evaluation
  on discovery at all.

Every strategy ranks with the paper's key (:func:`cel_utils.search.rank`) and freezes the best-ranked set it
evaluated. They share one :class:`cel_utils.outcomes.OutcomeTable`, so nothing is evaluated twice, but each
strategy's cost counts everything it asked for, as if it had run alone:

* ``evaluations``: distinct interventions scored on the whole discovery set (the full model included);
* ``forward_equivalents``: forward passes of the full model over one item. Scoring intervention S costs
  ``n_items * (L - l_S) / L``, with l_S the lowest layer of S (the layers below are reused, as the engine
  does; the full model runs all L); generation (MBPP) counts 1 per item per intervention (its decoding
  reuses the layers below only for the shared few-shot prefix, which this count ignores);
  attribution costs ``3 * n_items`` (a backward pass is about two forwards).

:func:`compare_strategies` runs them all for one (model, task, seed) and returns a JSON-ready summary, also
written to ``<results_dir>/strategies/``; the notebook ``notebooks/cel_strategies.ipynb`` shows it.
"""
from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
from scipy import stats

from cel_utils.evaluation import Intervention
from cel_utils.heads import HeadId, format_heads, head_set
from cel_utils.outcomes import OutcomeTable
from cel_utils.search import Score, rank, rank_key, run_search, score
from cel_utils.stats import CI_STREAM, paired_test


class Ledger:
    """One strategy's view of the shared table: records every distinct intervention it asks for."""

    def __init__(self, table: OutcomeTable):
        self.table = table
        self.requested: dict[Intervention, None] = {}

    @property
    def lm(self):
        return self.table.lm

    def evaluate(self, interventions, desc: str | None = None):
        interventions = [head_set(heads) for heads in interventions]
        self.requested.update(dict.fromkeys(interventions))
        return self.table.evaluate(interventions, desc=desc)


@dataclass
class StrategyResult:
    name: str
    selected: Intervention
    discovery: Score | None  # None: never scored exactly on discovery (attribution top-k before the summary)
    requested: list[Intervention] = field(default_factory=list)
    extra_forward_equivalents: float = 0.0  # attribution's forward + backward passes
    notes: str = ""


def forward_equivalents(interventions: list[Intervention], n_items: int, n_layers: int, generate: bool = False) -> float:
    """Cost of scoring ``interventions`` on ``n_items`` items (see the module docstring)."""
    if generate:
        return float(n_items * len(interventions))
    return float(sum(n_items * (n_layers - (min(h.layer for h in heads) if heads else 0)) / n_layers
                     for heads in interventions))


def exhaustive(table: OutcomeTable, p: int, k: int) -> StrategyResult:
    ledger = Ledger(table)
    result = run_search(ledger, p=p, k=k)
    return StrategyResult("exhaustive (paper)", result.frozen, result.best, list(ledger.requested),
                          notes=f"all heads alone, then every subset of the top {p}")


def beam(table: OutcomeTable, k: int, width: int = 1) -> StrategyResult:
    """Beam search over head sets of size 1..k, ``width`` sets kept per size (1: greedy forward selection)."""
    if not isinstance(width, int) or width < 1:
        raise ValueError(f"beam width must be a positive integer, got {width!r}")
    ledger = Ledger(table)
    heads = ledger.lm.geometry.all_heads()
    full = ledger.evaluate([()])[0]
    frontier: list[Intervention] = [()]
    evaluated: list[Score] = []
    for size in range(1, k + 1):
        candidates = list(dict.fromkeys(head_set(s + (h,)) for s in frontier for h in heads if h not in s))
        outcomes = ledger.evaluate(candidates, desc=f"beam {width}: {len(candidates)} sets of {size}")
        ranked = rank([score(c, o, full) for c, o in zip(candidates, outcomes)])
        best_before = rank(evaluated)[0] if evaluated else None
        evaluated += ranked
        if best_before is not None and rank_key(ranked[0]) > rank_key(best_before):
            break  # no set of this size ranks above the best smaller one: adding heads stopped helping
        frontier = [s.heads for s in ranked[:width]]
    best = rank(evaluated)[0]
    name = "greedy" if width == 1 else f"beam (width {width})"
    return StrategyResult(name, best.heads, best, list(ledger.requested), notes=f"over all {len(heads)} heads")


def attribution_pool(table: OutcomeTable, estimate: np.ndarray, p: int, k: int, candidates: int,
                     cost: float) -> StrategyResult:
    """Algorithm 1 on the ``candidates`` heads with the largest estimated gain."""
    ledger = Ledger(table)
    top = top_heads(estimate, candidates)
    result = run_search(ledger, p=p, k=k, candidates=top)
    return StrategyResult("attribution pool", result.frozen, result.best, list(ledger.requested), cost,
                          notes=f"top {candidates} heads by attribution, then Algorithm 1 on them")


def top_heads(estimate: np.ndarray, n: int) -> list[HeadId]:
    """The ``n`` heads with the largest estimate; ties by (layer, head)."""
    flat = [(-float(estimate[l, h]), HeadId(l, h)) for l in range(estimate.shape[0]) for h in range(estimate.shape[1])]
    return [head for _, head in sorted(flat)[:n]]


def _rank_correlation(method, x: np.ndarray, y: np.ndarray) -> float:
    """scipy's rank correlation, NaN (without a warning) when either side is constant, e.g. no head changed accuracy."""
    if np.ptp(x) == 0 or np.ptp(y) == 0:
        return float("nan")
    return float(method(x, y).statistic)


def screening_agreement(estimate: np.ndarray, table: OutcomeTable, p: int) -> dict:
    """Attribution against exact single-head screening: rank correlations and recall of the exact top p."""
    geometry = table.lm.geometry
    heads = geometry.all_heads()
    outcomes = table.evaluate([()] + [(h,) for h in heads])
    full, singles = outcomes[0], outcomes[1:]
    margin_effect = np.array([float(np.mean(o.margin - full.margin)) for o in singles])
    gain = np.array([score((h,), o, full).gain for h, o in zip(heads, singles)])
    flat = np.array([estimate[h.layer, h.head] for h in heads])
    exact_pool = [s.heads[0] for s in rank([score((h,), o, full) for h, o in zip(heads, singles)])[:p]]
    shape = (geometry.n_layers, geometry.n_heads)
    return {
        "spearman_margin": _rank_correlation(stats.spearmanr, flat, margin_effect),
        "kendall_margin": _rank_correlation(stats.kendalltau, flat, margin_effect),  # tau-b: ties allowed
        "spearman_gain": _rank_correlation(stats.spearmanr, flat, gain),
        "kendall_gain": _rank_correlation(stats.kendalltau, flat, gain),
        "recall_at_p": len(set(exact_pool) & set(top_heads(estimate, p))) / p, "p": p,
        "exact_pool": [str(h) for h in exact_pool],
        "estimate": estimate.tolist(), "exact_margin_effect": margin_effect.reshape(shape).tolist(),
        "exact_gain_points": gain.reshape(shape).tolist(),
    }


def check_strategy_params(beam_width: int, attribution_candidates: int | None, p: int) -> int:
    """Check the strategies' own parameters; returns the number of attribution candidates (default: p)."""
    candidates = p if attribution_candidates is None else attribution_candidates
    if not isinstance(beam_width, int) or isinstance(beam_width, bool) or beam_width < 1:
        raise ValueError(f"beam_width must be a positive integer, got {beam_width!r}")
    if not isinstance(candidates, int) or isinstance(candidates, bool) or candidates < p:
        raise ValueError(f"attribution_candidates must be an integer >= p = {p} (the pool is drawn from them), "
                         f"got {candidates!r}")
    return candidates


def compare_strategies(config, *, beam_width: int = 3, attribution_candidates: int | None = None, lm=None,
                       progress: bool = True) -> dict:
    """Every strategy on one (model, task, seed) with the run's data draw; returns and writes the summary."""
    from cel_utils.artifacts import SCHEMA_VERSION, artifact_name, run_info_path, utc_now, write_json
    from cel_utils.attribution import head_attributions
    from cel_utils.models import load_model
    from cel_utils.protocol import make_evaluator
    from cel_utils.search import check_search_params
    from cel_utils.splits import load_task_data

    config.validate()
    candidates = check_strategy_params(beam_width, attribution_candidates, config.p)
    timings = {}
    data = load_task_data(config.task, config.n_discovery, config.n_holdout, seed=config.seed,
                          num_fewshot=config.num_fewshot, data_dir=config.data_dir)
    lm = lm or load_model(config.model, device=config.device, dtype=config.dtype)
    check_search_params(config.p, config.k, lm.geometry.n_total)
    discovery = OutcomeTable(make_evaluator(lm, data, data.discovery, config, progress))
    generate = data.task.kind == "generate"
    n, n_layers = len(data.discovery), lm.geometry.n_layers

    results: list[StrategyResult] = []
    for name, run in (("exhaustive", lambda: exhaustive(discovery, config.p, config.k)),
                      ("greedy", lambda: beam(discovery, config.k, 1)),
                      ("beam", lambda: beam(discovery, config.k, beam_width))):
        start = time.perf_counter()
        results.append(run())
        timings[f"{name}_s"] = time.perf_counter() - start
    screening = None
    if generate:
        skipped = "skipped: MBPP is scored by running generated code, which has no differentiable margin"
    else:
        skipped = ""
        start = time.perf_counter()
        attribution = head_attributions(discovery.evaluator)
        timings["attribution_s"] = time.perf_counter() - start
        results.append(attribution_pool(discovery, attribution.estimate, config.p, config.k, candidates,
                                        attribution.forward_equivalents))
        top_k = head_set(top_heads(attribution.estimate, config.k))
        results.append(StrategyResult("attribution top-k", top_k, None, [], attribution.forward_equivalents,
                                      notes="the k heads with the largest estimated gain, no exact evaluation"))
        screening = screening_agreement(attribution.estimate, discovery, config.p)
        full_margin = discovery.evaluate_one(()).margin
        screening["full_margin_max_abs_difference"] = float(np.max(np.abs(attribution.full_margins - full_margin)))

    start = time.perf_counter()
    holdout = OutcomeTable(make_evaluator(lm, data, data.holdout, config, progress))
    held = holdout.evaluate([()] + [r.selected for r in results], desc="holdout: full + every strategy's set")
    timings["holdout_s"] = time.perf_counter() - start
    full_disc = discovery.evaluate_one(())
    rows = []
    for result, outcome in zip(results, held[1:]):
        on_discovery = score(result.selected, discovery.evaluate_one(result.selected), full_disc)  # top-k: scored here, for the table only
        test = paired_test(held[0].correct, outcome.correct, seed=[config.seed, CI_STREAM])
        rows.append({"strategy": result.name, "heads": [str(h) for h in result.selected],
                     "label": format_heads(result.selected), "notes": result.notes,
                     "discovery_gain_points": on_discovery.gain, "discovery_harm": on_discovery.harm,
                     "holdout_gain_points": test.gain_points, "holdout_ci": [test.ci_low, test.ci_high],
                     "holdout_p_value": test.p_value,
                     "evaluations": len(result.requested),
                     "forward_equivalents": forward_equivalents(result.requested, n, n_layers, generate)
                     + result.extra_forward_equivalents})
    payload = {
        "schema_version": SCHEMA_VERSION, "kind": "cel-strategies",
        "config": asdict(config), "beam_width": beam_width, "attribution_candidates": candidates,
        "model": {"name": lm.name, "spec": lm.spec, "fingerprint": lm.fingerprint, "geometry": asdict(lm.geometry)},
        "task": {"name": data.task.name, "kind": data.task.kind, "metric": data.task.metric},
        "data": data.provenance, "n_discovery": n, "n_holdout": len(data.holdout),
        "full": {"discovery_accuracy": full_disc.accuracy, "holdout_accuracy": held[0].accuracy},
        "strategies": rows, "screening": screening, "attribution_skipped": skipped,
        "cost_unit": "forward passes of the full model over one discovery item",
    }
    # Like a run's artifact, the summary holds only what a rerun reproduces; wall times go beside it.
    path = Path(config.results_dir) / "strategies" / artifact_name(lm.name, data.task.name, config.seed)
    write_json(run_info_path(path), {"artifact": path.name, "created": utc_now(), "timings": timings})
    write_json(path, payload)
    payload["path"] = str(path)
    return payload
