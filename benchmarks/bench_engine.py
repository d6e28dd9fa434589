"""Benchmark: stage-1 screening of every head, naive path vs the engine, on the same items in one process.

    python benchmarks/bench_engine.py                       # default model, CPU, small discovery subsets
    python benchmarks/bench_engine.py --tasks boolq --n boolq=16
    python benchmarks/bench_engine.py --model random:llama:3b --device cuda --n arithmetic=2000 --no-naive

For each task it screens the full model plus every single head (270 for SmolLM2-135M) twice: the naive
path (one full forward per intervention with the ablation hook, batch 8, full logits -- how the paper ran
it) and the engine. It checks that both give the same per-example correctness for every head (differences
are allowed only at float ties, |margin| < 1e-4, and are counted), and prints wall times, the speedup, and
the engine's time against the ideal: the FLOPs the engine cannot avoid (one clean pass per batch, the
suffix layers of every intervention, the scored logits) at this machine's measured matmul throughput.
Screened stage 1 against exact stage 1 is benchmarks/bench_screening.py. Timings are from one run; the machine's other load
shows up in them, so compare ratios, not absolute seconds.
"""
from __future__ import annotations

import argparse
import resource
import sys
import time

import numpy as np
import torch

from cel_utils.evaluation.engine import EngineEvaluator
from cel_utils.evaluation.evaluator import NaiveEvaluator
from cel_utils.hardware import machine_summary
from cel_utils.models.loading import load_model
from cel_utils.tasks.splits import load_task_data

DEFAULT_N = {"arithmetic": 32, "boolq": 4, "hellaswag": 4}
DEFAULT_FEWSHOT = {"arithmetic": 0, "boolq": 0, "hellaswag": 0}
TIE = 1e-4


def matmul_throughput(device: torch.device, dtype: torch.dtype, hidden: int, ffn: int) -> float:
    """FLOP/s of a model-shaped GEMM ([4096 x hidden] @ [hidden x ffn]), best of a few runs."""
    a = torch.randn(4096, hidden, device=device, dtype=dtype)
    b = torch.randn(hidden, ffn, device=device, dtype=dtype)
    best = float("inf")
    for _ in range(5):
        if device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        a @ b
        if device.type == "cuda":
            torch.cuda.synchronize()
        best = min(best, time.perf_counter() - start)
    return 2 * 4096 * hidden * ffn / best


def ideal_flops(engine: EngineEvaluator, interventions) -> float:
    """FLOPs the engine must spend, without padding: one clean pass, each intervention's suffix layers
    (projections, MLP and the attention products over the keys each token sees), and the scored logits."""
    from cel_utils.models.plumbing import decoder_layers

    model, geometry = engine.lm.model, engine.lm.geometry
    layer = decoder_layers(model)[0]
    weights_per_token = 2 * sum(p.numel() for p in layer.parameters() if p.dim() == 2)
    attention_per_key = 4 * geometry.n_heads * geometry.head_dim  # q.k and the weighted sum of values
    keys_seen = 0
    for row in engine.rows:  # packed answers see the context plus their own earlier tokens
        keys_seen += sum(range(1, row.context_len + 1))
        keys_seen += sum(row.context_len * (end - start) + sum(range(1, end - start + 1)) for start, end in row.segments)
        if not row.segments:
            keys_seen += sum(range(row.context_len + 1, len(row.tokens) + 1))
    tokens = sum(len(row.tokens) for row in engine.rows)
    per_layer = tokens * weights_per_token + keys_seen * attention_per_key
    vocab, hidden = model.get_output_embeddings().weight.shape
    scored = sum(len(pos) for row in engine.rows for pos, _ in row.scored)
    logits_per_eval = 2 * hidden * (2 * len(engine.rows) if engine.shortcut else vocab * scored)
    total = geometry.n_layers * per_layer + logits_per_eval  # the clean pass, which is also the full model
    for heads in interventions:
        if heads:
            total += (geometry.n_layers - min(h.layer for h in heads)) * per_layer + logits_per_eval
    return float(total)


def compare(reference, candidate) -> tuple[int, int]:
    """(decisions differing outside float ties, decisions differing at ties)."""
    hard = soft = 0
    for ref, out in zip(reference, candidate):
        differ = ref.correct != out.correct
        tie = (np.abs(ref.margin) < TIE) | (np.abs(out.margin) < TIE)
        hard += int((differ & ~tie).sum())
        soft += int((differ & tie).sum())
    return hard, soft


def timed(fn):
    start = time.perf_counter()
    value = fn()
    return value, time.perf_counter() - start


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--tasks", nargs="+", default=list(DEFAULT_N))
    parser.add_argument("--n", nargs="*", default=[], help="items per task, e.g. boolq=8")
    parser.add_argument("--data-dir", default=None)
    parser.add_argument("--token-budget", type=int, default=None)
    parser.add_argument("--no-naive", action="store_true", help="engine only (e.g. a 3B screen on a GPU)")
    args = parser.parse_args(argv)
    sizes = {**DEFAULT_N, **{k: int(v) for k, v in (item.split("=") for item in args.n)}}

    lm = load_model(args.model, device=args.device)
    config = lm.model.config.get_text_config()
    flops_per_s = matmul_throughput(lm.device, lm.dtype, config.hidden_size, config.intermediate_size)
    print(machine_summary())
    print(f"model {lm.name} on {lm.device} ({lm.dtype}), {lm.geometry.n_total} heads; "
          f"measured matmul throughput {flops_per_s / 1e9:.1f} GFLOP/s; threads {torch.get_num_threads()}")
    interventions = [()] + [(h,) for h in lm.geometry.all_heads()]
    rows = []
    for task in args.tasks:
        data = load_task_data(task, sizes[task], 1, seed=0, num_fewshot=DEFAULT_FEWSHOT.get(task, 0), data_dir=args.data_dir)
        engine = EngineEvaluator(lm, data.task, data.discovery, data.fewshot, token_budget=args.token_budget, progress=False)
        fast_outcomes, engine_s = timed(lambda: engine.evaluate(interventions))
        ideal_s = ideal_flops(engine, interventions) / flops_per_s
        row = {"task": task, "items": len(data.discovery), "tokens/pass": engine.n_tokens, "engine_s": engine_s,
               "ideal/engine": ideal_s / engine_s}
        if not args.no_naive:
            naive = NaiveEvaluator(lm, data.task, data.discovery, data.fewshot, batch_size=8, progress=False)
            naive_outcomes, naive_s = timed(lambda: naive.evaluate(interventions))
            hard, soft = compare(naive_outcomes, fast_outcomes)
            row.update({"naive_s": naive_s, "speedup": naive_s / engine_s, "differ": hard, "ties": soft})
        rows.append(row)
        print(" ".join(f"{k}={v:.3g}" if isinstance(v, float) else f"{k}={v}" for k, v in row.items()), flush=True)

    peak_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print("\n| task | items | naive s | engine s | speedup | ideal/engine | differing decisions (ties) |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['task']} | {r['items']} | {r.get('naive_s', float('nan')):.1f} | {r['engine_s']:.1f} | "
              f"{r.get('speedup', float('nan')):.2f}x | {r['ideal/engine']:.2f} | {r.get('differ', '-')} ({r.get('ties', '-')}) |")
    print(f"\npeak resident memory {peak_mb:.0f} MB" + (
        f"; peak GPU memory {torch.cuda.max_memory_allocated() / 2**20:.0f} MB" if lm.device.type == "cuda" else ""))
    return 1 if any(r.get("differ", 0) for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
