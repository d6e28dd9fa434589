"""Benchmark: the share of pairs a guard band rechecks, for the band the guard uses and for bands that one pair cannot
set, from one computation of every pair in both precisions.

    python benchmarks/bench_guard_band.py                                   # boolq, hellaswag, arithmetic_1dc
    python benchmarks/bench_guard_band.py --model gemma3-270m --items 32 --heads 20 --pairs 10
    python benchmarks/bench_guard_band.py --artifact results/smollm2-135m-instruct__boolq__seed1.json --items 0

For each task the same (item, intervention) pairs (the full model, ``--heads`` single heads spread over the layers,
``--pairs`` random pairs: a stage-1/stage-2 call, as in bench_precision.py; or, with ``--artifact``, the interventions
a run's search scored, stage 1's heads and stage 2's sets, on the first ``--items`` of its discovery items, 0 for all)
are computed by the fp32 engine and by the guarded precision's fast pass (fp32 below the ablated layers, bf16 in and
above them; ``--fast mixed``: only the linear maps of those layers in bf16, :func:`linears_in_bf16`), without the
guard. From the fast margins and each pair's true margin error it replays, over ``--draws`` random first audits of the
guard's size (256 pairs), which pairs each band rule would recheck (the share of the pairs that are not the full
model's, whose decisions are fp32's own) and which bf16 decisions that differ from fp32's it would leave outside its
band (misses: each one is a decision the guard would get wrong unless an audit caught it; the guard's rule must have
none). Rules:

* ``global``: the guard's before issue 46: the multiple times the largest audited error, one band for every pair;
* ``depth``: the guard's since issue 46: one band per third of the layers by the intervention's first ablated layer
  (:func:`cel_utils.evaluation.guard.depth_group`; the fast pass computes the layers from there up in bf16), each the
  multiple times the largest audited error in its third, or the widest band while its third has fewer than
  ``GROUP_EVIDENCE`` audited errors; ``--groups`` other than 3 replays more or fewer equal parts of the layers;
* ``global, a third``: the guard's rule from a third of the audit (a random third): the largest of fewer errors is
  smaller, so ``depth`` beats the guard's rule partly because each of its bands has a third of the evidence; this is
  that part alone;
* ``item oracle``: each item's band the multiple times that item's own largest error over every pair (not buildable:
  it knows every error in advance; how far any per-item band could go);
* ``the guard, whole call``: :class:`~cel_utils.evaluation.guard.Guard` itself over the whole call, one seed per draw.
  The rules above take their bands from the first audit alone; the guard also learns from every pair it rechecks, so
  on a call with many small margins its bands grow, and its share is the one a run pays (its first bracket is left
  blank: its bands are the largest errors it saw, by construction).

Per task it also prints what the error depends on (:func:`error_structure`): the shares of the variance of its log
that the item and the intervention explain, and its quantiles.

Beside each share: the pairs whose error is larger than their band (the band's premise broken, whether or not the
decision flipped) and the differing decisions left outside it, both as means over the draws.

``--save DIR`` keeps each task's collected arrays (``<model>__<task>.npz``); ``--load FILE...`` replays saved ones
without a model. Timings are not the point here (bench_precision.py times the guard); the CPU is printed beside the
numbers.
"""
from __future__ import annotations

import argparse
import copy
import dataclasses
import time
from pathlib import Path

import numpy as np
import torch

from bench_precision import Clock, _interventions, run_calls
from cel_utils.config import TransferConfig
from cel_utils.evaluation.engine import EngineEvaluator
from cel_utils.evaluation.guard import AUDIT_PAIRS, DEPTH_GROUPS, SAFETY_MULTIPLE, Guard, depth_group
from cel_utils.evaluation.precision import bf16_model
from cel_utils.hardware import machine_summary
from cel_utils.models.heads import format_heads
from cel_utils.models.loading import LoadedModel, load_model
from cel_utils.models.plumbing import decoder_layers
from cel_utils.tasks.splits import load_task_data


def linears_in_bf16(lm: LoadedModel) -> LoadedModel:
    """A copy of ``lm`` whose decoder layers' linear maps compute in bf16 (weights rounded once; each input rounded,
    each output back in fp32) while the residual stream, the norms and the attention itself stay fp32 (``--fast
    mixed``: does bf16's error come from the stream's rounding, which this keeps out, or from the products?). Its
    ablation hooks run after the input's rounding (registered later), so a zeroed head is zero in bf16 as in fp32."""
    model = copy.deepcopy(lm.model)
    for layer in decoder_layers(model):
        for module in layer.modules():
            if isinstance(module, torch.nn.Linear):
                module.to(torch.bfloat16)
                module.register_forward_pre_hook(lambda _, args: (args[0].to(torch.bfloat16), *args[1:]))
                module.register_forward_hook(lambda _, args, out: out.to(torch.float32))
    return dataclasses.replace(lm, model=model)


FAST = {"bf16": bf16_model, "mixed": linears_in_bf16}  # the guard's fast pass, and the experiment beside it


def collect(lm, task: str, n_items: int | None, n_heads: int, n_pairs: int, model: str | None,
            interventions: list | None = None, fast: str = "bf16") -> dict:
    """Every pair's fast margin, true margin error, whether the fast decision differs, and its bf16 layers; and the
    seconds of each pass (fp32's, then the fast one's)."""
    config = TransferConfig.from_dict({"task": task, "preset": "cpu", **({"model": model} if model else {})})
    data = load_task_data(task, config.n_discovery, config.n_holdout, seed=config.seed, num_fewshot=config.num_fewshot,
                          data_dir=config.data_dir)
    items = data.discovery[:n_items] if n_items else data.discovery
    if interventions is None:  # the full model's decisions are fp32's own
        interventions = _interventions(lm.geometry, n_heads, n_pairs)[1:]
    make = lambda above=None: EngineEvaluator(lm, task=data.task, items=items, fewshot=data.fewshot, progress=False,
                                              above=above)
    above = FAST[fast](lm)
    seconds = []
    for evaluator in (make(), make(above)):
        with Clock(evaluator, ("collect_stats",)) as unembedding:  # the unembedding and log-softmax, fp32 in both
            start = time.perf_counter()
            stats = evaluator.continuation_stats(interventions)
        seconds.append((stats, time.perf_counter() - start, unembedding.seconds))
    (exact, exact_s, exact_unembed_s), (fast_stats, fast_s, fast_unembed_s) = seconds
    engine = make()
    rule, spec, requests = engine.kind.item_decision, engine.task, engine.requests
    shape = (len(interventions), len(requests))
    out = {name: np.zeros(shape) for name in ("margin", "error", "differs")}
    for u in range(shape[0]):
        for i, request in enumerate(requests):
            low, high = fast_stats[u][i], exact[u][i]
            out["margin"][u, i] = rule.margin(spec, request, low)
            out["error"][u, i] = rule.margin_error(spec, request, low, high)
            out["differs"][u, i] = rule.decision(spec, request, low) != rule.decision(spec, request, high)
    layers = np.array([lm.geometry.n_layers - min(h.layer for h in heads) for heads in interventions], dtype=float)
    out["layers"] = np.repeat(layers[:, None], shape[1], axis=1)
    out["heads"] = np.array([format_heads(heads) for heads in interventions])
    out.update(task=task, model=config.model, items=len(items), interventions=len(interventions),
               n_layers=lm.geometry.n_layers, fewshot=len(data.fewshot), fast=fast, fp32_s=exact_s, fast_s=fast_s,
               fp32_unembed_s=exact_unembed_s, fast_unembed_s=fast_unembed_s)
    return out


def bands(data: dict, audit: np.ndarray, multiple: float, groups: int = DEPTH_GROUPS) -> dict[str, np.ndarray]:
    """Each rule's band for every pair, from the audited pairs ``audit`` (flat indices)."""
    error, layers = data["error"].ravel(), data["layers"].ravel()
    seen = error[audit]
    out = {"global": np.full(error.shape, multiple * seen.max()),
           "global, a third": np.full(error.shape, multiple * seen[: max(1, len(seen) // 3)].max())}
    n_layers = int(data["n_layers"])
    group = np.array([depth_group(n_layers - int(n), n_layers, groups) for n in layers])
    guard = Guard(multiple=multiple)  # the guard's own rule, from the same audit
    for j in audit:
        guard.see(float(error[j]), int(group[j]))
    bands_of = {g: guard.depth_band(int(g)) for g in np.unique(group)}
    out["depth"] = np.array([bands_of[g] for g in group])
    item_max = data["error"].max(axis=0)
    out["item oracle"] = multiple * np.broadcast_to(item_max, data["error"].shape).ravel()
    return out


def replay(data: dict, draws: int, multiple: float, audit_pairs: int = AUDIT_PAIRS, groups: int = DEPTH_GROUPS
           ) -> dict[str, tuple]:
    """Per rule, means over ``draws`` random audits: the share of pairs inside its band, the pairs whose error exceeds
    their band and the differing decisions outside it."""
    margin, differs, error = data["margin"].ravel(), data["differs"].ravel().astype(bool), data["error"].ravel()
    rng = np.random.default_rng(0)
    totals: dict[str, list] = {}
    for _ in range(draws):
        audit = rng.choice(margin.size, min(audit_pairs, margin.size), replace=False)
        for name, band in bands(data, audit, multiple, groups).items():
            inside = margin <= band
            totals.setdefault(name, []).append((inside.mean(), (error > band).sum(), (differs & ~inside).sum()))
    return {name: tuple(np.mean(values, axis=0)) for name, values in totals.items()}


def error_structure(data: dict) -> dict[str, float]:
    """What a pair's margin error depends on: the shares of the variance of its log that the item and the
    intervention explain (a two-way additive fit over the full grid), and the error's quantiles. A band per item can
    narrow only as far as the item explains the error."""
    log = np.log(data["error"] + 1e-4)  # exact zeros (the last bf16 layers round alike) kept finite
    centred = log - log.mean()
    item, intervention = centred.mean(axis=0), centred.mean(axis=1)
    total = (centred ** 2).sum()
    quantiles = np.quantile(data["error"], [0.5, 0.9, 0.99, 1.0])
    return {"item": float((item ** 2).sum() * log.shape[0] / total),
            "intervention": float((intervention ** 2).sum() * log.shape[1] / total),
            **{f"error {name}": float(q) for name, q in zip(("median", "p90", "p99", "max"), quantiles)}}


def replay_guard(data: dict, draws: int) -> tuple[float, float, float]:
    """The guard itself (:meth:`Guard.check`) over the whole call, once per seed: unlike the rules above it also
    learns from the errors of the pairs it rechecks, so its bands grow with the call. Over ``draws`` seeds: the mean
    share of pairs rechecked, the mean number of bf16 decisions that differ from fp32's left outside the final bands,
    and the share of seeds whose audit found one outside them (a run would fall back to fp32 there, so its share is
    not what that run pays)."""
    margin, error, differs = data["margin"], data["error"], data["differs"].astype(bool)
    n_layers = int(data["n_layers"])
    depths = [depth_group(n_layers - int(n), n_layers) for n in data["layers"][:, 0]]
    totals = []
    for seed in range(draws):
        guard = Guard(seed=seed)
        differing = guard.check(margin, lambda pairs: [float(error[pair]) for pair in pairs],
                                lambda pair: bool(differs[pair]), depths=depths)
        inside = margin <= np.array([guard.depth_band(depth) for depth in depths])[:, None]
        totals.append((guard.rechecked / guard.pairs, (differs & ~inside).sum(), bool(differing)))
    return tuple(np.mean(totals, axis=0))


def _read(path: Path) -> dict:
    with np.load(path) as saved:
        data = {k: saved[k] if saved[k].ndim else saved[k].item() for k in saved.files}
    # saved before n_layers was: their single heads spread from layer 0, so the most bf16 layers is every layer
    data.setdefault("n_layers", int(data["layers"].max()))
    return data


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tasks", nargs="+", default=["boolq", "hellaswag", "arithmetic_1dc"])
    parser.add_argument("--model", default=None, help="a model spec (default: the default model)")
    parser.add_argument("--items", type=int, default=32, help="first n discovery items (0: all)")
    parser.add_argument("--heads", type=int, default=20, help="single heads spread over the layers (0: all)")
    parser.add_argument("--pairs", type=int, default=10, help="random pairs of heads")
    parser.add_argument("--draws", type=int, default=200, help="random first audits replayed per rule")
    parser.add_argument("--multiple", type=float, default=SAFETY_MULTIPLE)
    parser.add_argument("--groups", type=int, default=DEPTH_GROUPS, help="equal parts of the layers for 'depth'")
    parser.add_argument("--artifact", type=Path, nargs="+", default=None,
                        help="run artifacts: replay each one's search calls (its task and interventions)")
    parser.add_argument("--fast", choices=list(FAST), default="bf16",
                        help="the fast pass: the guard's (a bf16 copy above the ablated layers), or 'mixed' (only "
                             "the linear maps in bf16)")
    parser.add_argument("--save", type=Path, default=None, help="a folder for each task's collected arrays")
    parser.add_argument("--load", type=Path, nargs="+", default=None, help="replay saved arrays (no model)")
    args = parser.parse_args()
    print(machine_summary(), flush=True)
    if args.load:
        collected = (_read(path) for path in args.load)
    else:
        lm = load_model(args.model, dtype="float32") if args.model else load_model(dtype="float32")
        calls = [run_calls(path) for path in args.artifact] if args.artifact else [(task, None) for task in args.tasks]
        collected = (collect(lm, task, args.items, args.heads, args.pairs, args.model,
                             interventions and interventions[1:], args.fast)  # the full model's are fp32's own
                     for task, interventions in calls)
    rows = []
    for data in collected:
        if args.save:
            args.save.mkdir(parents=True, exist_ok=True)
            suffix = "" if data.get("fast", "bf16") == "bf16" else f"__{data['fast']}"
            np.savez(args.save / f"{data['model']}__{data['task']}{suffix}.npz", **data)
        result = replay(data, args.draws, args.multiple, groups=args.groups)
        if args.multiple == SAFETY_MULTIPLE and args.groups == DEPTH_GROUPS:  # the guard's own settings only
            share, missed, fell_back = replay_guard(data, args.draws)
            result["the guard, whole call"] = (share, np.nan, missed)
        rows.append((data, result))
        print(data["task"], {k: tuple(round(float(x), 4) for x in v) for k, v in result.items()},
              f"differing decisions {int(data['differs'].sum())} of {data['differs'].size}", flush=True)
        if "the guard, whole call" in result:
            print(f"  the guard fell back to fp32 in {fell_back:.1%} of {args.draws} seeds")
        if "fast_s" in data:
            print(f"  seconds: fp32 {float(data['fp32_s']):.1f}, fast pass ({data['fast']}) "
                  f"{float(data['fast_s']):.1f}; of them in the unembedding and log-softmax (fp32 in both) "
                  f"{float(data['fp32_unembed_s']):.1f} and {float(data['fast_unembed_s']):.1f}")
        print("  what the error depends on:", {k: round(v, 4) for k, v in error_structure(data).items()}, flush=True)
    names = list(rows[0][1])
    print(f"\nShare of pairs inside the band (mean over {args.draws} first audits of {AUDIT_PAIRS} pairs; multiple "
          f"{args.multiple:g}); in brackets, pairs whose error exceeds their band / bf16 decisions that differ from "
          "fp32's left outside it (means):\n")
    print("| model | task | items x interventions | fast decisions differing | " + " | ".join(names) + " |")
    print("|---" * (4 + len(names)) + "|")
    for data, result in rows:
        task = f"{data['task']}{' %d-shot' % data['fewshot'] if data['fewshot'] else ''}"
        cells = [f"{result[n][0]:.1%} ({'-' if np.isnan(result[n][1]) else f'{result[n][1]:.2g}'} / {result[n][2]:.2g})"
                 for n in names]
        print(f"| {data['model']} | {task} | {data['items']} x {data['interventions']} | "
              f"{int(data['differs'].sum())} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
