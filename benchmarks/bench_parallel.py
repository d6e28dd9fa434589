"""Benchmark: one run at a time against two at once (what `make book`'s BOOK_JOBS decides), on this machine.

    python benchmarks/bench_parallel.py                  # BoolQ, 16 items, the full model and 6 heads, 2 workers
    python benchmarks/bench_parallel.py --task hellaswag --workers 3

Each worker is a fresh process that loads the default model and evaluates the same interventions with the engine,
uncached (a stage-1 slice: the full model and heads at early, middle and late layers, so both the reused and the
recomputed layers are in it). The benchmark runs one worker alone, then ``--workers`` at once, each with torch's
default threads (one per core; on a shared machine the surplus threads wait passively), and prints the throughput
of each and their ratio. The ratio, not the seconds, is the result: timings include whatever else the machine runs.
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time

HEADS = ((), ((0, 3),), ((2, 5),), ((8, 1),), ((15, 4),), ((22, 0),), ((29, 8),))


def work(task: str, n_items: int, repeats: int) -> float:
    """Seconds to evaluate HEADS on ``n_items`` discovery items ``repeats`` times (model loading excluded)."""
    from cel_utils.evaluation.engine import EngineEvaluator
    from cel_utils.models.heads import HeadId
    from cel_utils.models.loading import load_model
    from cel_utils.tasks.splits import load_task_data

    lm = load_model(device="cpu", dtype="float32")
    data = load_task_data(task, n_items, 1, seed=0)
    engine = EngineEvaluator(lm, data.task, data.discovery, data.fewshot, progress=False)
    interventions = [tuple(HeadId(*h) for h in heads) for heads in HEADS]
    start = time.perf_counter()
    for _ in range(repeats):
        engine.evaluate(interventions)
    return time.perf_counter() - start


def run_workers(args, n: int) -> list[float]:
    """Start ``n`` worker processes at once; the seconds each reports."""
    command = [sys.executable, __file__, "--worker", "--task", args.task, "--n", str(args.n), "--repeats", str(args.repeats)]
    env = {**os.environ, "OMP_WAIT_POLICY": "PASSIVE"}
    procs = [subprocess.Popen(command, stdout=subprocess.PIPE, text=True, env=env) for _ in range(n)]
    seconds = []
    for proc in procs:
        out, _ = proc.communicate()
        if proc.returncode:
            raise SystemExit(f"a worker failed (exit {proc.returncode})")
        seconds.append(float(out.strip().splitlines()[-1]))
    return seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--task", default="boolq")
    parser.add_argument("--n", type=int, default=16, help="discovery items per worker")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        print(work(args.task, args.n, args.repeats), flush=True)
        return
    evaluations = args.n * args.repeats * len(HEADS)
    (alone,) = run_workers(args, 1)
    together = run_workers(args, args.workers)
    rate_alone, rate_together = evaluations / alone, args.workers * evaluations / max(together)
    from cel_utils.hardware import machine_summary

    print(machine_summary())
    print(f"{args.task}, {args.n} items x {len(HEADS)} interventions x {args.repeats}, {os.cpu_count()} cores")
    print(f"one worker:      {alone:7.1f} s  {rate_alone:6.2f} item-evaluations/s")
    print(f"{args.workers} workers at once: {max(together):7.1f} s  {rate_together:6.2f} item-evaluations/s "
          f"(each {', '.join(f'{s:.1f}' for s in together)} s)")
    print(f"throughput ratio (together / alone): {rate_together / rate_alone:.2f}")


if __name__ == "__main__":
    main()
