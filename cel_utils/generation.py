"""Greedy generation under an ablation (MBPP), and pass@1 by running the code in the sandbox.

Generation uses the model's own incremental decoding (KV cache) with left padding, an attention mask and
position ids counted from each row's first real token, so a row decodes the same at any batch size up to
float rounding. Each row stops at its stop string (``[DONE]`` in the plain format, the closing code fence in
the chat format) or at end of sequence; the batch ends when every row has stopped. A different head set
per row (``row_masks``) lets the engine decode many interventions in one batch.
"""
from __future__ import annotations

from contextlib import nullcontext
from typing import Iterable

import numpy as np
import torch

from cel_utils.ablation import ablated, ablated_rows
from cel_utils.heads import HeadId
from cel_utils.models import LoadedModel
from cel_utils.prompts import GenRequest
from cel_utils.scoring import Outcome


def _stop_ids(lm: LoadedModel) -> list[int]:
    ids = {lm.tokenizer.eos_token_id}
    configured = getattr(lm.model.generation_config, "eos_token_id", None)
    ids.update(configured if isinstance(configured, list) else [configured])
    return sorted(i for i in ids if i is not None)


def cut_completion(text: str, stop: str | None) -> str:
    """The answer: generated text up to (not including) the stop string."""
    return text.split(stop, 1)[0] if stop else text


@torch.no_grad()
def generate(lm: LoadedModel, requests: list[GenRequest], heads: Iterable[HeadId] = (), *,
             row_masks: torch.Tensor | None = None, batch_size: int = 8, max_new_tokens: int = 256) -> list[str]:
    """Greedy completions (stop string removed), in request order.

    ``row_masks`` (bool [len(requests), layers, heads]) gives each request its own ablation; otherwise
    ``heads`` applies to all.
    """
    tokenizer, pad = lm.tokenizer, lm.tokenizer.pad_token_id
    order = sorted(range(len(requests)), key=lambda i: -len(requests[i].context))  # similar lengths share a batch
    completions: list[str | None] = [None] * len(requests)
    stops = sorted({r.stop for r in requests if r.stop})
    for start in range(0, len(order), batch_size):
        batch = order[start:start + batch_size]
        width = max(len(requests[i].context) for i in batch)
        ids = torch.full((len(batch), width), pad, dtype=torch.long)
        mask = torch.zeros((len(batch), width), dtype=torch.long)
        for row, i in enumerate(batch):
            context = requests[i].context
            ids[row, width - len(context):] = torch.tensor(context)
            mask[row, width - len(context):] = 1
        if row_masks is not None:
            context = ablated_rows(lm.model, row_masks[batch], lm.geometry)
        else:
            context = ablated(lm.model, heads, lm.geometry) if heads else nullcontext()
        with context:
            out = lm.model.generate(
                input_ids=ids.to(lm.device), attention_mask=mask.to(lm.device), max_new_tokens=max_new_tokens,
                do_sample=False, temperature=None, top_p=None, top_k=None, num_beams=1,
                eos_token_id=_stop_ids(lm), pad_token_id=pad, stop_strings=stops or None, tokenizer=tokenizer)
        for row, i in enumerate(batch):
            text = tokenizer.decode(out[row, width:], skip_special_tokens=True)
            completions[i] = cut_completion(text, requests[i].stop)
    return completions


def score_generations(requests: list[GenRequest], completions: list[str], *, timeout_s: float = 10.0,
                      workers: int = 2) -> Outcome:
    """pass@1: run each completion with its item's tests in the sandbox."""
    from cel_utils.sandbox import check_mbpp

    from concurrent.futures import ThreadPoolExecutor

    def run(pair):
        request, completion = pair
        return check_mbpp(completion, request.tests, request.setup, timeout_s=timeout_s)

    # Threads only wait on sandboxed child processes here, so two threads keep two cores busy.
    with ThreadPoolExecutor(max_workers=workers) as pool:
        results = list(pool.map(run, zip(requests, completions)))
    correct = np.array([r.passed for r in results], dtype=bool)
    return Outcome(item_ids=[r.item_id for r in requests], correct=correct,
                   margin=np.where(correct, 1.0, -1.0), metrics={"pass@1": correct},
                   predictions=[{"completion": c, "status": r.status} for c, r in zip(completions, results)])
