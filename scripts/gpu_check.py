"""The researcher's GPU path, checked: the engine against the naive path in fp32 and bf16, under the SDPA and eager
kernels, hooks against weight surgery, the guarded precision against fp32, and stage-1-shaped timings, on random-weight
models with the book models' exact configurations and a Llama-3.2-1B-shaped one, built on the device.

    python scripts/gpu_check.py                              # on CUDA; the JSON goes to $OUT/gpu_check.json
    python scripts/gpu_check.py --device cpu --tiny --out /tmp/gpu_check.json   # tiny models on the CPU (the test)

It imports cel_utils (from the tree it sits in), torch, transformers, tokenizers and numpy, never gguf, datasets or
papermill (the GPU machine has none of them), and reads what lies beside it: ``gpu_check_data/models.json`` (the
configurations) and ``gpu_check_data/items.json`` (a 28 KB slice of the task data, its provenance inside). The weights
are random, so no checkpoint travels; the tokenizer is a byte-level BPE trained at start on the slice's text (under a
second), its vocabulary filled up to the models' with tokens no text encodes to, so that every id a model can produce
decodes. Its prompts run about as long as SmolLM2's tokenizer makes the real ones (the JSON records their lengths).

What it checks, per model x attention kernel (sdpa, eager) x dtype (float32, bfloat16) x task (BoolQ and HellaSwag:
choice; arithmetic_1dc 3-shot: greedy; MBPP 3-shot: decoding), on the slice's items and six interventions (the full
model, single heads in the first, middle and last layers, a pair, a triple):

* ``engine == naive``: :class:`EngineEvaluator` against :class:`NaiveEvaluator` (decoding: the engine's stacked rows
  against :func:`generate`, one head set at a time);
* ``hook == surgery``: the ablation hook against :func:`zero_heads_in_weights` on the naive path;
* ``guarded == fp32`` (float32 only): :class:`GuardedEvaluator`'s decisions (a first audit of 8 pairs, not all, so that
  the band decides) against the fp32 engine's;
* ``naive == transformers`` (decoding only): the full model's naive decoding against transformers' own ``generate``, a
  reference outside the package for its decoding loop (a KV cache that transformers ignored, as 5.17 ignores the
  ``cache=`` cel_utils passes, decodes wrongly in the engine and the naive path alike and passes every check above).

A decision is the chosen answer (choice), the greedy match (greedy) or the decoded token at each step (decoding). Two
results agree when no decision differs outside a float tie and no margin (decoding: top-2 gap) differs by more than the
tolerance. float32: ties are gaps of at most 1e-4 and margins may differ by 1e-3 (the CPU tests' tolerance). bfloat16:
both are twice the largest difference between the naive path's bf16 and fp32 numbers on the same pairs, which is what
rounding to bf16 alone moves them; an engine error beyond rounding shows far above it. Guarded is held to fp32's ties.
A check that raises is recorded with its error and where it was raised, and the run goes on.

Timings, stage-1-shaped: the full model and every single head on ``--timing-items`` (128) synthetic items shaped like
BoolQ and HellaSwag (each slice row's fields keep their word counts, filled with words drawn from the slice: with
random weights lengths matter, not meaning), by the engine in fp32, plain bf16 (a bf16 copy) and guarded
(:mod:`cel_utils.evaluation.guarded`), one after the other after a warm-up, SDPA. Beside them: the decisions plain bf16
flips against fp32 and those guarded flips (outside fp32's ties: must be 0), and the guard's audit.

On a lent GPU (the device tool; the command runs in the repository root there and $OUT comes back). The machine's
transformers (5.17 when last listed) takes a model's KV cache as ``past_key_values`` and drops the ``cache=`` cel_utils
passes, so the script refuses it: carry the project's transformers (5.25.0) and what it needs that the machine lacks,
15 MB of wheels. Here, once, in the repository root::

    echo /.whl/ >> .git/info/exclude
    .venv/bin/python -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        --platform manylinux_2_28_x86_64 -d .whl transformers==5.25.0 huggingface_hub==2.4.0 httpx2==2.17.0 \
        httpcore2==2.17.0 truststore==0.10.5

then, in one call (sized for under 8 minutes of an H100, an estimate: no GPU has run it yet)::

    run(command="python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl && "
                "export PYTHONPATH=/tmp/site || exit; set -o pipefail; "
                "PYTHONUNBUFFERED=1 python3 scripts/gpu_check.py 2>&1 | tee $OUT/gpu_check.log",
        carry=[".whl"], timeout_s=540)

It writes $OUT/gpu_check.json after each model (``finished`` false until the end), prints the tables, and exits 1 if
any check fails. ``--models`` and ``--timing-models`` narrow it; ``--timing-models`` with no name skips the timings.
"""
from __future__ import annotations

import argparse
import dataclasses
import datetime
import functools
import gc
import json
import os
import platform
import random
import subprocess
import sys
import tempfile
import time
import traceback
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator, Sequence

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:  # on the GPU machine the package is not installed: it is the tree the script sits in
    sys.path.insert(0, str(REPO))

import cel_utils  # noqa: E402,F401  (first: it sets OMP_WAIT_POLICY before torch loads)
import numpy as np  # noqa: E402
import torch  # noqa: E402

from cel_utils.evaluation.engine import EngineEvaluator  # noqa: E402
from cel_utils.evaluation.evaluator import NaiveEvaluator  # noqa: E402
from cel_utils.evaluation.generation import Decoded, generate  # noqa: E402
from cel_utils.evaluation.guarded import Guard, GuardedEvaluator  # noqa: E402
from cel_utils.evaluation.guarded_generation import (decoding_error, guarded_completions,  # noqa: E402
                                                     stacked_completions)
from cel_utils.evaluation.precision import bf16_model  # noqa: E402
from cel_utils.hardware import cpu_info  # noqa: E402
from cel_utils.models.ablation import zero_heads_in_weights  # noqa: E402
from cel_utils.models.heads import HeadId  # noqa: E402
from cel_utils.models.loading import LoadedModel, resolve_device  # noqa: E402
from cel_utils.models.plumbing import attention_output_projections, head_geometry  # noqa: E402
from cel_utils.tasks.scoring import Outcome, at_least_float32  # noqa: E402
from cel_utils.tasks.catalog import get_task  # noqa: E402
from cel_utils.tasks.specs import Item, TaskSpec, validate_item  # noqa: E402

DATA = Path(__file__).resolve().parent / "gpu_check_data"
MODELS = json.loads((DATA / "models.json").read_text())["models"]
BOOK_MODELS = ("smollm2-135m", "gemma3-270m")
ATTENTIONS = ("sdpa", "eager")
# The checked tasks and their kinds; the timed ones are those precision auto runs guarded (multiple choice).
TASKS = {"boolq": "choice", "hellaswag": "choice", "arithmetic_1dc": "greedy", "mbpp": "decoding"}
TIMED_TASKS = ("boolq", "hellaswag")
ARITHMETIC_SHOTS = 3  # the cpu preset's: a shared prefix, computed once per head set (without a sliding window)
TRAINED_VOCAB = 4096  # the BPE's merges run out before it on the slice's text (at about 3,100 tokens)
SPECIALS = ("<pad>", "<eos>", "<bos>")  # ids 0, 1, 2, given to every model's config in place of its own


@dataclasses.dataclass(frozen=True)
class Scale:
    """How much one run computes: items per checked task, decoded items and their new tokens, timed items."""

    check_items: int
    decode_items: int
    new_tokens: int
    timing_items: int


FULL = Scale(check_items=8, decode_items=4, new_tokens=32, timing_items=128)
TINY = Scale(check_items=3, decode_items=2, new_tokens=3, timing_items=4)


@dataclasses.dataclass(frozen=True)
class Tolerance:
    """``tie``: a reference decision whose gap (to the runner-up answer or token) is at most this may go either way;
    ``margin``: how far two margins (or decoding gaps) may differ."""

    tie: float
    margin: float


FP32 = Tolerance(tie=1e-4, margin=1e-3)


def log(message: str, start: float = time.perf_counter()) -> None:
    """``message`` after the seconds since the script was loaded (``start``'s default is taken then)."""
    print(f"[{time.perf_counter() - start:7.1f} s] {message}", flush=True)


# --- Models, tokenizer, items ------------------------------------------------------------------------------

def tiny_config(fields: dict) -> dict:
    """The same family in small (the CPU test). Gemma 3 keeps its one KV head, query heads wider than the hidden size,
    and sliding layers before a full one, with a window of 16 that every prompt exceeds so that it bites."""
    tiny = {**fields, "num_hidden_layers": 3, "hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 4,
            "num_key_value_heads": 2, "head_dim": 16, "vocab_size": 5000}  # above the trained tokens, as the real ones
    if "layer_types" in fields:
        tiny.update(layer_types=["sliding_attention", "sliding_attention", "full_attention"], num_key_value_heads=1,
                    hidden_size=48, sliding_window=16, query_pre_attn_scalar=16)
    return tiny


def model_fields(name: str, tiny: bool) -> dict:
    return tiny_config(MODELS[name]) if tiny else dict(MODELS[name])


def build_tokenizer(texts: Sequence[str], vocab_size: int):
    """A byte-level BPE trained on ``texts``, its vocabulary filled up to ``vocab_size`` with tokens that no text
    encodes to (``<|f{id}|>``, no merge makes them) so that whatever id a model decodes has a text."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    bpe.train_from_iterator(texts, trainers.BpeTrainer(vocab_size=TRAINED_VOCAB, special_tokens=list(SPECIALS),
                                                       initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                                       show_progress=False))
    spec = json.loads(bpe.to_str())
    vocab = spec["model"]["vocab"]
    trained = len(vocab)
    vocab.update({f"<|f{i}|>": i for i in range(trained, vocab_size)})
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=Tokenizer.from_str(json.dumps(spec)), pad_token=SPECIALS[0],
                                        eos_token=SPECIALS[1], bos_token=SPECIALS[2])
    tokenizer.trained_vocab = trained
    return tokenizer


def build_model(name: str, fields: dict, tokenizer, device: torch.device) -> LoadedModel:
    """Random weights (seed 0) in float32 on ``device``, SDPA; the special ids are the tokenizer's."""
    from transformers import AutoConfig, AutoModelForCausalLM

    fields = {**fields, "pad_token_id": tokenizer.pad_token_id, "bos_token_id": tokenizer.bos_token_id,
              "eos_token_id": tokenizer.eos_token_id}
    config = AutoConfig.for_model(fields.pop("model_type"), **fields)
    torch.manual_seed(0)
    with torch.device(device):  # initialised where it runs: a 1B model's init on the CPU takes a while
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32, attn_implementation="sdpa")
    model.eval().requires_grad_(False)
    return LoadedModel(model=model, tokenizer=tokenizer, geometry=head_geometry(model), spec=f"random:{name}",
                       name=name, source={"kind": "random", "config": name, "seed": 0})


def set_attention(lm: LoadedModel, attention: str) -> None:
    """The kernel of ``lm`` and of its bf16 copy (:func:`bf16_model`, made once per model, which copies the kernel set
    when it is made)."""
    lm.model.set_attn_implementation(attention)
    bf16_model(lm).model.set_attn_implementation(attention)


@dataclasses.dataclass
class TaskItems:
    task: TaskSpec
    items: list[Item]
    fewshot: list[Item]


def slice_items() -> dict[str, TaskItems]:
    """The carried slice as items, checked as a run checks its data."""
    rows = json.loads((DATA / "items.json").read_text())

    def items(task: str, docs: list[dict], start: int = 0) -> list[Item]:
        return [Item(f"{task}:{start + i}", doc) for i, doc in enumerate(docs)]

    arithmetic = rows["arithmetic_1dc"]
    out = {"boolq": TaskItems(get_task("boolq"), items("boolq", rows["boolq"]), []),
           "hellaswag": TaskItems(get_task("hellaswag"), items("hellaswag", rows["hellaswag"]), []),
           "arithmetic_1dc": TaskItems(get_task("arithmetic_1dc"),
                                       items("arithmetic_1dc", arithmetic[ARITHMETIC_SHOTS:], ARITHMETIC_SHOTS),
                                       items("arithmetic_1dc", arithmetic[:ARITHMETIC_SHOTS])),
           "mbpp": TaskItems(get_task("mbpp"), items("mbpp", rows["mbpp"]),
                             [Item(str(doc["task_id"]), doc) for doc in sorted(rows["mbpp_prompt"],
                                                                               key=lambda d: d["task_id"])])}
    for name, part in out.items():
        for item in part.items + part.fewshot:
            validate_item(part.task, item, f"{DATA / 'items.json'} ({name})")
    return out


def slice_texts(tasks: dict[str, TaskItems]) -> list[str]:
    """Every prompt and answer text of the slice (what the tokenizer is trained on)."""
    texts = []
    for part in tasks.values():
        for item in part.items + part.fewshot:
            choices, _ = part.task.answers(item.doc)
            texts += [part.task.doc_to_text(item.doc), part.task.doc_to_target(item.doc), *choices]
    return texts


# The fields of a row that its prompt and answers are made of, which synthetic items fill with other words.
TEXT_FIELDS = {"boolq": ("passage", "question"), "hellaswag": ("activity_label", "ctx_a", "ctx_b", "endings")}


def synthetic_items(task: str, docs: list[dict], n: int, seed: int = 0) -> list[Item]:
    """``n`` distinct items shaped like ``docs`` (cycled): each text field keeps its word count, filled with words drawn
    from the same fields of ``docs``; answers and labels stay the row's."""
    fields = TEXT_FIELDS[task]
    texts = [text for doc in docs for field in fields
             for text in (doc[field] if isinstance(doc[field], list) else [doc[field]])]
    words = sorted({word for text in texts for word in text.split()})
    rng = random.Random(seed)

    def fill(text: str) -> str:
        return " ".join(rng.choice(words) for _ in text.split())

    out = []
    for j in range(n):
        doc = dict(docs[j % len(docs)])
        for field in fields:
            doc[field] = [fill(t) for t in doc[field]] if isinstance(doc[field], list) else fill(doc[field])
        out.append(Item(f"{task}-synthetic:{j}", doc))
    return out


# --- Comparisons ------------------------------------------------------------------------------------------

Decoding = tuple[str, Decoded]  # one decoded row: its completion and its tokens and top-2 gaps


def decisions(outcome: Outcome) -> tuple[list, np.ndarray]:
    """Per item, what was decided and how far it was from going otherwise: the chosen answer and the gap between the
    top two answers' scores (choice), or the greedy match and the size of its smallest token margin (greedy)."""
    if outcome.scores is not None:
        top = np.sort(outcome.scores, axis=1)
        return list(outcome.predictions), top[:, -1] - top[:, -2]
    return [bool(c) for c in outcome.correct], np.abs(outcome.margin)


def decision_flips(reference: Sequence[Outcome], candidate: Sequence[Outcome], tie: float) -> tuple[int, int, int]:
    """(pairs decided otherwise, of them outside ``reference``'s ties, pairs that are ties in ``reference``)."""
    differ = outside = ties = 0
    for ref, out in zip(reference, candidate, strict=True):
        if ref.item_ids != out.item_ids:
            raise ValueError("the outcomes compared are of different items")
        ref_decisions, gap = decisions(ref)
        changed = np.array([a != b for a, b in zip(ref_decisions, decisions(out)[0], strict=True)], bool)
        differ += int(changed.sum())
        outside += int((changed & (gap > tie)).sum())
        ties += int((gap <= tie).sum())
    return differ, outside, ties


def compare_outcomes(reference: Sequence[Outcome], candidate: Sequence[Outcome], tol: Tolerance,
                     margins: bool = True) -> dict:
    """Log-likelihood results: the decisions (outside ties) and, unless ``margins`` is False, the margins within
    ``tol``. (Guarded's margins outside its band are bf16's: only its decisions are fp32's.)"""
    differ, outside, ties = decision_flips(reference, candidate, tol.tie)
    worst = max(float(np.max(np.abs(out.margin - ref.margin), initial=0.0)) for ref, out in zip(reference, candidate))
    return {"pairs": sum(len(ref.item_ids) for ref in reference), "ties": ties, "decisions_differ": differ,
            "decisions_differ_outside_ties": outside, "max_margin_diff": worst if margins else None,
            "holds": outside == 0 and (not margins or worst <= tol.margin)}


def compare_decodings(reference: Sequence[Sequence[Decoding]], candidate: Sequence[Sequence[Decoding]],
                      tol: Tolerance) -> dict:
    """Decoded rows: the same tokens, except from a step where the reference's top-2 gap was a tie; the gaps of the
    steps both decoded alike within ``tol``."""
    rows = differ = outside = 0
    worst = 0.0
    for ref_rows, out_rows in zip(reference, candidate, strict=True):
        for (_, ref), (_, out) in zip(ref_rows, out_rows, strict=True):
            rows += 1
            same = 0
            while same < min(len(ref.tokens), len(out.tokens)) and ref.tokens[same] == out.tokens[same]:
                same += 1
            if same:
                worst = max(worst, float(np.max(np.abs(np.subtract(ref.gaps[:same], out.gaps[:same])))))
            if ref.tokens != out.tokens:
                differ += 1
                parted = same < min(len(ref.tokens), len(out.tokens))  # else one stopped where the other went on
                outside += not (parted and ref.gaps[same] <= tol.tie)
    return {"pairs": rows, "decisions_differ": differ, "decisions_differ_outside_ties": outside,
            "max_margin_diff": worst, "holds": outside == 0 and worst <= tol.margin}


def compare_completions(reference: Sequence[Sequence[Decoding]], candidate: Sequence[Sequence[str]],
                        tol: Tolerance) -> dict:
    """Guarded decoding gives completions alone: they must be the reference's, except a row the reference decoded
    through a tie (its smallest gap at most ``tol.tie``)."""
    rows = differ = outside = 0
    for ref_rows, out_rows in zip(reference, candidate, strict=True):
        for (text, decoded), out in zip(ref_rows, out_rows, strict=True):
            rows += 1
            if out != text:
                differ += 1
                outside += decoded.margin > tol.tie
    return {"pairs": rows, "decisions_differ": differ, "decisions_differ_outside_ties": outside,
            "holds": outside == 0}


def compare(reference: list, candidate: list, tol: Tolerance) -> dict:
    if reference and isinstance(reference[0], Outcome):
        return compare_outcomes(reference, candidate, tol)
    return compare_decodings(reference, candidate, tol)


def bf16_tolerance(fp32: list, bf16: list) -> Tolerance:
    """Twice the largest difference bf16's rounding makes to the naive path's numbers on these pairs (margins; decoding
    gaps, and at a step where the decodings part, both gaps): two bf16 computations of one quantity differ by at most
    their two errors. Never below float32's."""
    if fp32 and isinstance(fp32[0], Outcome):
        moved = max(float(np.max(np.abs(a.margin - b.margin), initial=0.0)) for a, b in zip(fp32, bf16, strict=True))
    else:
        moved = max((decoding_error(low, high) for rows_high, rows_low in zip(fp32, bf16, strict=True)
                     for (_, high), (_, low) in zip(rows_high, rows_low, strict=True)), default=0.0)
    return Tolerance(tie=max(FP32.tie, 2 * moved), margin=max(FP32.margin, 2 * moved))


# --- One task on one model --------------------------------------------------------------------------------

def check_interventions(geometry) -> list[tuple[HeadId, ...]]:
    """The full model; single heads in the first, middle and last layers; a pair across layers; a triple."""
    last, mid, top = geometry.n_layers - 1, geometry.n_layers // 2, geometry.n_heads - 1
    return [(), (HeadId(0, 0),), (HeadId(mid, 1),), (HeadId(last, top),), (HeadId(0, 1), HeadId(last, 0)),
            (HeadId(1, 0), HeadId(1, 1), HeadId(mid, 2))]


SURGERY_INTERVENTIONS = (1, 5)  # of check_interventions: a single head and the triple


@contextmanager
def heads_zeroed_in_weights(lm: LoadedModel, heads: Sequence[HeadId]) -> Iterator[None]:
    """:func:`zero_heads_in_weights` for the block; the projections' weights are restored afterwards."""
    projections = attention_output_projections(lm.model)
    saved = {h.layer: projections[h.layer].weight.detach().clone() for h in heads}
    zero_heads_in_weights(lm.model, heads, lm.geometry)
    try:
        yield
    finally:
        with torch.no_grad():
            for layer, weight in saved.items():
                projections[layer].weight.copy_(weight)


class TaskRun:
    """One task's evaluations on one model (a dtype's copy), naive, engine and guarded."""

    def __init__(self, lm: LoadedModel, part: TaskItems, kind: str, scale: Scale):
        self.lm, self.part, self.kind = lm, part, kind
        self.items = part.items[:scale.decode_items if kind == "decoding" else scale.check_items]
        self.kwargs = dict(max_new_tokens=scale.new_tokens, progress=False)
        self.interventions = check_interventions(lm.geometry)

    def engine(self, lm: LoadedModel | None = None, **kwargs) -> EngineEvaluator:
        return EngineEvaluator(lm or self.lm, self.part.task, self.items, self.part.fewshot, **self.kwargs, **kwargs)

    def naive(self, interventions: Sequence[tuple[HeadId, ...]] | None = None) -> list:
        interventions = self.interventions if interventions is None else interventions
        evaluator = NaiveEvaluator(self.lm, self.part.task, self.items, self.part.fewshot, **self.kwargs)
        if self.kind != "decoding":
            return evaluator.evaluate(interventions)
        out = []
        for heads in interventions:  # generate() per head set, as the naive path decodes (without the sandbox)
            texts, decoded = generate(self.lm, evaluator.requests, heads, batch_size=evaluator.batch_size,
                                      max_new_tokens=evaluator.max_new_tokens, gaps=True)
            out.append(list(zip(texts, decoded)))
        return out

    def engined(self) -> list:
        engine = self.engine()
        if self.kind != "decoding":
            return engine.evaluate(self.interventions)
        return stacked_completions(engine, self.interventions, gaps=True)

    def surgery(self) -> tuple[list, list]:
        """The naive path with the hook, and with the heads zeroed in the weights instead."""
        chosen = [self.interventions[i] for i in SURGERY_INTERVENTIONS]
        hooked, cut = self.naive(chosen), []
        for heads in chosen:
            with heads_zeroed_in_weights(self.lm, heads):
                cut += self.naive([()])
        return hooked, cut

    @torch.no_grad()
    def library(self, reference: list[Decoding]) -> list[list[Decoding]]:
        """The full model's greedy decoding by transformers' own ``generate``, one request at a time: a reference
        outside the package for the naive path's decoding (its cache, masks and positions), each row cut at the length
        of ``reference``'s (the naive path stops at MBPP's stop string, which ``generate`` is not told)."""
        requests = NaiveEvaluator(self.lm, self.part.task, self.items, self.part.fewshot, **self.kwargs).requests
        rows = []
        for request, (_, ref) in zip(requests, reference, strict=True):
            ids = torch.tensor([request.context], device=self.lm.device)
            out = self.lm.model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                         max_new_tokens=self.kwargs["max_new_tokens"], output_logits=True,
                                         return_dict_in_generate=True, pad_token_id=self.lm.tokenizer.pad_token_id)
            tokens = out.sequences[0, ids.shape[1]:].tolist()[:len(ref.tokens)]
            top = [at_least_float32(step[0]).topk(2).values for step in out.logits[:len(tokens)]]
            rows.append((self.lm.tokenizer.decode(tokens, skip_special_tokens=True),
                         Decoded(tokens, [float(t[0] - t[1]) for t in top])))
        return [rows]

    def guarded(self) -> tuple[list, Guard]:
        """Guarded decisions (completions) with a first audit of 8 pairs, not all of them, so that the band decides."""
        guard = Guard(audit_pairs=8, seed=0)
        exact, fast = self.engine(), self.engine(above=bf16_model(self.lm))
        if self.kind == "decoding":
            return guarded_completions(exact, fast, guard, self.interventions), guard
        return GuardedEvaluator(exact, fast, guard).evaluate(self.interventions), guard


def attempt(compute) -> dict:
    """``compute()``, or where it raises, a failed result naming the error and where it was raised: one broken check is
    a finding, and the rest of the run (a lent GPU's few minutes) still goes on."""
    try:
        return compute()
    except Exception as error:  # noqa: BLE001 (any error is the finding)
        frame = traceback.extract_tb(error.__traceback__)[-1]
        where = f"{os.path.relpath(frame.filename, REPO)}:{frame.lineno}"
        log(f"  ERROR {type(error).__name__}: {error} (at {where})")
        return {"holds": False, "error": f"{type(error).__name__}: {error}", "raised_at": where}


def check_task(lm: LoadedModel, name: str, part: TaskItems, attention: str, scale: Scale) -> list[dict]:
    """Every check of one task on one model under one attention kernel, float32 then bfloat16."""
    kind = TASKS[name]
    runs = {"float32": TaskRun(lm, part, kind, scale), "bfloat16": TaskRun(bf16_model(lm), part, kind, scale)}
    naive = {dtype: functools.cache(run.naive) for dtype, run in runs.items()}  # each computed once, when first needed
    engine = {dtype: functools.cache(run.engined) for dtype, run in runs.items()}

    def tolerance(dtype: str) -> Tolerance:
        return FP32 if dtype == "float32" else bf16_tolerance(naive["float32"](), naive["bfloat16"]())

    def within(reference: list, candidate: list, tol: Tolerance) -> dict:
        return {**compare(reference, candidate, tol), "tie": tol.tie, "margin_tolerance": tol.margin}

    def library_check(dtype: str) -> dict:
        full_model = naive[dtype]()[:1]  # check_interventions starts with the full model
        return within(full_model, runs[dtype].library(full_model[0]), tolerance(dtype))

    def engine_check(dtype: str) -> dict:
        return within(naive[dtype](), engine[dtype](), tolerance(dtype))

    def surgery_check(dtype: str) -> dict:
        return within(*runs[dtype].surgery(), tolerance(dtype))

    def guarded_check(dtype: str) -> dict:
        found, guard = runs[dtype].guarded()
        check = (compare_completions(engine[dtype](), found, FP32) if kind == "decoding"
                 else compare_outcomes(engine[dtype](), found, FP32, margins=False))
        return {**check, "tie": FP32.tie, "margin_tolerance": None, "rechecked": guard.rechecked,
                "audited": guard.audited, "band": guard.band, "fell_back": guard.fell_back}

    rows = []
    for dtype in runs:
        checks = {"engine == naive": engine_check, "hook == surgery": surgery_check}
        if kind == "decoding":  # the naive path's own decoding loop, against the library's
            checks["naive == transformers"] = library_check
        if dtype == "float32":  # guarded computes from the float32 model
            checks["guarded == fp32"] = guarded_check
        for check, compute in checks.items():
            rows.append({"model": lm.name, "attention": attention, "task": name, "kind": kind, "dtype": dtype,
                         "check": check, **attempt(functools.partial(compute, dtype))})
    return rows


# --- Timings ----------------------------------------------------------------------------------------------

def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def stage1_timing(lm: LoadedModel, name: str, items: list[Item]) -> dict:
    """Stage 1's shape: the full model and every single head on ``items``, fp32, plain bf16 and guarded."""
    task, device = get_task(name), lm.device
    interventions = [()] + [(head,) for head in lm.geometry.all_heads()]
    fast = bf16_model(lm)

    def runs(evaluated: list[Item], guard: Guard) -> dict:
        make = functools.partial(EngineEvaluator, task=task, items=evaluated, progress=False)
        return {"fp32": lambda: make(lm), "bf16": lambda: make(fast),
                "guarded": lambda: GuardedEvaluator(make(lm), make(lm, above=fast), guard)}

    for build in runs(items[:4], Guard(seed=0)).values():  # warm-up: kernels chosen, memory allocated, outside the time
        build().evaluate(interventions[:3])
    guard = Guard(seed=0)
    seconds, outcomes, peak, evaluators = {}, {}, {}, {}
    for precision, build in runs(items, guard).items():
        evaluator = evaluators[precision] = build()
        gc.collect()
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        synchronize(device)
        start = time.perf_counter()
        outcomes[precision] = evaluator.evaluate(interventions)
        synchronize(device)
        seconds[precision] = time.perf_counter() - start
        peak[precision] = torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None
        log(f"  {lm.name} {name}: {precision} {seconds[precision]:.1f} s")
    fp32 = evaluators["fp32"]
    bf16_flips = decision_flips(outcomes["fp32"], outcomes["bf16"], FP32.tie)
    guarded_flips = decision_flips(outcomes["fp32"], outcomes["guarded"], FP32.tie)
    audit = guard.to_json()
    return {"model": lm.name, "task": name, "attention": lm.model.config._attn_implementation,
            "items": len(items), "interventions": len(interventions), "pairs": len(items) * len(interventions),
            "mean_context_tokens": float(np.mean([len(r.context) for r in fp32.requests])),
            "mean_tokens_per_item": fp32.n_tokens / len(items), "token_budget": fp32.token_budget,
            **{f"{p}_s": s for p, s in seconds.items()}, "fp32_over_bf16": seconds["fp32"] / seconds["bf16"],
            "fp32_over_guarded": seconds["fp32"] / seconds["guarded"], **{f"{p}_peak_gib": g for p, g in peak.items()},
            "bf16_flips": bf16_flips[0], "guarded_flips": guarded_flips[0],
            "guarded_flips_outside_ties": guarded_flips[1], "fp32_ties": guarded_flips[2],
            "share_rechecked": audit["share_rechecked"], "band": audit["band"], "depth_bands": audit.get("depth_bands"),
            "largest_error": audit["largest_error"],
            "fell_back": audit["fell_back_to_fp32"], "holds": guarded_flips[1] == 0}


# --- The run ----------------------------------------------------------------------------------------------

def git(*args: str) -> str | None:
    try:
        done = subprocess.run(["git", "-C", str(REPO), *args], capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return done.stdout.strip() if done.returncode == 0 else None


def environment(device: torch.device, tiny: bool) -> dict:
    import tokenizers
    import transformers

    cpu = cpu_info()["model"]
    changes = git("status", "--porcelain", "--untracked-files=no")
    return {"device": str(device), "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else cpu,
            "cpu": cpu, "torch": torch.__version__, "cuda": torch.version.cuda,
            "transformers": transformers.__version__, "tokenizers": tokenizers.__version__,
            "python": platform.python_version(),
            "float32_matmul_precision": torch.get_float32_matmul_precision(), "threads": torch.get_num_threads(),
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "commit": git("rev-parse", "HEAD"), "uncommitted_changes": None if changes is None else bool(changes),
            "tiny": tiny}


def write_json(path: Path, record: dict) -> None:
    """Atomically: a reader (or a run cut off by its time limit) finds the last whole record."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.NamedTemporaryFile("w", dir=path.parent, prefix=path.name + ".", delete=False) as handle:
        json.dump(record, handle, indent=1, allow_nan=True)
        handle.write("\n")
    os.replace(handle.name, path)


def short(value: float) -> str:
    return f"{value:.1e}" if value else "0"


def check_table(checks: list[dict]) -> str:
    """One line per model, kernel, dtype and task: per check, whether it holds, the decisions that differ outside ties
    over the pairs, and the largest margin difference against its tolerance."""
    names = ("engine == naive", "hook == surgery", "guarded == fp32", "naive == transformers")
    lines = [f"{'model':<14} {'attention':<9} {'dtype':<8} {'task':<14} " + " ".join(f"{n:<27}" for n in names)]
    grouped: dict[tuple, dict] = {}
    for row in checks:
        grouped.setdefault((row["model"], row["attention"], row["dtype"], row["task"]), {})[row["check"]] = row
    for key, found in grouped.items():
        cells = []
        for name in names:
            row = found.get(name)
            if row is None or "error" in row:
                cells.append("-" if row is None else "ERROR (in the JSON)")
                continue
            margin = (f" d{short(row['max_margin_diff'])}/{short(row['margin_tolerance'])}"
                      if row.get("max_margin_diff") is not None else "")
            cells.append(f"{'ok' if row['holds'] else 'FAIL'} {row['decisions_differ_outside_ties']}/{row['pairs']}"
                         f"{margin}")
        lines.append(f"{key[0]:<14} {key[1]:<9} {key[2]:<8} {key[3]:<14} " + " ".join(f"{c:<27}" for c in cells))
    return "\n".join(lines)


def timing_table(timings: list[dict]) -> str:
    lines = [f"{'model':<14} {'task':<10} {'items x interventions':>22} {'fp32 s':>8} {'bf16 s':>8} {'guarded s':>9} "
             f"{'fp32/bf16':>9} {'fp32/guarded':>12} {'bf16 flips':>10} {'guarded flips':>13} {'rechecked':>9}"]
    for t in timings:
        if "error" in t:
            lines.append(f"{t['model']:<14} {t['task']:<10} ERROR {t['error']}")
            continue
        share = "-" if t["share_rechecked"] is None else f"{t['share_rechecked']:.0%}"
        lines.append(f"{t['model']:<14} {t['task']:<10} {t['items']:>11} x {t['interventions']:<8} {t['fp32_s']:>8.1f} "
                     f"{t['bf16_s']:>8.1f} {t['guarded_s']:>9.1f} {t['fp32_over_bf16']:>9.2f} "
                     f"{t['fp32_over_guarded']:>12.2f} {t['bf16_flips']:>10} {t['guarded_flips']:>13} {share:>9}")
    return "\n".join(lines)


def cache_keyword_missing(forward) -> bool:
    """Whether a model's ``forward`` takes no ``cache`` argument: transformers before the rename of ``past_key_values``
    (5.17, the GPU machine's own, is one) drops the ``cache=`` cel_utils passes, silently, and decodes without it."""
    import inspect

    return "cache" not in inspect.signature(forward).parameters


def output_path(out: str | None) -> Path:
    if out:
        return Path(out)
    if os.environ.get("OUT"):
        return Path(os.environ["OUT"]) / "gpu_check.json"
    raise SystemExit("gpu_check: nowhere to write the results: pass --out PATH, or set $OUT (the device tool sets it)")


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda", help="cuda (default), cuda:<index> or cpu")
    parser.add_argument("--tiny", action="store_true",
                        help="tiny models of the same families and few items (the CPU test: well under a minute)")
    parser.add_argument("--out", help="the results' JSON (default: $OUT/gpu_check.json)")
    parser.add_argument("--models", nargs="+", choices=sorted(MODELS), default=list(MODELS),
                        help="the models checked (default: all)")
    parser.add_argument("--timing-models", nargs="*", choices=sorted(MODELS),
                        help="the models timed, among --models (default: the book models among them; none: no timings)")
    parser.add_argument("--timing-items", type=int,
                        help=f"items per timed task (default {FULL.timing_items}; --tiny: {TINY.timing_items})")
    args = parser.parse_args(argv)
    if args.timing_models is None:
        args.timing_models = [name for name in BOOK_MODELS if name in args.models]
    if missing := sorted(set(args.timing_models) - set(args.models)):
        parser.error(f"--timing-models {' '.join(missing)} not among --models: add them to --models or drop them")
    if args.timing_items is not None and args.timing_items < 1:
        parser.error(f"--timing-items {args.timing_items}: time at least one item")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    out = output_path(args.out)
    import transformers

    if cache_keyword_missing(transformers.LlamaModel.forward):
        raise SystemExit(f"gpu_check: transformers {transformers.__version__} takes a model's KV cache as "
                         "past_key_values, not as the cache= cel_utils passes (dropped silently: shared prefixes fail "
                         "and decoding runs without its cache). Carry transformers 5.25.0 and the packages it needs as "
                         "wheels, as this script's docstring says.")
    device = resolve_device(args.device)  # a clear error where it does not exist, before anything is written
    scale = TINY if args.tiny else FULL
    if args.timing_items is not None:
        scale = dataclasses.replace(scale, timing_items=args.timing_items)
    tasks = slice_items()
    vocab = max(model_fields(name, args.tiny)["vocab_size"] for name in args.models)
    tokenizer = build_tokenizer(slice_texts(tasks), vocab)
    rows = json.loads((DATA / "items.json").read_text())
    timed = {name: synthetic_items(name, rows[name], scale.timing_items) for name in TIMED_TASKS}
    record = {"script": "scripts/gpu_check.py", "finished": False, "holds": None,
              "environment": environment(device, args.tiny), "scale": dataclasses.asdict(scale),
              "tokenizer": {"trained_vocab": tokenizer.trained_vocab, "vocab": len(tokenizer)},
              "tolerances": {"float32": dataclasses.asdict(FP32),
                             "bfloat16": "twice the naive path's largest bf16-vs-fp32 difference on the same pairs"},
              "models": {}, "checks": [], "timings": []}
    log(f"{record['environment']['device_name']}, torch {torch.__version__}; tokenizer {tokenizer.trained_vocab} "
        f"trained tokens of {len(tokenizer)}; models {', '.join(args.models)}")
    for name in args.models:
        fields = model_fields(name, args.tiny)
        start = time.perf_counter()
        lm = build_model(name, fields, tokenizer, device)
        synchronize(device)
        record["models"][name] = {"config": fields, "parameters": sum(p.numel() for p in lm.model.parameters()),
                                  "heads": lm.geometry.n_total, "build_s": time.perf_counter() - start}
        log(f"{name}: {record['models'][name]['parameters'] / 1e6:.0f}M parameters, {lm.geometry.n_total} heads")
        for attention in ATTENTIONS:
            set_attention(lm, attention)
            for task, part in tasks.items():
                found = check_task(lm, task, part, attention, scale)
                record["checks"] += found
                failed = sum(not row["holds"] for row in found)
                log(f"  {name} {attention} {task}: {len(found) - failed} of {len(found)} checks hold")
        set_attention(lm, "sdpa")
        if name in args.timing_models:
            for task in TIMED_TASKS:
                record["timings"].append({"model": name, "task": task,
                                          **attempt(functools.partial(stage1_timing, lm, task, timed[task]))})
        write_json(out, record)
        del lm
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
    failures = [row for row in record["checks"] + record["timings"] if not row["holds"]]
    record.update(finished=True, holds=not failures)
    write_json(out, record)
    print(check_table(record["checks"]))
    if record["timings"]:
        print(timing_table(record["timings"]))
    env = record["environment"]
    print(f"{env['device_name']}; torch {env['torch']}, transformers {env['transformers']}; {env['date']}; "
          f"commit {env['commit']}{' (with uncommitted changes)' if env['uncommitted_changes'] else ''}")
    print(f"{'every check holds' if not failures else f'{len(failures)} checks FAIL'}; results in {out}")
    return 0 if not failures else 1


if __name__ == "__main__":
    sys.exit(main())
