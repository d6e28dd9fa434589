"""Greedy generation under an ablation (MBPP), and pass@1 by running the code in the sandbox.

Greedy decoding with a KV cache, left padding, an attention mask and position ids counted from each row's first
real token (the inputs ``model.generate`` builds), so a row decodes the same at any batch size up to float rounding.
Each row stops at its stop string (``[DONE]`` in the plain format, the closing code fence in the chat format) or at
end of sequence, and then leaves the batch (:func:`_greedy`); batches group prompts of similar length
(:data:`MAX_PROMPT_PADDING`). A different head set per row (``row_masks``) lets the engine decode many interventions
in one batch.

Few-shot prompts share a long token prefix (MBPP's three exemplars are ~600 of ~700 prompt tokens). The
prefix's keys and values are computed once per distinct head set in a batch, from that set's lowest ablated
layer on (below it they are the full model's), and copied to its rows of a preallocated cache; each row
then continues with its own tokens (padding sits between the prefix and the row's tokens, masked out, and
positions continue from the prefix). Causal attention makes that the same computation as feeding each
row's whole prompt.

With ``gaps=True``, :func:`generate` also reports each row's decoding (:class:`Decoded`): its tokens and, per step, the
gap between the top two logits, whose smallest is the row's *decoding margin*. The guarded precision
(:mod:`cel_utils.evaluation.guarded_generation`) rechecks in fp32 the rows whose bf16 margin is small, and compares two
precisions' gaps step by step to measure bf16's error.
"""
from __future__ import annotations

import dataclasses
from contextlib import ExitStack, nullcontext
from typing import Iterable

import numpy as np
import torch

from cel_utils.evaluation.batching import length_batches
from cel_utils.evaluation.prefix import (MIN_SHARED_PREFIX, CleanPrefix, clean_prefix, prefix_states,
                                        shared_prefix_length, sliding_window)
from cel_utils.models.ablation import ablated, ablated_rows
from cel_utils.models.heads import HeadId
from cel_utils.models.loading import LoadedModel
from cel_utils.tasks.prompts import GenRequest
from cel_utils.tasks.scoring import Outcome, at_least_float32


# A prompt is padded to at most twice its own length (after the shared prefix), so that one long prompt does not widen
# a whole batch of short ones: MBPP's holdout has one of 863 tokens, its median is 97.
MAX_PROMPT_PADDING = 0.5


def _stop_ids(lm: LoadedModel) -> list[int]:
    ids = {lm.tokenizer.eos_token_id}
    configured = getattr(lm.model.generation_config, "eos_token_id", None)
    ids.update(configured if isinstance(configured, list) else [configured])
    return sorted(i for i in ids if i is not None)


def _ablation(lm: LoadedModel, heads, masks: torch.Tensor | None):
    if masks is not None:
        return ablated_rows(lm.model, masks, lm.geometry)
    return ablated(lm.model, heads, lm.geometry) if heads else nullcontext()


def _decoding_cache(lm: LoadedModel, n_rows: int, max_len: int, states=None):
    """A preallocated KV cache for ``n_rows`` rows of ``max_len`` tokens, holding a shared prefix if given.

    Preallocated because a growing cache concatenates every layer's keys and values at every step: with 64
    rows of ~800 tokens that copying took a third of MBPP's decoding time on 2 CPU cores.
    """
    from transformers import StaticCache

    cache = StaticCache(config=lm.model.config, max_cache_len=max_len)
    if not states:
        return cache
    for i, layer in enumerate(cache.layers):
        keys, values = states[0][i]
        layer.lazy_initialization(keys.expand(n_rows, -1, -1, -1), values.expand(n_rows, -1, -1, -1))
        n = keys.shape[-2]
        for row, row_states in enumerate(states):
            layer.keys[row, :, :n], layer.values[row, :, :n] = row_states[i]
        layer.cumulative_length.fill_(n)
        if hasattr(layer, "cumulative_length_int"):  # sliding-window layers (the prefix fits in the window)
            layer.cumulative_length_int = n
    return cache


@dataclasses.dataclass
class Decoded:
    """One row's greedy decoding: the answer tokens (through the stop) and, per step, the gap between the top two logits
    (as :func:`~cel_utils.tasks.scoring.at_least_float32` gives them) at the step that chose each token."""

    tokens: list[int]
    gaps: list[float]

    @property
    def margin(self) -> float:
        """The smallest gap over the steps the row decoded: how close its decoding came to choosing another token."""
        return min(self.gaps, default=float("inf"))


def cut_completion(text: str, stop: str | None) -> str:
    """The answer: generated text up to (not including) the stop string."""
    return text.split(stop, 1)[0] if stop else text


@torch.no_grad()
def generate(lm: LoadedModel, requests: list[GenRequest], heads: Iterable[HeadId] = (), *,
             row_masks: torch.Tensor | None = None, batch_size: int = 8, max_new_tokens: int = 256,
             token_budget: int | None = None, gaps: bool = False) -> list[str] | tuple[list[str], list[Decoded]]:
    """Greedy completions (stop string removed), in request order; with ``gaps``, also each request's
    :class:`Decoded` (the same completions, and one top-2 gap per step: no other work).

    ``row_masks`` (bool [len(requests), layers, heads]) gives each request its own ablation; otherwise
    ``heads`` applies to all. A batch holds at most ``batch_size`` rows and, with ``token_budget``, at most that
    many tokens of the rows' own context and answer (padded to the batch's longest); see :data:`MAX_PROMPT_PADDING`.
    """
    tokenizer, pad = lm.tokenizer, lm.tokenizer.pad_token_id
    order = sorted(range(len(requests)), key=lambda i: -len(requests[i].context))  # similar lengths share a batch
    common = shared_prefix_length([r.context for r in requests]) if len(requests) > 1 else 0
    own = [len(requests[i].context) - common for i in order]
    completions: list[str | None] = [None] * len(requests)
    decoded: list[Decoded | None] = [None] * len(requests)
    stops = sorted({r.stop for r in requests if r.stop})
    window = sliding_window(lm)
    clean: dict[tuple[int, ...], CleanPrefix] = {}  # the full model's pass over each batch's prefix, made once per call
    for start, stop in length_batches(own, batch_size, token_budget, MAX_PROMPT_PADDING, max_new_tokens):
        batch = order[start:stop]
        contexts = [requests[i].context for i in batch]
        masks = None if row_masks is None else row_masks[batch]
        n_prefix = shared_prefix_length(contexts)
        if n_prefix < MIN_SHARED_PREFIX or (window and max(map(len, contexts)) + max_new_tokens > window):
            n_prefix = 0
        width = n_prefix + max(len(c) - n_prefix for c in contexts)
        ids = torch.full((len(batch), width), pad, dtype=torch.long)
        mask = torch.zeros((len(batch), width), dtype=torch.long)
        for row, context in enumerate(contexts):
            ids[row, :n_prefix] = torch.tensor(context[:n_prefix])
            mask[row, :n_prefix] = 1
            ids[row, width - (len(context) - n_prefix):] = torch.tensor(context[n_prefix:])
            mask[row, width - (len(context) - n_prefix):] = 1
        states = None
        if n_prefix:
            prefix = tuple(contexts[0][:n_prefix])
            if prefix not in clean:
                clean[prefix] = clean_prefix(lm, prefix)
            states = prefix_states(lm, prefix, heads, masks, len(batch), clean[prefix])
        cache = _decoding_cache(lm, len(batch), width + max_new_tokens, states)
        step_gaps = [[] for _ in batch] if gaps else None
        answers = _greedy(lm, ids[:, n_prefix:], mask, cache, heads, masks, max_new_tokens=max_new_tokens,
                          stop_ids=set(_stop_ids(lm)), stops=stops, gaps=step_gaps)
        for row, i in enumerate(batch):
            completions[i] = cut_completion(tokenizer.decode(answers[row], skip_special_tokens=True), requests[i].stop)
            if gaps:
                decoded[i] = Decoded(answers[row], step_gaps[row])
    return (completions, decoded) if gaps else completions


def _greedy(lm: LoadedModel, ids: torch.Tensor, mask: torch.Tensor, cache, heads, masks: torch.Tensor | None, *,
            max_new_tokens: int, stop_ids: set[int], stops: list[str], gaps: list[list[float]] | None = None
            ) -> list[list[int]]:
    """Each row's greedy answer tokens (through its stop token or string), decoding ``ids`` (the rows' tokens after
    the prefix held in ``cache``; ``mask`` covers prefix and rows) one token per step. Given ``gaps`` (one empty list
    per row), each step appends to a decoding row's list the gap between its top two logits.

    A row that has stopped leaves the batch: once an eighth of the rows have stopped, the cache and the masks keep
    only the rows still decoding (``Cache.reorder_cache``, as beam search uses), so a step's cost follows the rows still
    decoding, not the longest answer times all rows (MBPP's median answer is a third of its token budget). Inputs
    are what ``model.generate`` passes: position ids counted from each row's first real token, an attention mask
    growing by one per step.
    """
    device, pad = lm.device, lm.tokenizer.pad_token_id
    decode = lm.tokenizer.decode
    positions = (mask.cumsum(-1) - 1).masked_fill(mask == 0, 0)[:, -ids.shape[1]:]
    mask = mask.to(device)
    answers: list[list[int]] = [[] for _ in range(len(ids))]
    slots = list(range(len(ids)))  # the request row held by each cache row
    running = [True] * len(ids)  # per cache row: still decoding
    with ExitStack() as scope:
        scope.enter_context(_ablation(lm, heads, masks))
        for step in range(max_new_tokens):
            logits = lm.model(input_ids=ids.to(device), attention_mask=mask, position_ids=positions.to(device),
                              cache=cache, use_cache=True, logits_to_keep=1).logits[:, -1]
            scores = at_least_float32(logits)
            tokens = scores.argmax(-1).tolist()
            if gaps is not None:
                top = scores.topk(2, dim=-1).values
                gap = (top[:, 0] - top[:, 1]).tolist()
            for slot, (row, token) in enumerate(zip(slots, tokens)):
                if running[slot]:
                    answers[row].append(token)
                    if gaps is not None:
                        gaps[row].append(gap[slot])
                    running[slot] = token not in stop_ids and not any(s in decode(answers[row]) for s in stops)
            if not any(running) or step == max_new_tokens - 1:
                break
            # compacting copies the cache of every row kept, so it waits for an eighth of the rows to stop
            if running.count(False) >= max(1, len(running) // 8):
                keep = [slot for slot, r in enumerate(running) if r]
                index = torch.tensor(keep, device=device)
                cache.reorder_cache(index)
                mask, positions = mask[index], positions[keep]
                tokens, slots, running = [tokens[s] for s in keep], [slots[s] for s in keep], [True] * len(keep)
                scope.close()
                scope.enter_context(_ablation(lm, heads, None if masks is None else masks[slots]))
            ids = torch.tensor([[t if r else pad] for t, r in zip(tokens, running)])
            positions = positions[:, -1:] + 1
            mask = torch.cat([mask, mask.new_ones((len(mask), 1))], dim=-1)
    return answers


def score_generations(task, requests: list[GenRequest], completions: list[str], *, timeout_s: float, memory_mb: int,
                      workers: int = 2) -> Outcome:
    """pass@1: run each completion with its item's tests in the sandbox, under the run's limits (the settings
    exec_timeout_s and exec_memory_mb, which the sandbox's cache keys its verdicts by)."""
    from concurrent.futures import ThreadPoolExecutor

    from cel_utils.sandbox import check_mbpp

    def run(pair):
        request, completion = pair
        return check_mbpp(completion, request.tests, request.setup, timeout_s=timeout_s, memory_mb=memory_mb)

    # Threads only wait on sandboxed child processes here, so two threads keep two cores busy.
    with ThreadPoolExecutor(max_workers=workers) as pool:
        results = list(pool.map(run, zip(requests, completions)))
    correct = np.array([r.passed for r in results], dtype=bool)
    return Outcome(item_ids=[r.item_id for r in requests], correct=correct,
                   margin=np.where(correct, 1.0, -1.0), metrics={"pass@1": correct},
                   predictions=[{"completion": c, "status": r.status} for c, r in zip(completions, results)])
