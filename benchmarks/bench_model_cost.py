"""Benchmark: what one item costs under one intervention on each model, per task, measured in the same run.

    python benchmarks/bench_model_cost.py                                   # the default model and gemma3-270m
    python benchmarks/bench_model_cost.py --items 32 --heads 9

For the log-likelihood tasks (BoolQ, HellaSwag, arithmetic_1dc at the cpu preset's 3 shots) it times the engine
(:class:`cel_utils.evaluation.engine.EngineEvaluator`, no store) on single-head ablations spread evenly over the layers,
so that the engine's reuse below the ablated layer saves what it saves in an exhaustive stage 1 (on average half the
layers). For MBPP it times greedy decoding of the cpu preset's ``max_new_tokens`` (interventions stacked as rows, as
the engine does) and, apart, the unembedding of one decoding step: Gemma's 262k-row vocabulary makes it cost more than
the rest of the model. The models alternate task by task, so a machine shared with other work slows both alike:
compare the ratios. Output: a JSON file and a Markdown table.
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from cel_utils.config import DEFAULT_MODEL, RunConfig
from cel_utils.evaluation.engine import EngineEvaluator
from cel_utils.evaluation.generation import generate
from cel_utils.hardware import machine_summary
from cel_utils.models.ablation import head_mask
from cel_utils.models.heads import HeadId
from cel_utils.models.loading import load_model
from cel_utils.models.plumbing import unembed
from cel_utils.paths import atomic_write
from cel_utils.tasks.splits import load_task_data


def spread_heads(geometry, n: int) -> list[tuple[HeadId, ...]]:
    """``n`` single heads at evenly spaced layers (first to last), cycling through the head index."""
    layers = [round(i * (geometry.n_layers - 1) / max(1, n - 1)) for i in range(n)]
    return [(HeadId(layer, i % geometry.n_heads),) for i, layer in enumerate(layers)]


def task_data(task: str, model: str, n_items: int):
    config = RunConfig.from_dict({"task": task, "preset": "cpu", "model": model})
    return config, load_task_data(task, n_items, 1, seed=0, num_fewshot=config.num_fewshot, data_dir=config.data_dir)


def loglikelihood_cost(lm, task: str, n_items: int, n_heads: int) -> dict:
    _, data = task_data(task, lm.spec, n_items)
    evaluator = EngineEvaluator(lm, data.task, data.discovery, data.fewshot, progress=False)
    interventions = spread_heads(lm.geometry, n_heads)
    start = time.perf_counter()
    evaluator.evaluate(interventions)
    seconds = time.perf_counter() - start
    tokens = sum(r.n_tokens for r in evaluator.requests) / len(evaluator.requests)
    return {"items": len(data.discovery), "interventions": len(interventions), "seconds": seconds,
            "per_item_intervention_s": seconds / (len(data.discovery) * len(interventions)), "tokens_per_item": tokens}


@torch.no_grad()
def mbpp_cost(lm, n_items: int, n_heads: int) -> dict:
    config, data = task_data("mbpp", lm.spec, n_items)
    kind_requests = EngineEvaluator(lm, data.task, data.discovery, data.fewshot, progress=False).requests
    interventions = spread_heads(lm.geometry, n_heads)
    masks = torch.cat([head_mask(h, lm.geometry).expand(len(kind_requests), -1, -1) for h in interventions])
    start = time.perf_counter()
    completions = generate(lm, kind_requests * len(interventions), row_masks=masks, batch_size=64,
                           max_new_tokens=config.max_new_tokens)
    seconds = time.perf_counter() - start
    generated = sum(len(lm.tokenizer(c, add_special_tokens=False).input_ids) for c in completions)
    rows = len(completions)
    hidden = torch.randn(rows, 1, lm.model.config.get_text_config().hidden_size, dtype=lm.dtype)
    unembed(lm.model, hidden)  # warm up
    reps = 20
    start = time.perf_counter()
    for _ in range(reps):
        unembed(lm.model, hidden)
    unembed_s = (time.perf_counter() - start) / reps
    return {"items": len(data.discovery), "interventions": len(interventions), "max_new_tokens": config.max_new_tokens,
            "seconds": seconds, "per_item_intervention_s": seconds / rows, "generated_tokens": generated,
            "prompt_tokens_per_item": sum(len(r.context) for r in kind_requests) / len(kind_requests),
            "unembed_step_s_per_row": unembed_s / rows}


def markdown(results: dict, models: list[str]) -> str:
    base = models[0]
    lines = ["| task | " + " | ".join(f"{m}: s per item x intervention" for m in models)
             + " | " + " | ".join(f"{m} / {base}" for m in models[1:]) + " |",
             "|---" * (1 + 2 * len(models) - 1) + "|"]
    for task, per_model in results.items():
        cells = [f"{per_model[m]['per_item_intervention_s']:.3f}" for m in models]
        ratios = [f"{per_model[m]['per_item_intervention_s'] / per_model[base]['per_item_intervention_s']:.2f}"
                  for m in models[1:]]
        lines.append(f"| {task} | " + " | ".join(cells) + " | " + " | ".join(ratios) + " |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", default=[DEFAULT_MODEL, "gemma3-270m"])
    parser.add_argument("--tasks", nargs="+", default=["boolq", "hellaswag", "arithmetic_1dc", "mbpp"])
    parser.add_argument("--items", type=int, default=16, help="items per log-likelihood task")
    parser.add_argument("--heads", type=int, default=6, help="single-head interventions per log-likelihood task")
    parser.add_argument("--mbpp-items", type=int, default=2)
    parser.add_argument("--mbpp-heads", type=int, default=2)
    parser.add_argument("--out", default="results/bench/model_cost.json")
    args = parser.parse_args()
    models = {spec: load_model(spec) for spec in args.models}
    print(machine_summary(), flush=True)  # the ratios below belong to this machine
    results: dict = {}
    for task in args.tasks:
        results[task] = {}
        for spec, lm in models.items():
            results[task][spec] = (mbpp_cost(lm, args.mbpp_items, args.mbpp_heads) if task == "mbpp"
                                   else loglikelihood_cost(lm, task, args.items, args.heads))
            print(task, spec, json.dumps(results[task][spec]), flush=True)
    atomic_write(Path(args.out), json.dumps({"machine": machine_summary(), "results": results}, indent=1) + "\n")
    print(markdown(results, args.models))


if __name__ == "__main__":
    main()
