"""Benchmark: fp32, plain bf16 and the guarded precision side by side, on the cpu preset's discovery items.

    python benchmarks/bench_precision.py                                    # boolq, hellaswag, arithmetic_1dc
    python benchmarks/bench_precision.py --tasks boolq --items 64 --heads 40 --pairs 10
    python benchmarks/bench_precision.py --tasks boolq --offset 16 --items 32 --heads 0 --pairs 0 --no-plain  # more pairs
    python benchmarks/bench_precision.py --shape holdout --tasks boolq hellaswag                 # a holdout's call
    python benchmarks/bench_precision.py --model gemma3-270m --shape transfer --tasks boolq
    python benchmarks/bench_precision.py --artifact results/smollm2-135m-instruct__boolq__seed1.json --no-plain --unkept

Shapes (``--shape``): ``stage1``, the full model, ``--heads`` single heads and ``--pairs`` random pairs on the first
``--items`` discovery items (a stage-1 or stage-2 call); ``holdout``, the full model and one random pair of heads on the
preset's holdout items (``--items`` of them, if given); ``transfer``, three random pairs on the preset's transfer items.
``--artifact`` replays a run's search instead: the full model, the heads its screen kept and stage 2's sets, on its
discovery items. ``--unkept`` adds guarded with the rechecks after the fast pass running a clean pass of their own (as
before they read the kept clean passes), to time what reading them saves.

For each task, the same (item, intervention) pairs -- the full model, ``--heads`` single heads spread over the layers
(0: all of them) and ``--pairs`` random pairs of heads -- are evaluated by the engine in fp32, in plain bf16 (a bfloat16
copy of the model) and guarded (:mod:`cel_utils.evaluation.guarded`: its fast pass is fp32 below the ablated layers,
bf16 in them), without the store, one after the other in this process. It prints, per task: the decisions plain bf16 flips (against fp32, under the primary metric), the decisions
the guarded path flips (must be 0), the share of pairs the guard rechecked in fp32, its bands (per third of the layers
by the first ablated layer, lowest first; one band where no pair had a depth, as in decoding),
and the wall time of each (and the ratios fp32 / bf16 and fp32 / guarded), and what a rechecked pair cost against a
pair of fp32's stacked product (the rechecks' seconds per rechecked pair over fp32's seconds per pair). Timings are from
one run on a shared machine: compare the ratios, not the seconds.
"""
from __future__ import annotations

import argparse
import functools
import json
import time
from pathlib import Path

import numpy as np

from cel_utils.config import TransferConfig
from cel_utils.evaluation.clean_passes import CleanPasses
from cel_utils.evaluation.engine import EngineEvaluator
from cel_utils.evaluation import guarded
from cel_utils.evaluation.guarded import Guard, GuardedEvaluator
from cel_utils.evaluation.precision import bf16_model
from cel_utils.hardware import machine_summary
from cel_utils.models.heads import parse_head
from cel_utils.models.loading import load_model
from cel_utils.tasks.splits import load_task_data


def _interventions(geometry, n_heads: int, n_pairs: int, seed: int = 0) -> list:
    """The full model, ``n_heads`` single heads spread over the layers and ``n_pairs`` distinct random pairs of heads
    (drawn with ``seed``: another seed gives other pairs, for more pairs on the same items)."""
    heads = geometry.all_heads()
    singles = heads if not n_heads or n_heads >= len(heads) else [heads[j] for j in
                                                                   np.linspace(0, len(heads) - 1, n_heads).astype(int)]
    rng = np.random.default_rng(seed)
    pairs: dict = {}
    while len(pairs) < n_pairs:
        pairs[tuple(sorted(heads[j] for j in rng.choice(len(heads), 2, replace=False)))] = None
    return [()] + [(h,) for h in singles] + list(pairs)


def _flips(reference, candidate) -> int:
    return int(sum((a.correct != b.correct).sum() + sum(x != y for x, y in zip(a.predictions, b.predictions))
                   for a, b in zip(reference, candidate)))


class Clock:
    """The seconds spent in the callables ``names`` of ``owner`` (a module's functions or an object's methods) while
    entered. A timed call made from inside another counts once (``pair_stats`` calls ``batch_pair_stats``)."""

    def __init__(self, owner, names: tuple[str, ...]):
        self.owner, self.seconds, self.depth = owner, 0.0, 0
        self.saved = {name: getattr(owner, name) for name in names}

    def __enter__(self):
        for name, function in self.saved.items():
            setattr(self.owner, name, self._timed(function))
        return self

    def _timed(self, function):
        def timed(*args, **kwargs):
            start = time.perf_counter()
            self.depth += 1
            try:
                return function(*args, **kwargs)
            finally:
                self.depth -= 1
                if not self.depth:
                    self.seconds += time.perf_counter() - start
        return timed

    def __exit__(self, *exc):
        for name, function in self.saved.items():
            setattr(self.owner, name, function)


RECHECKS = ("pair_stats", "batch_pair_stats")  # guarded.py's two recheck paths, which Clock(guarded, RECHECKS) times


def run_calls(path: Path) -> tuple[str, list]:
    """A run artifact's task and the interventions its search scored (stage 1's, the full model among them, then stage
    2's sets): the calls of a real run, whose heads the screen chose, in place of heads spread over the layers."""
    artifact = json.loads(path.read_text())
    sets = [tuple(parse_head(h) for h in row["heads"]) for part in ("stage1", "stage2") for row in artifact[part]]
    return artifact["config"]["task"], [()] + [heads for heads in dict.fromkeys(sets) if heads]


def bench_task(lm, task: str, n_items: int | None, n_heads: int, n_pairs: int, offset: int = 0,
               plain: bool = True, pair_seed: int = 0, shape: str = "stage1", model: str | None = None,
               interventions: list | None = None, unkept: bool = False) -> dict:
    config = TransferConfig.from_dict({"task": task, "preset": "cpu", **({"model": model} if model else {})})
    data = load_task_data(task, config.n_discovery, config.n_holdout, seed=config.seed, num_fewshot=config.num_fewshot,
                          data_dir=config.data_dir)
    if interventions is not None:
        pool = data.discovery
    elif shape == "stage1":
        pool, interventions = data.discovery, _interventions(lm.geometry, n_heads, n_pairs, pair_seed)
    elif shape == "holdout":
        pool, interventions = data.holdout, _interventions(lm.geometry, 1, 1, pair_seed)[::2]  # full model, a pair
    else:
        pool = data.holdout[:config.transfer_items]
        interventions = _interventions(lm.geometry, 1, 3, pair_seed)[2:]  # three pairs, no full model
    items = pool[offset:offset + n_items] if n_items else pool[offset:]
    make = functools.partial(EngineEvaluator, task=data.task, items=items, fewshot=data.fewshot, progress=False)
    times, outcomes = {}, {}

    def guarded_evaluator(kept: CleanPasses | None, guard: Guard) -> GuardedEvaluator:
        # as a run builds it: its fp32 engine and its fast pass share the run's kept clean passes
        return GuardedEvaluator(make(lm, clean_passes=kept), make(lm, above=bf16_model(lm), clean_passes=kept), guard)

    # fp32 and guarded each with kept clean passes of their own, as a run has them (one call reuses its own passes
    # either way); plain bf16 without, as it was timed before
    guards = {"guarded": Guard(seed=config.seed)}
    runs = {"fp32": lambda: make(lm, clean_passes=CleanPasses()), "bf16": lambda: make(bf16_model(lm)),
            "guarded": lambda: guarded_evaluator(CleanPasses(), guards["guarded"])}
    if not plain:
        del runs["bf16"]
    if unkept:  # the guard's rechecks after the pass with a clean pass of their own, as before they read kept states
        guards["guarded, rechecks unkept"] = Guard(seed=config.seed)
        runs["guarded, rechecks unkept"] = lambda: guarded_evaluator(None, guards["guarded, rechecks unkept"])
    clocks = {}
    for name, build in runs.items():
        evaluator = build()
        with Clock(guarded, RECHECKS) as clocks[name]:
            start = time.perf_counter()
            outcomes[name] = evaluator.evaluate(interventions)
            times[name] = time.perf_counter() - start
    per_pair = times["fp32"] / (len(items) * len(interventions))

    def recheck_cost(name: str) -> float | None:
        """A pair that guard ``name`` computed in fp32 too, in pairs of fp32's stacked product."""
        record = guards[name].to_json()
        computed = record["rechecked"] + record["audited"]
        return clocks[name].seconds / max(1, computed) / per_pair if clocks[name].seconds else None

    record = guards["guarded"].to_json()
    return {"task": task, "shape": shape, "model": config.model, "fewshot": len(data.fewshot), "items": len(items),
            "interventions": len(interventions), "pairs": len(items) * len(interventions),
            "recheck_s": clocks["guarded"].seconds, "computed_fp32": record["rechecked"] + record["audited"],
            # decoding (MBPP) recomputes rows in guarded_generation, not timed here
            "recheck_cost": recheck_cost("guarded"),
            "bf16_flips": _flips(outcomes["fp32"], outcomes["bf16"]) if plain else None,
            "guarded_flips": _flips(outcomes["fp32"], outcomes["guarded"]), "share_rechecked": record["share_rechecked"],
            "band": record["band"], "depth_bands": record.get("depth_bands"), "largest_error": record["largest_error"],
            "fell_back": record["fell_back_to_fp32"], **{f"{k}_s": v for k, v in times.items()},
            **({"unkept_recheck_cost": recheck_cost("guarded, rechecks unkept"),
                "unkept_flips": _flips(outcomes["fp32"], outcomes["guarded, rechecks unkept"])} if unkept else {})}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tasks", nargs="+", default=["boolq", "hellaswag", "arithmetic_1dc"])
    parser.add_argument("--items", type=int, default=None, help="first n discovery items (default: all 128)")
    parser.add_argument("--offset", type=int, default=0, help="skip the first discovery items (new pairs for the check)")
    parser.add_argument("--heads", type=int, default=0, help="single heads spread over the layers (0: all)")
    parser.add_argument("--pairs", type=int, default=20, help="random pairs of heads")
    parser.add_argument("--pair-seed", type=int, default=0, help="seed of the random pairs (another seed: other pairs)")
    parser.add_argument("--shape", choices=["stage1", "holdout", "transfer"], default="stage1")
    parser.add_argument("--model", default=None, help="a model spec (default: the default model)")
    parser.add_argument("--no-plain", dest="plain", action="store_false",
                        help="skip plain bf16 (only fp32 and guarded: more pairs checked per hour)")
    parser.add_argument("--artifact", type=Path, nargs="+", default=None,
                        help="run artifacts: each one's search calls (its task, the heads its screen chose, stage 2's "
                             "sets) on --items of its discovery items, in place of --tasks, --heads and --pairs")
    parser.add_argument("--unkept", action="store_true",
                        help="also guarded with the rechecks after the pass running clean passes of their own")
    args = parser.parse_args()
    print(machine_summary(), flush=True)
    lm = load_model(args.model, dtype="float32") if args.model else load_model(dtype="float32")
    rows = []
    calls = [run_calls(path) for path in args.artifact] if args.artifact else [(task, None) for task in args.tasks]
    for task, interventions in calls:
        row = bench_task(lm, task, args.items, args.heads, args.pairs, args.offset, args.plain, args.pair_seed,
                         args.shape, args.model, interventions, args.unkept)
        rows.append(row)
        print(row, flush=True)
    print("\n| model | task | shape | items x interventions | plain bf16 flips | guarded flips | share rechecked | bands "
          "(2x largest error; per third) | fp32 s | bf16 s | guarded s | fp32/bf16 | fp32/guarded | fp32 pairs of the guard | "
          "a recomputed pair / a stacked fp32 pair |"
          + (" guarded, rechecks unkept s | fp32/that | its recomputed pair / a stacked fp32 pair | its flips |"
             if args.unkept else ""))
    print("|---" * (15 + 4 * args.unkept) + "|")
    for r in rows:
        fell = " (fell back)" if r["fell_back"] else ""
        plain = "bf16_s" in r
        cells = [r["model"], f"{r['task']}{' %d-shot' % r['fewshot'] if r['fewshot'] else ''}", r["shape"],
                 f"{r['items']} x {r['interventions']}",
                 f"{r['bf16_flips']} of {r['pairs']}" if plain else f"- (of {r['pairs']})", f"{r['guarded_flips']}{fell}",
                 f"{r['share_rechecked']:.1%}", " / ".join(f"{b:.3g}" for b in r["depth_bands"] or [r["band"]]), f"{r['fp32_s']:.0f}",
                 f"{r['bf16_s']:.0f}" if plain else "-", f"{r['guarded_s']:.0f}",
                 f"{r['fp32_s'] / r['bf16_s']:.2f}x" if plain else "-", f"{r['fp32_s'] / r['guarded_s']:.2f}x",
                 str(r["computed_fp32"]), "-" if r["recheck_cost"] is None else f"{r['recheck_cost']:.2f}x"]
        if args.unkept:
            unkept = r["guarded, rechecks unkept_s"]
            cells += [f"{unkept:.0f}", f"{r['fp32_s'] / unkept:.2f}x", f"{r['unkept_recheck_cost']:.2f}x",
                      str(r["unkept_flips"])]
        print("| " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
