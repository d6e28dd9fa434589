"""What the transfer step (cel_utils.pipeline.transfer) costs per model: the ablated model on the other tasks' holdouts.

    python benchmarks/bench_transfer.py                          # default model, cpu preset, book seed
    python benchmarks/bench_transfer.py --model gemma3-270m --items arithmetic=40 mbpp=6

Per task, the evaluator the run uses (its cpu-preset configuration) scores three random head sets of two heads (the
three other tasks' frozen sets a transfer matrix evaluates on each task) together on the first few holdout items, with
the store off, and the seconds per item and set are scaled to the step: 3 sets x the transfer items of each task
(``transfer_items``, or the whole holdout). The full model is not evaluated: its holdout outcomes come from the runs.
"""
from __future__ import annotations

import argparse
import random
import time

from cel_utils.config import TransferConfig
from cel_utils.hardware import machine_summary
from cel_utils.pipeline.protocol import load_for, make_evaluator
from cel_utils.presets import BOOK_SEED, PRESET_TASKS
from cel_utils.tasks.splits import load_task_data

DEFAULT_ITEMS = {"arithmetic": 40, "boolq": 24, "hellaswag": 24, "mbpp": 6}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--preset", default="cpu")
    parser.add_argument("--items", nargs="*", default=[], metavar="FAMILY=N", help="items timed per task")
    parser.add_argument("--data-dir", default=None)
    args = parser.parse_args()
    timed = {**DEFAULT_ITEMS, **{k: int(v) for k, v in (x.split("=") for x in args.items)}}
    print(machine_summary(), flush=True)
    lm = None
    total_step, total_full = 0.0, 0.0
    for task in PRESET_TASKS[args.preset]:
        config = TransferConfig.from_dict({"model": args.model, "task": task, "preset": args.preset, "seed": BOOK_SEED,
                                           "cache": False, "data_dir": args.data_dir})
        lm = lm or load_for(config)
        data = load_task_data(task, config.n_discovery, config.n_holdout, seed=BOOK_SEED,
                              num_fewshot=config.num_fewshot, data_dir=config.data_dir)
        family = task.split("_")[0]
        n = min(timed[family], len(data.holdout))
        evaluator = make_evaluator(lm, data, data.holdout[:n], config, progress=False)
        rng = random.Random(0)
        sets = [tuple(rng.sample(lm.geometry.all_heads(), 2)) for _ in range(3)]
        start = time.perf_counter()
        evaluator.evaluate(sets)
        per_item_set = (time.perf_counter() - start) / (n * len(sets))
        step_items = len(data.holdout) if config.transfer_items is None else min(config.transfer_items, len(data.holdout))
        step, full = 3 * step_items * per_item_set, 3 * len(data.holdout) * per_item_set
        total_step, total_full = total_step + step, total_full + full
        print(f"{task:16s} {n:4d} items timed: {per_item_set:.3f} s per item and set; as a target of 3 sets: "
              f"{step / 60:5.1f} min on {step_items} transfer items ({full / 60:5.1f} min on all {len(data.holdout)})",
              flush=True)
    print(f"transfer step of {args.model} (4 tasks x 3 other sets): {total_step / 60:.1f} min with transfer_items "
          f"({total_full / 60:.1f} min on the whole holdouts)")


if __name__ == "__main__":
    main()
