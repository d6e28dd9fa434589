"""One CEL run end to end: validate parameters, load model and data, search on discovery, evaluate the
frozen set on the holdout, and write the JSON artifact. The per-run notebook calls this; so can scripts.
"""
from __future__ import annotations

import time
import dataclasses
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from cel_utils.config import RunConfig
from cel_utils.evaluation.clean_passes import CleanPasses
from cel_utils.evaluation.evaluator import Evaluator, EvaluatorProtocol, NaiveEvaluator
from cel_utils.evaluation.guard import Guard
from cel_utils.evaluation.guarded import GuardedEvaluator
from cel_utils.evaluation.means import HeadMeans, discovery_means
from cel_utils.evaluation.kinds import kind_of
from cel_utils.evaluation.outcomes import OutcomeTable
from cel_utils.evaluation.precision import bf16_model, resolve_precision, warn_if_bf16_is_slow
from cel_utils.evaluation.store import EvalStore
from cel_utils.models.heads import HeadGeometry, format_heads
from cel_utils.models.loading import LoadedModel, load_model, resolve_device
from cel_utils.pipeline.artifacts import SCHEMA_VERSION, bits, library_versions, run_info_path, utc_now, write_json
from cel_utils.pipeline.control import score_control
from cel_utils.pipeline.discovery_flips import discovery_flips
from cel_utils.pipeline.examples import flip_examples
from cel_utils.pipeline.schema import RunArtifact
from cel_utils.sandbox import isolation_report
from cel_utils.search.algorithm import HoldoutResult, SearchResult, check_search_params, evaluate_holdout, run_search
from cel_utils.search.screening import run_screen
from cel_utils.stats.calibration import calibration_baseline
from cel_utils.stats.reliability import assess_run, null_item_indices
from cel_utils.tasks.prompts import resolve_bos
from cel_utils.tasks.catalog import get_task
from cel_utils.tasks.splits import TaskData, load_task_data


@dataclass
class CelRun:
    config: RunConfig
    lm: LoadedModel
    data: TaskData
    search: SearchResult
    holdout: HoldoutResult
    artifact: Path
    timings: dict = field(default_factory=dict)


def run_precision(config: RunConfig, device) -> str:
    """``config.precision`` as it resolves on ``device`` for this run's task and engine
    (:func:`cel_utils.evaluation.precision.resolve_precision` decides what ``auto`` means)."""
    return resolve_precision(config.precision, device, kind_of(get_task(config.task)), config.engine, config.ablation,
                             config.dtype)


def load_for(config: RunConfig) -> LoadedModel:
    """The model as ``config`` says: spec, device, dtype, attention kernel, revision, device map. A bf16 or guarded
    precision computes from float32 weights, so with dtype auto those are loaded (also on a GPU)."""
    dtype = config.dtype
    if dtype == "auto" and config.precision != "fp32" and run_precision(config, resolve_device(config.device)) != "fp32":
        dtype = "float32"
    return load_model(config.model, device=config.device, dtype=dtype, attn_implementation=config.attn_implementation,
                      revision=config.revision, device_map=config.device_map)


def make_evaluator(lm: LoadedModel, data: TaskData, items, config: RunConfig, progress: bool | str = True,
                   store: EvalStore | None = None, guard: Guard | None = None, means: HeadMeans | None = None,
                   clean_passes: CleanPasses | None = None) -> EvaluatorProtocol:
    """An evaluator of ``items`` as ``config`` says; with ``config.cache`` it reads and writes ``store``
    (default: the store under $CEL_CACHE_DIR). Under the guarded precision, ``guard`` holds the run's evidence about
    bf16's error (shared by the run's evaluators; default: a fresh one). With ``means`` it mean-ablates
    (:mod:`cel_utils.evaluation.means`). The fast engine reuses clean passes kept in ``clean_passes``
    (:mod:`cel_utils.evaluation.clean_passes`; shared by evaluators whose calls follow each other on the same items)."""
    if config.cache and store is None:
        store = EvalStore()
    kwargs = dict(fmt=config.fmt, bos=config.bos, batch_size=config.batch_size, max_new_tokens=config.max_new_tokens,
                  exec_timeout_s=config.exec_timeout_s, exec_memory_mb=config.exec_memory_mb, progress=progress,
                  store=store if config.cache else None, means=means)
    precision = run_precision(config, lm.device)
    if precision == "guarded" and lm.dtype != torch.float32:
        raise ValueError(f"precision guarded needs the model in float32 (it makes its own bfloat16 copy), got "
                         f"{str(lm.dtype).removeprefix('torch.')}: load it with dtype float32, or use precision fp32")

    def build(model: LoadedModel, **engine_kwargs) -> Evaluator:
        if config.engine == "fast":
            from cel_utils.evaluation.engine import EngineEvaluator

            return EngineEvaluator(model, data.task, items, data.fewshot, token_budget=config.token_budget,
                                   clean_passes=clean_passes, **kwargs, **engine_kwargs)
        return NaiveEvaluator(model, data.task, items, data.fewshot, **kwargs)

    if precision == "bf16":
        return build(bf16_model(lm))
    if precision == "guarded":  # its fast pass: fp32's clean pass and unembedding, bf16's ablated layers
        return GuardedEvaluator(build(lm), build(lm, above=bf16_model(lm)), guard or Guard(seed=config.seed))
    return build(lm)


def holdout_config(config: RunConfig, device: torch.device | str) -> RunConfig:
    """The settings of every evaluator of holdout items (the holdout, the control, the random-set null; the transfer
    matrix's cells): the run's, except that a run whose precision resolves to guarded scores them in fp32.

    Guarded keeps fp32's decisions under the primary metric, which is all the search reads, but not the numbers beside
    them (margins, HellaSwag's secondary ``acc``), which the holdout's pages print; its rechecks also know only
    zero-ablation (the control may mean-ablate). And a holdout call is the full model, fp32's own under guarded, and one
    set, where it saves least. So every number measured on the holdout is fp32's on every machine."""
    return dataclasses.replace(config, precision="fp32") if run_precision(config, device) == "guarded" else config


def precision_record(config: RunConfig, lm: LoadedModel, guard: Guard | None) -> dict:
    """What the artifact says about the precision: the setting, what it resolved to here, and the guard's audit."""
    precision = run_precision(config, lm.device)
    return {"setting": config.precision, "resolved": precision, "approximate": precision == "bf16",
            "audit": guard.to_json() if precision == "guarded" and guard is not None else None}


def run_cel(config: RunConfig, lm: LoadedModel | None = None, progress: bool | str = True) -> CelRun:
    config.validate()
    timings = {}
    start = time.perf_counter()
    data = load_task_data(config.task, config.n_discovery, config.n_holdout, seed=config.seed,
                          num_fewshot=config.num_fewshot, data_dir=config.data_dir)
    timings["data_s"] = time.perf_counter() - start
    if lm is None:
        start = time.perf_counter()
        lm = load_for(config)
        timings["model_load_s"] = time.perf_counter() - start
    check_search_params(config.p, config.k, lm.geometry.n_total)
    warn_if_bf16_is_slow(run_precision(config, lm.device), lm.device)
    store = EvalStore() if config.cache else None
    guard = Guard(seed=config.seed)  # used by the guarded precision only: one audit for the run's evaluators

    start = time.perf_counter()
    # The means mean-ablation replaces heads by, from the discovery prompts (the search's when ablation is mean, the
    # control's otherwise); the prompts are tokenized as the discovery evaluator will read them.
    discovery_prompts = kind_of(data.task).build_requests(data.task, data.discovery, data.fewshot, lm.tokenizer,
                                                          config.fmt, resolve_bos(lm.tokenizer, config.bos))
    means = discovery_means(lm, [r.context for r in discovery_prompts], cache=config.cache)
    timings["means_s"] = time.perf_counter() - start
    search_means = means if config.ablation == "mean" else None
    start = time.perf_counter()
    # Every evaluator is built (its items tokenized) before the search: a bad item fails now, not hours later.
    on_holdout = holdout_config(config, lm.device)  # fp32 where the search is guarded
    # Stage 2 starts from the states stage 1's clean passes kept, the control from the holdout call's; emptied between.
    clean_passes = CleanPasses()
    holdout_evaluator = make_evaluator(lm, data, data.holdout, on_holdout, progress, store, None, search_means,
                                       clean_passes)
    control_evaluator = make_evaluator(lm, data, data.holdout, on_holdout, progress, store, None,
                                       None if search_means is not None else means, clean_passes)
    # The table keeps every per-item outcome of the search, which the stability analysis resamples.
    discovery = OutcomeTable(make_evaluator(lm, data, data.discovery, config, progress, store, guard, search_means,
                                            clean_passes))
    screen = (run_screen(config.screen, discovery, candidates=config.screen_candidates, items=config.screen_items)
              if config.stage1 == "screened" else None)
    if screen is not None:
        timings["screen_s"] = screen.seconds
    clean_passes.clear()  # a screen's evaluations are on other items (or another model) than stage 1's
    search = run_search(discovery, p=config.p, k=config.k, screen=screen, keep=config.screen_keep)
    timings.update(search.timings)
    timings["search_s"] = time.perf_counter() - start
    clean_passes.clear()

    start = time.perf_counter()
    holdout = evaluate_holdout(holdout_evaluator, search.frozen)
    examples = flip_examples(lm, data, holdout, fmt=config.fmt, bos=config.bos, batch_size=config.batch_size)
    timings["holdout_s"] = time.perf_counter() - start
    start = time.perf_counter()
    control = score_control(control_evaluator, holdout, means, config.seed)
    timings["control_s"] = time.perf_counter() - start
    clean_passes.close()  # the null's random sets start elsewhere: nothing later reuses a pass
    floors = kind_of(data.task).floors(data.task, data.holdout)

    start = time.perf_counter()
    calibration = calibration_baseline(data.task.calibration, discovery.requests, search.full, holdout_evaluator.requests,
                                       holdout.full, holdout.ablated, seed=config.seed)
    null_indices = null_evaluator = None
    if config.n_random_sets and config.null_items is not None and config.null_items < len(data.holdout):
        null_indices = null_item_indices(len(data.holdout), config.null_items, config.seed)
        null_evaluator = make_evaluator(lm, data, [data.holdout[i] for i in null_indices], on_holdout, progress, store)
    reliability = assess_run(search, holdout, discovery, holdout_evaluator, n_random_sets=config.n_random_sets,
                             n_resamples=config.n_resamples, resample=config.resample, seed=config.seed,
                             calibration=calibration, null_evaluator=null_evaluator, null_indices=null_indices,
                             floors=floors)
    timings["reliability_s"] = time.perf_counter() - start
    timings.update(reliability.pop("timings", None) or {})  # volatile: to the run info, not the artifact

    payload = build_artifact(config, lm, data, search, holdout, reliability, examples, precision_record(config, lm, guard),
                             discovery_flips(data, discovery, search), floors, control)
    # What differs between two runs of the same parameters goes beside the artifact, so that the artifact
    # itself is the same bytes every time (and after a resumed run). Written before the artifact, so an
    # artifact's run info is never an older run's.
    write_json(run_info_path(config.artifact_path),
               {"artifact": config.artifact_path.name, "created": utc_now(), "timings": timings,
                "store": store.counts() if store else None,
                # token budgets an out-of-memory error fell back to (the engine halves and starts again)
                "token_budget_halvings": {"discovery": getattr(discovery.evaluator, "budget_halvings", []),
                                          "holdout": getattr(holdout_evaluator, "budget_halvings", [])}})
    path = write_json(config.artifact_path, payload)
    return CelRun(config=config, lm=lm, data=data, search=search, holdout=holdout, artifact=path, timings=timings)


def build_artifact(config: RunConfig, lm: LoadedModel, data: TaskData, search: SearchResult, holdout: HoldoutResult,
                   reliability: dict | None = None, examples: list[dict] | None = None,
                   precision: dict | None = None, flips: dict | None = None, floors: dict | None = None,
                   control: dict | None = None) -> RunArtifact:
    """The run's artifact (:class:`cel_utils.pipeline.schema.RunArtifact`): deterministic content only (creation time
    and timings are in the run info)."""
    geometry: HeadGeometry = lm.geometry
    return {
        "schema_version": SCHEMA_VERSION,
        "kind": "cel-run",
        "config": asdict(config),
        "model": {"spec": lm.spec, "name": lm.name, "source": lm.source, "fingerprint": lm.fingerprint,
                  "dtype": str(lm.dtype).removeprefix("torch."), "device": str(lm.device),
                  "geometry": asdict(geometry), "model_type": lm.model.config.model_type},
        # what the evaluations computed in, and the guarded precision's audit (cel_utils.evaluation.guarded)
        "precision": precision or {"setting": config.precision, "resolved": config.precision, "approximate": False,
                                   "audit": None},
        "prompt": {"format": config.fmt, "bos": resolve_bos(lm.tokenizer, config.bos)},  # bos: as this tokenizer resolved it
        "task": {"name": data.task.name, "kind": data.task.kind, "metric": data.task.metric,
                 "metrics": list(data.task.all_metrics)},
        "data": data.provenance,
        "discovery": {"item_ids": [item.id for item in data.discovery],
                      "full_accuracy": search.full.accuracy, "full_correct": bits(search.full.correct),
                      "full_metrics": search.full.metric_means()},
        "stage1": [s.to_json() for s in search.stage1],
        "stage1_method": search.stage1_json(),  # exact, or which screen and how many heads it passed on
        "pool": [str(heads[0]) for heads in search.pool],
        "stage2": [s.to_json() for s in search.stage2],
        "frozen": {"heads": [str(h) for h in search.frozen], "label": format_heads(search.frozen),
                   "discovery": search.best.to_json()},
        # cel_utils.pipeline.discovery_flips: the items each scored set flipped, listed on a click on the run page
        "discovery_flips": flips,
        "holdout": {**holdout.summary(), "item_ids": [item.id for item in data.holdout],
                    "full_correct": bits(holdout.full.correct), "ablated_correct": bits(holdout.ablated.correct),
                    "full_metric_vectors": {k: bits(v) for k, v in holdout.full.metrics.items()},
                    "ablated_metric_vectors": {k: bits(v) for k, v in holdout.ablated.metrics.items()},
                    "full_predictions": holdout.full.predictions, "ablated_predictions": holdout.ablated.predictions,
                    "examples": examples or []},  # cel_utils.pipeline.examples: what the run page shows
        # the trivial accuracies on the holdout items (chance, the best constant answer): cel_utils.tasks.floors
        "floors": floors,
        # the frozen set under the other ablation (mean, for the paper's zero) on the same items: cel_utils.pipeline.control
        "control": control,
        "n_interventions_evaluated": search.n_evaluated,
        "reliability": reliability,  # cel_utils.stats.reliability.assess_run; None when not assessed
        # the layers MBPP's code ran in here (a run page warns when some were best effort); None: no code ran
        "sandbox": isolation_report() if kind_of(data.task).runs_code else None,
        "versions": library_versions(),
    }
