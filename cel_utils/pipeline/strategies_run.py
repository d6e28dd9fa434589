"""Every search strategy (:mod:`cel_utils.search.strategies`) on one (model, task, seed), with the run's data draw:
one JSON summary in ``<results_dir>/strategies/`` (what ``python -m cel_utils strategies`` and its notebook show)."""
from __future__ import annotations

import time
from dataclasses import asdict

import numpy as np

from cel_utils.config import StrategiesConfig
from cel_utils.evaluation.kinds import kind_of
from cel_utils.evaluation.outcomes import OutcomeTable
from cel_utils.models.heads import format_heads, head_set
from cel_utils.pipeline.artifacts import SCHEMA_VERSION, run_info_path, utc_now, write_json
from cel_utils.pipeline.protocol import load_for, make_evaluator
from cel_utils.search.algorithm import check_search_params
from cel_utils.search.attribution import head_attributions
from cel_utils.search.ranking import score
from cel_utils.search.strategies import (
    StrategyResult,
    attribution_pool,
    beam,
    exhaustive,
    forward_equivalents,
    screening_agreement,
    top_heads,
)
from cel_utils.stats.significance import CI_STREAM, paired_test
from cel_utils.tasks.splits import load_task_data


def compare_strategies(config: StrategiesConfig, *, lm=None, progress: bool = True) -> dict:
    """Every strategy on one (model, task, seed) with the run's data draw; returns and writes the summary."""
    config.validate()
    candidates = config.attribution_candidates or config.p
    beam_width = config.beam_width
    timings = {}
    data = load_task_data(config.task, config.n_discovery, config.n_holdout, seed=config.seed,
                          num_fewshot=config.num_fewshot, data_dir=config.data_dir)
    lm = lm or load_for(config)
    check_search_params(config.p, config.k, lm.geometry.n_total)
    discovery = OutcomeTable(make_evaluator(lm, data, data.discovery, config, progress))
    generate = not kind_of(data.task).loglikelihood
    n, n_layers = len(data.discovery), lm.geometry.n_layers

    results: list[StrategyResult] = []
    for name, run in (("exhaustive", lambda: exhaustive(discovery, config.p, config.k)),
                      ("greedy", lambda: beam(discovery, config.k, 1)),
                      ("beam", lambda: beam(discovery, config.k, beam_width))):
        start = time.perf_counter()
        results.append(run())
        timings[f"{name}_s"] = time.perf_counter() - start
    screening = None
    if not kind_of(data.task).loglikelihood:  # the screen compares with exact decision margins, which code has none of
        skipped = "skipped: MBPP is scored by running generated code, which has no differentiable margin"
    else:
        skipped = ""
        start = time.perf_counter()
        attribution = head_attributions(discovery.sibling())  # on a plain evaluator (fp32's, if guarded), as screens do
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
        "model": {"name": lm.name, "spec": lm.spec, "fingerprint": lm.fingerprint, "source": lm.source,
                  "geometry": asdict(lm.geometry)},  # source: what --skip-existing compares the weights by
        "task": {"name": data.task.name, "kind": data.task.kind, "metric": data.task.metric},
        "data": data.provenance, "n_discovery": n, "n_holdout": len(data.holdout),
        "full": {"discovery_accuracy": full_disc.accuracy, "holdout_accuracy": held[0].accuracy},
        "strategies": rows, "screening": screening, "attribution_skipped": skipped,
        "cost_unit": "forward passes of the full model over one discovery item",
    }
    # Like a run's artifact, the summary holds only what a rerun reproduces; wall times go beside it.
    path = config.artifact_path
    write_json(run_info_path(path), {"artifact": path.name, "created": utc_now(), "timings": timings})
    write_json(path, payload)
    payload["path"] = str(path)
    return payload
