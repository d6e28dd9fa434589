"""Full-model accuracy of a model on each task's holdout, with wall times (no ablation).

    python benchmarks/baseline_accuracy.py                      # default model, plain format
    python benchmarks/baseline_accuracy.py --n boolq=3270 --fmt chat

Prints one row per (task, few-shot setting): items, accuracy (every metric), wall seconds. Also checks
that the hook and weight surgery agree on this model and prints the largest logit difference.
"""
from __future__ import annotations

import argparse
import copy
import random
import sys
import time

import torch

from cel_utils.evaluation.engine import EngineEvaluator
from cel_utils.hardware import machine_summary
from cel_utils.models.ablation import ablated, zero_heads_in_weights
from cel_utils.models.loading import load_model
from cel_utils.tasks.splits import load_task_data

DEFAULT_N = {"arithmetic": 500, "boolq": 500, "hellaswag": 500, "mbpp": 100}


def exactness(lm, n_sets: int = 5, seed: int = 0) -> float:
    """Largest |logit(hook) - logit(weight surgery)| over random head sets on a real prompt."""
    rng = random.Random(seed)
    ids = lm.tokenizer("The capital of France is Paris. Question: What is 98 plus 45?\nAnswer: 143",
                       return_tensors="pt").input_ids.to(lm.device)
    worst = 0.0
    for _ in range(n_sets):
        heads = rng.sample(lm.geometry.all_heads(), rng.randint(1, 6))
        with torch.no_grad(), ablated(lm.model, heads):
            hooked = lm.model(ids).logits
        surgered = copy.deepcopy(lm.model)
        zero_heads_in_weights(surgered, heads)
        with torch.no_grad():
            worst = max(worst, float((hooked - surgered(ids).logits).abs().max()))
        del surgered
    return worst


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--tasks", nargs="+", default=list(DEFAULT_N))
    parser.add_argument("--n", nargs="*", default=[], help="holdout items per task, e.g. boolq=1000")
    parser.add_argument("--fewshot", nargs="*", default=["arithmetic=0,3", "boolq=0", "hellaswag=0", "mbpp=3"],
                        help="few-shot settings per task, e.g. arithmetic=0,3")
    parser.add_argument("--fmt", default="plain")
    parser.add_argument("--max-new-tokens", type=int, default=256)
    parser.add_argument("--data-dir", default=None)
    parser.add_argument("--batch-size", type=int, default=8)
    args = parser.parse_args(argv)
    sizes = {**DEFAULT_N, **{k: int(v) for k, v in (item.split("=") for item in args.n)}}
    shots = {k: [int(x) for x in v.split(",")] for k, v in (item.split("=") for item in args.fewshot)}

    lm = load_model(args.model)
    print(machine_summary())
    print(f"{lm.name}: hook vs weight surgery, max |logit difference| = {exactness(lm):.3g}", flush=True)
    print("\n| task | format | few-shot | items | accuracy | wall s |\n|---|---|---|---|---|---|")
    for task in args.tasks:
        for num_fewshot in shots.get(task, [0]):
            data = load_task_data(task, 1, sizes[task], seed=0, num_fewshot=num_fewshot, data_dir=args.data_dir)
            start = time.perf_counter()
            evaluator = EngineEvaluator(lm, data.task, data.holdout, data.fewshot, fmt=args.fmt,
                                        batch_size=args.batch_size, max_new_tokens=args.max_new_tokens, progress=False)
            (outcome,) = evaluator.evaluate([()])
            wall = time.perf_counter() - start
            metrics = ", ".join(f"{name} {100 * value:.1f}%" for name, value in outcome.metric_means().items())
            print(f"| {task} | {args.fmt} | {num_fewshot} | {len(data.holdout)} | {metrics} | {wall:.0f} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
