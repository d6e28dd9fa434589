"""Benchmark: what bf16 saves in each part of an evaluation, on this machine, for the book's models.

    python benchmarks/bench_precision_parts.py
    python benchmarks/bench_precision_parts.py --models smollm2-135m-instruct --tokens 2048

The guarded precision's fast pass (cel_utils.evaluation.guarded) keeps fp32 for the clean pass, the states kept below
each ablated layer and the unembedding, and runs the ablated layers in bf16. This times each part in fp32 and in bf16,
on real BoolQ discovery prompts packed to about ``--tokens`` tokens per forward (the engine's stacked shapes):

* ``layers``: the decoder layers (embeddings to final norm; the clean pass, and per layer the ablated layers' cost);
* ``unembedding``: the output projection of ``--positions`` hidden states onto every vocabulary row (49k rows for
  SmolLM2, 262k for Gemma 3), as a multi-token answer needs;
* ``log-softmax``: over those rows.

Each part is timed ``--repeats`` times after a warm-up, in the same process, fp32 and bf16 alternating; the table gives
the median seconds and fp32 / bf16 (above 1: bf16 pays). Compare the ratios, not the seconds.
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

from cel_utils.evaluation.precision import bf16_model
from cel_utils.hardware import machine_summary
from cel_utils.models.loading import load_model
from cel_utils.models.plumbing import base_model
from cel_utils.tasks.splits import load_task_data


def _median_seconds(run, repeats: int) -> float:
    run()  # warm-up: kernels chosen, buffers allocated
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


@torch.no_grad()
def bench_model(spec: str | None, tokens: int, positions: int, repeats: int) -> list[dict]:
    lm = load_model(spec, dtype="float32") if spec else load_model(dtype="float32")
    fast = bf16_model(lm)
    data = load_task_data("boolq", 16, 1, seed=0)
    rows = [lm.tokenizer(data.task.doc_to_text(item.doc))["input_ids"] for item in data.discovery]
    width = max(len(r) for r in rows)
    batch = max(1, tokens // width)
    ids = torch.tensor([(r * (width // len(r) + 1))[:width] for r in (rows * batch)[:batch]])
    head = lm.model.get_output_embeddings()
    head16 = fast.model.get_output_embeddings()
    hidden = torch.randn(positions, head.weight.shape[1])
    logits32, logits16 = head(hidden), head16(hidden.bfloat16())
    parts = {
        "layers": (lambda: base_model(lm.model)(input_ids=ids), lambda: base_model(fast.model)(input_ids=ids)),
        "unembedding": (lambda: head(hidden), lambda: head16(hidden.bfloat16())),
        "log-softmax": (lambda: torch.log_softmax(logits32, -1), lambda: torch.log_softmax(logits16, -1)),
    }
    out = []
    for part, (fp32, bf16) in parts.items():
        seconds = {"fp32": _median_seconds(fp32, repeats), "bf16": _median_seconds(bf16, repeats)}
        shape = (f"{batch} x {width} tokens" if part == "layers" else f"{positions} x {head.weight.shape[0]} rows")
        out.append({"model": lm.name, "part": part, "shape": shape, **seconds,
                    "ratio": seconds["fp32"] / seconds["bf16"]})
        print(out[-1], flush=True)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", default=["smollm2-135m-instruct", "gemma3-270m"])
    parser.add_argument("--tokens", type=int, default=4096, help="tokens per forward of the layers")
    parser.add_argument("--positions", type=int, default=256, help="hidden states unembedded")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    print(machine_summary(), flush=True)
    rows = [row for spec in args.models for row in bench_model(spec, args.tokens, args.positions, args.repeats)]
    print("\n| model | part | shape | fp32 s | bf16 s | fp32 / bf16 |\n|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['model']} | {r['part']} | {r['shape']} | {r['fp32']:.3f} | {r['bf16']:.3f} | {r['ratio']:.2f}x |")


if __name__ == "__main__":
    main()
