"""Benchmark: screened stage 1 against exhaustive exact stage 1, on the cpu preset's discovery items.

    python benchmarks/bench_screening.py                                   # arithmetic_1dc, boolq, hellaswag
    python benchmarks/bench_screening.py --tasks boolq --screens attribution bf16 --keeps 10 20 30 50
    python benchmarks/bench_screening.py --model gemma3-270m --tasks boolq hellaswag arithmetic_1dc

For each task it evaluates every head of the model (``--model``, the default model unless named) exactly on the discovery set (the paper's stage 1), then
runs each screen (:mod:`cel_utils.search.screening`) on the same items and reports, for several m (heads the screen
passes on to exact evaluation):

* recall: the share of the exact top p (the paper's ranking key) among the screen's top m;
* whether Algorithm 1 with that screened stage 1 draws the same pool, and freezes the same set, as with exact stage 1
  (the frozen set of a different pool is computed for the timed m only; "-" elsewhere);
* the rank correlations (Spearman, Kendall tau-b) of the screen's score with the exact discovery gain of every head,
  and with the exact change of the mean decision margin;
* wall times: the exhaustive stage 1, each screen, and a screened stage 1 with the chosen m measured on its own (the
  screen plus an exact evaluation of its top m, without the store).

The exact evaluations go to the evaluation store ($CEL_CACHE_DIR), so an interrupted benchmark resumes; a wall time
is only reported for what this invocation computed (its JSON keeps earlier measurements; each model has its own JSON
file, ``screening.json`` for the default model, ``screening-<model>.json`` for another). Run it on a quiet machine:
timings are from one run, so compare ratios. Output: a JSON file and the Markdown table printed at the end.
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np
from scipy import stats

from cel_utils.config import RunConfig
from cel_utils.evaluation.engine import EngineEvaluator
from cel_utils.evaluation.outcomes import OutcomeTable
from cel_utils.evaluation.store import EvalStore
from cel_utils.hardware import machine_summary
from cel_utils.models.loading import DEFAULT_MODEL, display_name, load_model
from cel_utils.paths import atomic_write
from cel_utils.search.algorithm import run_search
from cel_utils.search.ranking import rank_singles
from cel_utils.search.screening import DECISION_SCREENS, SCREENS, run_screen
from cel_utils.tasks.splits import load_task_data


def _rho(method, x, y) -> float | None:
    x, y = np.asarray(x, float), np.asarray(y, float)
    return None if np.ptp(x) == 0 or np.ptp(y) == 0 else float(method(x, y).statistic)


def bench_task(lm, task: str, n_discovery: int, screens: list[str], keeps: list[int], p: int, k: int, measure_keep: int,
               previous: dict, boundary: dict, n_holdout: int | None = None) -> dict:
    # the cpu preset's items as the default model has them, whatever the model: the same items for every model. Where
    # discovery and holdout are drawn from one pool (BoolQ, HellaSwag: holdout first), the holdout's size fixes which
    # items are discovery ones: --n-holdout reproduces a measurement made when the preset's holdout was another size
    sizes = {"n_discovery": n_discovery, **({"n_holdout": n_holdout} if n_holdout else {})}
    config = RunConfig.from_dict({"task": task, "preset": "cpu", **sizes})
    data = load_task_data(task, config.n_discovery, config.n_holdout, seed=config.seed, num_fewshot=config.num_fewshot,
                          data_dir=config.data_dir)
    evaluator = EngineEvaluator(lm, data.task, data.discovery, data.fewshot, progress=True, store=EvalStore())
    table = OutcomeTable(evaluator)
    heads = lm.geometry.all_heads()
    store = evaluator.store
    computed_before = store.computed
    start = time.perf_counter()
    outcomes = table.evaluate([()] + [(h,) for h in heads], desc=f"{task}: exact stage 1")
    exact_s = time.perf_counter() - start
    from_store = store.computed == computed_before
    full = outcomes[0]
    exact = rank_singles(heads, outcomes[1:], full)
    exact_top = [s.heads[0] for s in exact[:p]]
    gain = {s.heads[0]: s.gain for s in exact}
    margin = {h: float(np.mean(o.margin - full.margin)) for h, o in zip(heads, outcomes[1:])}
    frozen_exact = run_search(table, p=p, k=k).frozen
    out = {"task": task, "model": lm.name, "n_discovery": len(data.discovery), "n_holdout_drawn": len(data.holdout),
           "p": p, "k": k, "full_accuracy": full.accuracy,
           "exact": {"top_p": [str(h) for h in exact_top], "frozen": [str(h) for h in frozen_exact],
                     "gains": {str(h): g for h, g in gain.items()},  # every head's exact discovery gain (points)
                     "ranking": [str(s.heads[0]) for s in exact[:max(keeps)]],  # the paper's key, best first
                     "heads_improving": sum(g > 0 for g in gain.values()),
                     "seconds": None if from_store else exact_s,
                     "forward_equivalents": len(full.correct) * (1 + sum(lm.geometry.n_layers - h.layer for h in heads)
                                                                 / lm.geometry.n_layers)},
           "screens": {}}
    if out["exact"]["seconds"] is None:  # read back from the store: keep the time an earlier invocation measured
        out["exact"]["seconds"] = previous.get("exact", {}).get("seconds")
    for method in screens:
        if method in DECISION_SCREENS and not evaluator.kind.loglikelihood:
            continue
        screen = run_screen(method, evaluator, **boundary)
        scores = screen.scores()
        row = {"seconds": screen.seconds, "forward_equivalents": screen.forward_equivalents,
               **(boundary if method == "boundary" else {}),
               "spearman_gain": _rho(stats.spearmanr, scores, [gain[h] for h in heads]),
               "kendall_gain": _rho(stats.kendalltau, scores, [gain[h] for h in heads]),
               "spearman_margin": _rho(stats.spearmanr, scores, [margin[h] for h in heads]),
               "order": [str(h) for h in screen.order()[:max(keeps)]],  # the screen's ranking, as far as any m reaches
               "by_keep": {}}
        for m in keeps:
            top = screen.top(m)
            pool = [s.heads[0] for s in rank_singles(top, table.evaluate([(h,) for h in top]), full)[:p]]
            # The same pool gives the same subsets, so the same frozen set; another pool costs its own stage 2, which is
            # run only for the m that is also timed (the pairs of every m would cost more than stage 1 itself).
            frozen = (frozen_exact if pool == exact_top else
                      run_search(table, p=p, k=k, screen=screen, keep=m).frozen if m == measure_keep else None)
            row["by_keep"][str(m)] = {"recall_top_p": len(set(top) & set(exact_top)) / p, "same_pool": pool == exact_top,
                                      "pool": [str(h) for h in pool],  # its first p' heads are the pool of a smaller p
                                      "same_frozen": None if frozen is None else frozen == frozen_exact,
                                      "frozen": None if frozen is None else [str(h) for h in frozen]}
        own = EngineEvaluator(lm, data.task, data.discovery, data.fewshot, progress=False)  # no store: a real timing
        start = time.perf_counter()
        own.evaluate([()] + [(h,) for h in screen.top(measure_keep)])
        row["screened_stage1_seconds"] = screen.seconds + time.perf_counter() - start
        row["measured_keep"] = measure_keep
        out["screens"][method] = row
    out["screens"] = {**previous.get("screens", {}), **out["screens"]}  # screens measured by earlier invocations stay
    return out


def markdown(results: list[dict], keeps: list[int]) -> str:
    lines = ["| task | screen | Spearman with exact gain | recall of exact top p at m = " + ", ".join(map(str, keeps))
             + " | same frozen set at m = " + ", ".join(map(str, keeps)) + " | wall: exhaustive / screen / screened stage 1 |",
             "|---|---|---|---|---|---|"]
    for r in results:
        exact_s = r["exact"]["seconds"]
        for method, row in r["screens"].items():
            recall = ", ".join(f"{row['by_keep'][str(m)]['recall_top_p']:.1f}" for m in keeps)
            same = ", ".join({True: "yes", False: "no", None: "-"}[row["by_keep"][str(m)]["same_frozen"]] for m in keeps)
            rho = "n/a" if row["spearman_gain"] is None else f"{row['spearman_gain']:.2f}"
            wall = (f"{exact_s:.0f} s / {row['seconds']:.0f} s / {row['screened_stage1_seconds']:.0f} s (m={row['measured_keep']})"
                    if exact_s else f"? / {row['seconds']:.0f} s / {row['screened_stage1_seconds']:.0f} s")
            label = f"{method} ({row['candidates']} heads x {row['items']} items)" if "candidates" in row else method
            model = f"{r['model']}: " if r.get("model", DEFAULT_MODEL) != DEFAULT_MODEL else ""
            lines.append(f"| {model}{r['task']} ({r['n_discovery']} items) | {label} | {rho} | {recall} | {same} | {wall} |")
    return "\n".join(lines)


def default_out(model: str) -> str:
    """The default model keeps the file name the book's tables were made from; another model gets its own file."""
    return "results/bench/screening.json" if model == DEFAULT_MODEL else f"results/bench/screening-{display_name(model)}.json"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tasks", nargs="+", default=["arithmetic_1dc", "boolq", "hellaswag"])
    parser.add_argument("--n-discovery", type=int, default=128)
    parser.add_argument("--n-holdout", type=int, default=None,
                        help="holdout size the items are drawn with (default: the cpu preset's); where both come from "
                             "one pool it decides which items are discovery ones")
    parser.add_argument("--screens", nargs="+", default=list(SCREENS), choices=SCREENS)
    parser.add_argument("--keeps", nargs="+", type=int, default=[10, 20, 30, 50, 80])
    parser.add_argument("--measure-keep", type=int, default=30, help="m of the separately timed screened stage 1")
    parser.add_argument("--p", type=int, default=10)
    parser.add_argument("--k", type=int, default=2)
    parser.add_argument("--candidates", type=int, default=60, help="boundary screen: heads passed to the boundary items")
    parser.add_argument("--items", type=int, default=12, help="boundary screen: items nearest the decision boundary")
    parser.add_argument("--model", default=DEFAULT_MODEL, help="model spec (cel_utils.models.loading)")
    parser.add_argument("--out", default=None, help="JSON file (default: results/bench/screening[-<model>].json)")
    args = parser.parse_args()
    out = Path(args.out or default_out(args.model))
    previous = {r["task"]: r for r in json.loads(out.read_text())} if out.exists() else {}
    lm = load_model(args.model)
    print(machine_summary(), flush=True)  # the wall-time ratios below belong to this machine
    results = []
    for task in args.tasks:
        results.append(bench_task(lm, task, args.n_discovery, args.screens, args.keeps, args.p, args.k,
                                  args.measure_keep, previous.get(task, {}),
                                  {"candidates": args.candidates, "items": args.items}, args.n_holdout))
        done = {**previous, **{r["task"]: r for r in results}}
        atomic_write(out, json.dumps(list(done.values()), indent=1) + "\n")  # after every task: a stop loses little
        print(markdown(results, args.keeps), flush=True)
    print(f"\n{out}")


if __name__ == "__main__":
    main()
