"""Benchmark: what the engine's scoring of multi-token answers costs, with and without the greedy statistics.

    python benchmarks/bench_scoring.py
    python benchmarks/bench_scoring.py --models gemma3-270m --items 32 --heads 12

After the unembedding, the engine scores each answer: the log-softmax over the vocabulary
(:func:`cel_utils.tasks.scoring.continuation_loglikelihood`), and, where the task's kind reads it
(``TaskKind.reads_greedy``: teacher-forced greedy match), whether every target token was the argmax and by how much
(:func:`~cel_utils.tasks.scoring.continuation_stats`), which takes a copy of the logits and a maximum over them.
Multiple choice does not read it. This runs one HellaSwag call (the full model and ``--heads`` single heads spread over
the layers, on the first ``--items`` discovery items) with the kind as it is and with the greedy statistics forced
on (the engine before the change), alternating, ``--repeats`` times each in one process; it checks that the
log-likelihoods are the same bits, and prints per setting the median seconds of the whole call, of the unembedding
and of the scoring. Compare the ratios within a run, not the seconds across runs: the machine's other load shows up.
"""
from __future__ import annotations

import argparse
import dataclasses
import statistics
import time

import numpy as np

import cel_utils.evaluation.engine as engine_module
from bench_precision import Clock, _interventions
from cel_utils.config import TransferConfig
from cel_utils.evaluation.engine import EngineEvaluator
from cel_utils.hardware import machine_summary
from cel_utils.models.loading import load_model
from cel_utils.tasks.splits import load_task_data

SETTINGS = ("the kind's own", "greedy forced on")
SCORERS = ("continuation_loglikelihood", "continuation_stats")  # engine.py's two, which Clock(engine, SCORERS) times


def time_call(lm, model: str, task: str, n_items: int, n_heads: int, repeats: int) -> dict:
    """Median seconds (whole call, unembedding, scoring) per setting, and whether their log-likelihoods are equal."""
    config = TransferConfig.from_dict({"task": task, "preset": "cpu", "model": model})
    data = load_task_data(task, config.n_discovery, config.n_holdout, seed=config.seed, num_fewshot=config.num_fewshot,
                          data_dir=config.data_dir)
    interventions = _interventions(lm.geometry, n_heads, 0)
    evaluators = {}
    for setting in SETTINGS:
        evaluator = EngineEvaluator(lm, task=data.task, items=data.discovery[:n_items], fewshot=data.fewshot,
                                    progress=False)
        if setting == "greedy forced on":
            evaluator.kind = dataclasses.replace(evaluator.kind, reads_greedy=True)
        evaluators[setting] = evaluator
    seconds = {setting: [] for setting in SETTINGS}
    lls = {}
    for _ in range(repeats):
        for setting, evaluator in evaluators.items():
            with Clock(engine_module, ("unembed",)) as unembedding, \
                    Clock(engine_module, SCORERS) as scoring:
                start = time.perf_counter()
                stats = evaluator.continuation_stats(interventions)
                whole = time.perf_counter() - start
            seconds[setting].append((whole, unembedding.seconds, scoring.seconds))
            lls[setting] = np.concatenate([s.ll for per in stats for s in per])
    first, other = (lls[setting] for setting in SETTINGS)
    return {"medians": {setting: [statistics.median(part) for part in zip(*runs)] for setting, runs in seconds.items()},
            "same_ll": first.tobytes() == other.tobytes(), "pairs": len(interventions) * n_items,
            "positions": sum(len(positions) for row in evaluators[SETTINGS[0]].rows for positions, _ in row.scored)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=["smollm2-135m-instruct", "gemma3-270m"])
    parser.add_argument("--task", default="hellaswag")
    parser.add_argument("--items", type=int, default=16)
    parser.add_argument("--heads", type=int, default=6)
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    print(machine_summary())
    print("| model | call | positions per pass | setting | whole call s | unembedding s | scoring s | "
          "forced / own (whole call) | same log-likelihoods |")
    print("|---|---|---|---|---|---|---|---|---|")
    for name in args.models:
        lm = load_model(name)
        found = time_call(lm, name, args.task, args.items, args.heads, args.repeats)
        own, forced = (found["medians"][setting] for setting in SETTINGS)
        for setting in SETTINGS:
            whole, unembedding, scoring = found["medians"][setting]
            ratio = f"{forced[0] / own[0]:.2f}x" if setting == SETTINGS[0] else ""
            print(f"| {name} | {args.task} {args.items} x {args.heads + 1} | {found['positions']} | {setting} | "
                  f"{whole:.1f} | {unembedding:.1f} | {scoring:.1f} | {ratio} | {found['same_ll']} |")


if __name__ == "__main__":
    main()
