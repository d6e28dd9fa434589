"""Benchmark: the share of pairs a guard band rechecks, for the band the guard uses and for bands that one pair cannot
set, from one computation of every pair in both precisions.

    python benchmarks/bench_guard_band.py                                   # boolq, hellaswag, arithmetic_1dc
    python benchmarks/bench_guard_band.py --model gemma3-270m --items 32 --heads 20 --pairs 10

For each task the same (item, intervention) pairs (the full model, ``--heads`` single heads spread over the layers,
``--pairs`` random pairs: a stage-1/stage-2 call, as in bench_precision.py) are computed by the fp32 engine and by the
guarded precision's fast pass (fp32 below the ablated layers, bf16 in and above them), without the guard. From the fast
margins and each pair's true margin error it replays, over ``--draws`` random first audits of the guard's size (256
pairs), which pairs each band rule would recheck (the share of the pairs that are not the full model's, whose decisions
are fp32's own) and which bf16 decisions that differ from fp32's it would leave outside its band (misses: each one is
a decision the guard would get wrong unless an audit caught it; the guard's rule must have none). Rules:

* ``global``: the guard's before issue 46: the multiple times the largest audited error, one band for every pair;
* ``depth``: the guard's since issue 46: one band per third of the layers by the intervention's first ablated layer
  (:func:`cel_utils.evaluation.guard.depth_group`; the fast pass computes the layers from there up in bf16), each the
  multiple times the largest audited error in its third, or the widest band while its third has fewer than
  ``GROUP_EVIDENCE`` audited errors; ``--groups`` other than 3 replays more or fewer equal parts of the layers;
* ``global, a third``: the guard's rule from a third of the audit (a random third): the largest of fewer errors is
  smaller, so ``depth`` beats the guard's rule partly because each of its bands has a third of the evidence; this is
  that part alone;
* ``item oracle``: each item's band the multiple times that item's own largest error over every pair (not buildable:
  it knows every error in advance; how far any per-item band could go).

Beside each share: the pairs whose error is larger than their band (the band's premise broken, whether or not the
decision flipped) and the differing decisions left outside it, both as means over the draws.

``--save DIR`` keeps each task's collected arrays (``<model>__<task>.npz``); ``--load FILE...`` replays saved ones
without a model. Timings are not the point here (bench_precision.py times the guard); the CPU is printed beside the
numbers.
"""
from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np

from bench_precision import _interventions
from cel_utils.config import TransferConfig
from cel_utils.evaluation.engine import EngineEvaluator
from cel_utils.evaluation.guard import AUDIT_PAIRS, DEPTH_GROUPS, SAFETY_MULTIPLE, Guard, depth_group
from cel_utils.evaluation.precision import bf16_model
from cel_utils.hardware import machine_summary
from cel_utils.models.loading import load_model
from cel_utils.tasks.splits import load_task_data


def collect(lm, task: str, n_items: int | None, n_heads: int, n_pairs: int, model: str | None) -> dict:
    """Every pair's fast margin, true margin error, whether the fast decision differs, and its bf16 layers."""
    config = TransferConfig.from_dict({"task": task, "preset": "cpu", **({"model": model} if model else {})})
    data = load_task_data(task, config.n_discovery, config.n_holdout, seed=config.seed, num_fewshot=config.num_fewshot,
                          data_dir=config.data_dir)
    items = data.discovery[:n_items] if n_items else data.discovery
    interventions = _interventions(lm.geometry, n_heads, n_pairs)[1:]  # the full model's decisions are fp32's own
    make = lambda above=None: EngineEvaluator(lm, task=data.task, items=items, fewshot=data.fewshot, progress=False,
                                              above=above)
    exact, fast = make().continuation_stats(interventions), make(bf16_model(lm)).continuation_stats(interventions)
    engine = make()
    rule, spec, requests = engine.kind.item_decision, engine.task, engine.requests
    shape = (len(interventions), len(requests))
    out = {name: np.zeros(shape) for name in ("margin", "error", "differs")}
    for u in range(shape[0]):
        for i, request in enumerate(requests):
            low, high = fast[u][i], exact[u][i]
            out["margin"][u, i] = rule.margin(spec, request, low)
            out["error"][u, i] = rule.margin_error(spec, request, low, high)
            out["differs"][u, i] = rule.decision(spec, request, low) != rule.decision(spec, request, high)
    layers = np.array([lm.geometry.n_layers - min(h.layer for h in heads) for heads in interventions], dtype=float)
    out["layers"] = np.repeat(layers[:, None], shape[1], axis=1)
    out.update(task=task, model=config.model, items=len(items), interventions=len(interventions), n_layers=lm.geometry.n_layers,
               fewshot=len(data.fewshot))
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
    parser.add_argument("--items", type=int, default=32, help="first n discovery items")
    parser.add_argument("--heads", type=int, default=20, help="single heads spread over the layers (0: all)")
    parser.add_argument("--pairs", type=int, default=10, help="random pairs of heads")
    parser.add_argument("--draws", type=int, default=200, help="random first audits replayed per rule")
    parser.add_argument("--multiple", type=float, default=SAFETY_MULTIPLE)
    parser.add_argument("--groups", type=int, default=DEPTH_GROUPS, help="equal parts of the layers for 'depth'")
    parser.add_argument("--save", type=Path, default=None, help="a folder for each task's collected arrays")
    parser.add_argument("--load", type=Path, nargs="+", default=None, help="replay saved arrays (no model)")
    args = parser.parse_args()
    print(machine_summary(), flush=True)
    if args.load:
        collected = (_read(path) for path in args.load)
    else:
        lm = load_model(args.model, dtype="float32") if args.model else load_model(dtype="float32")
        collected = (collect(lm, task, args.items, args.heads, args.pairs, args.model) for task in args.tasks)
    rows = []
    for data in collected:
        if args.save:
            args.save.mkdir(parents=True, exist_ok=True)
            np.savez(args.save / f"{data['model']}__{data['task']}.npz", **data)
        result = replay(data, args.draws, args.multiple, groups=args.groups)
        rows.append((data, result))
        print(data["task"], {k: tuple(round(float(x), 4) for x in v) for k, v in result.items()},
              f"differing decisions {int(data['differs'].sum())} of {data['differs'].size}", flush=True)
    names = list(rows[0][1])
    print(f"\nShare of pairs inside the band (mean over {args.draws} first audits of {AUDIT_PAIRS} pairs; multiple "
          f"{args.multiple:g}); in brackets, pairs whose error exceeds their band / bf16 decisions that differ from "
          "fp32's left outside it (means):\n")
    print("| model | task | items x interventions | fast decisions differing | " + " | ".join(names) + " |")
    print("|---" * (4 + len(names)) + "|")
    for data, result in rows:
        task = f"{data['task']}{' %d-shot' % data['fewshot'] if data['fewshot'] else ''}"
        cells = [f"{result[n][0]:.1%} ({result[n][1]:.2g} / {result[n][2]:.2g})" for n in names]
        print(f"| {data['model']} | {task} | {data['items']} x {data['interventions']} | "
              f"{int(data['differs'].sum())} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
