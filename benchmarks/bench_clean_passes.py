"""Benchmark: one run with clean passes kept across calls against the same run keeping none, on this machine.

    python benchmarks/bench_clean_passes.py                                   # the default model, boolq, 32 / 80 items
    python benchmarks/bench_clean_passes.py --tasks boolq hellaswag arithmetic_1dc
    python benchmarks/bench_clean_passes.py --model gemma3-270m --tasks boolq --discovery 64 --holdout 500

Each task's run (``run_cel``, the ``cpu`` preset at ``--discovery`` / ``--holdout`` items, seed 1, no store) runs twice
in this process: first with the run's :class:`~cel_utils.evaluation.clean_passes.CleanPasses` (stage 2 starts from
stage 1's kept states, the control from the holdout call's), then with one that keeps nothing (``max_bytes=0``, what
the engine did before). Kept goes first so that the one-time costs of a process (loading the data, warming kernels)
fall on it: the ratios lean against the change, not for it. It prints the stages the kept passes change (stage 2,
the control) and the whole run, each with its ratio (none / kept), and whether the two artifacts are the same bytes
(apart from their results folder). The ratios, not the seconds, are the result: timings include whatever else the
machine runs.
"""
from __future__ import annotations

import argparse
import functools
import json
import os
import tempfile
import time
from pathlib import Path
from unittest import mock

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # before torch loads

import cel_utils.pipeline.protocol as protocol  # noqa: E402
from cel_utils.config import RunConfig  # noqa: E402
from cel_utils.evaluation.clean_passes import CleanPasses  # noqa: E402
from cel_utils.hardware import machine_summary  # noqa: E402
from cel_utils.models.loading import load_model  # noqa: E402


def one_run(config: RunConfig, lm, keep: bool) -> tuple[dict, str]:
    """The run's timings (and its wall time as ``run_s``) and its artifact's text without its results folder."""
    # run_cel makes its own CleanPasses; for the baseline it gets one with no room, for this call only
    keeping = CleanPasses if keep else functools.partial(CleanPasses, max_bytes=0)
    start = time.perf_counter()
    with mock.patch.object(protocol, "CleanPasses", keeping):
        run = protocol.run_cel(config, lm=lm, progress=False)
    timings = {**run.timings, "run_s": time.perf_counter() - start}
    artifact = json.loads(run.artifact.read_text())
    artifact["config"].pop("results_dir")
    return timings, json.dumps(artifact, sort_keys=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--tasks", nargs="+", default=["boolq"])
    parser.add_argument("--discovery", type=int, default=32)
    parser.add_argument("--holdout", type=int, default=80)
    args = parser.parse_args()
    print(machine_summary(), flush=True)
    lm = load_model(args.model, dtype="float32")
    rows = []
    with tempfile.TemporaryDirectory() as out:
        for task in args.tasks:
            times, texts = {}, {}
            for keep in (True, False):
                config = RunConfig.from_dict({"task": task, "preset": "cpu", "model": args.model, "seed": 1,
                                              "n_discovery": args.discovery, "n_holdout": args.holdout, "cache": False,
                                              "precision": "fp32", "results_dir": str(Path(out) / str(keep))})
                times[keep], texts[keep] = one_run(config, lm, keep)
                print(task, "kept" if keep else "none", {k: round(v, 1) for k, v in times[keep].items()}, flush=True)
            rows.append((task, times[False], times[True], texts[False] == texts[True]))
    print(f"\n{args.model}, cpu preset at {args.discovery} discovery / {args.holdout} holdout items, seed 1, no store")
    print("| task | stage 2 s (none / kept) | control s (none / kept) | run s (none / kept) | same artifact |")
    print("|---|---|---|---|---|")
    for task, none, kept, same in rows:
        cells = [f"{none[k]:.1f} / {kept[k]:.1f} ({none[k] / kept[k]:.2f}x)"
                 for k in ("stage2_s", "control_s", "run_s")]
        print(f"| {task} | " + " | ".join(cells) + f" | {'yes' if same else 'NO'} |")


if __name__ == "__main__":
    main()
