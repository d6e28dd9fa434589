"""The guarded precision for generation (MBPP): decode in bf16, decode again in fp32 the rows that came close to a tie.

A greedy decoding is a chain of decisions, one argmax per step, and pass@1 reads only the completion they spell. A row's
*decoding margin* is the smallest gap between its top two logits over the steps it decoded
(:class:`~cel_utils.evaluation.generation.Decoded`). If at every step bf16's gap is larger than bf16's error on it,
each step picks fp32's token from the same prefix, so by induction the whole completion is fp32's.
:func:`guarded_completions` decodes every (item, intervention) row in bf16 and decodes again in fp32 the rows whose bf16
margin lies inside the guard band, as :mod:`cel_utils.evaluation.guarded` does for log-likelihood decisions, with the
same evidence (:class:`~cel_utils.evaluation.guarded.Guard`): before bf16 is trusted a random sample of rows is decoded
in both precisions, the band is ``multiple`` times the largest error seen (one band for the task: the error scale is 1),
every later call audits a small random share of the rows outside the band, a larger error widens the band (and
rechecks what it takes in), and an audited row outside the band that decodes to another completion in fp32 makes the
run fall back to fp32.

The rows are decoded in bf16 whole: the log-likelihood fast pass's fp32 clean pass below the ablated layers
(:class:`~cel_utils.evaluation.engine.EngineEvaluator` with ``above``) has no counterpart in decoding, where each row
carries its own head mask through every step, so the full model's rows are bf16's too, audited and rechecked like
the rest.

The error of a row (:func:`decoding_error`) is measured over the steps where both precisions decoded the same prefix:
per step, the margin of bf16's chosen token over the best other token, under each precision (fp32's gap where fp32
chose the same token; where it chose another, at most minus fp32's gap); the largest difference. On the steps where the
tokens agree that is the difference of the two gaps; at the first step where they differ it is at least the sum of the
two gaps, so at least the row's own bf16 margin: with a multiple of 1 or more, a row seen to differ widens the band
over itself and is rechecked, and only a row never computed in fp32 can be decided wrongly.

What is exact and what is not. A guarded completion is fp32's, up to fp32's own float rounding: a rechecked row is
decoded in fp32 stacked with other rechecked rows (each its own head mask), not in the batch the engine's fp32 path
would have put it in, and the two agree to float rounding, not to the bit; a row whose fp32 top-2 gap is within that
rounding can decode otherwise in either (the engine's batch sizes share that caveat). The rows outside the band keep
bf16's completions on the evidence of the audit, a sample: the band is an empirical bound times a stated multiple, not a
proof, which is why the audit goes on in every call. After a fall-back the call returns fp32's decoding in the engine's
own stacking (bit for bit what :class:`~cel_utils.evaluation.engine.EngineEvaluator` decodes), and
:class:`~cel_utils.evaluation.guarded.GuardedEvaluator` routes later calls to fp32.

What it costs. On MBPP the band takes in nearly every row: a row's margin is its smallest gap over tens of steps, and
bf16's error on a gap is large. Measured on the default model (cpu preset: 3-shot, 96 new tokens; 8 discovery items x
the full model and 8 single heads, 2 cores with bf16 units): plain bf16 decoded 23 of the 72 completions otherwise than
fp32; the largest error seen was 0.43 (bf16's logits themselves are rounded to 1/8 at MBPP's logit sizes, and the row
margins' median was 0.125), so the band (0.86) took in all 72 rows, and the guarded decoding, fp32's completions, took
1.2x fp32's time (bf16 alone 0.63x). Unembedding bf16's hidden states in fp32 does not rescue it: on 9 rows the errors
were still 0.08-0.29 (the body's rounding), against margins of 0.005-0.26.

The store is not used on this path: bf16 completions are never written or read (their store context would be bf16's
anyway), nor are the rechecked rows (stacked otherwise than the full product), so a resumed guarded MBPP run decodes
again what it had decoded. After a fall-back the fp32 path reads and writes the store as usual.

The rows are stacked as :meth:`EngineEvaluator._evaluate_generation` stacks them
(:meth:`~cel_utils.evaluation.engine.EngineEvaluator.decoding_rows`); unlike it, an out-of-memory error is not retried
with half the budget.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Sequence

import numpy as np
import torch

from cel_utils.evaluation.evaluator import Intervention
from cel_utils.evaluation.generation import Decoded, generate
from cel_utils.evaluation.guard import Guard
from cel_utils.models.ablation import head_mask
from cel_utils.models.heads import format_heads

if TYPE_CHECKING:
    from cel_utils.evaluation.engine import EngineEvaluator


def stacked_completions(evaluator: EngineEvaluator, interventions: Sequence[Intervention], desc: str | None = None,
                        *, gaps: bool = False) -> list[list]:
    """Per intervention, per request: the completion (with ``gaps``, a pair ``(completion, Decoded)``), the
    interventions stacked as rows exactly as the engine stacks them (its chunks, its calls of :func:`generate`),
    without the store."""
    out: list[list] = []
    progress = evaluator.progress_bar(len(interventions), desc)
    for chunk in evaluator.decoding_chunks(interventions):
        out += evaluator.decode_chunk(chunk, gaps=gaps)
        progress.update(len(chunk))
    progress.close()
    return out


def pair_completions(evaluator: EngineEvaluator, pairs: Sequence[tuple[int, Intervention]]
                     ) -> list[tuple[str, Decoded]]:
    """Scattered (request index, intervention) pairs decoded as rows of :func:`generate`, each row its own head mask:
    per pair, its completion and its :class:`Decoded`."""
    if not pairs:
        return []
    geometry = evaluator.lm.geometry
    row_masks = torch.stack([head_mask(heads, geometry) for _, heads in pairs])
    completions, decoded = generate(evaluator.lm, [evaluator.requests[i] for i, _ in pairs], row_masks=row_masks,
                                    batch_size=evaluator.decoding_rows(), max_new_tokens=evaluator.max_new_tokens,
                                    token_budget=4 * evaluator.token_budget, gaps=True)
    return list(zip(completions, decoded))


def decoding_error(low: Decoded, high: Decoded) -> float:
    """How far the lower precision's decision margins moved from the higher one's (see the module docstring): over the
    steps both decoded from the same prefix, the largest change of the margin of ``low``'s chosen token."""
    error = 0.0
    for token_low, token_high, gap_low, gap_high in zip(low.tokens, high.tokens, low.gaps, high.gaps):
        if token_low != token_high:  # fp32's margin of bf16's token is at most -gap_high; the prefixes part here
            return max(error, gap_low + gap_high)
        error = max(error, abs(gap_low - gap_high))
    return error


def guarded_completions(exact: EngineEvaluator, fast: EngineEvaluator, guard: Guard,
                        interventions: Sequence[Intervention], desc: str | None = None) -> list[list[str]]:
    """Per intervention, the completion of every request, as fp32 decodes them (see the module docstring).

    ``exact`` is an engine evaluator on the fp32 model; ``fast`` one of the same generation task and items that decodes
    with the bf16 copy (its ``above`` model, which is its ``lm`` unless given, as the engine decodes), stacked as
    ``fast`` stacks; ``guard`` holds the run's evidence and counts what was decided how."""
    if exact.kind.loglikelihood or exact.kind.name != fast.kind.name:
        raise ValueError("guarded completions need two evaluators of the same generation task")
    interventions = list(interventions)
    requests, n = exact.requests, len(exact.requests)
    if guard.fell_back:
        guard.fp32_pairs += len(interventions) * n
        return stacked_completions(exact, interventions, desc)
    low = stacked_completions(fast, interventions, desc, gaps=True)
    margins = np.array([[low[u][i][1].margin for i in range(n)] for u in range(len(interventions))]).reshape(-1, n)
    high: dict[tuple[int, int], tuple[str, Decoded]] = {}

    def recheck(pairs: list[tuple[int, int]]) -> list[float]:
        for pair, value in zip(pairs, pair_completions(exact, [(i, interventions[u]) for u, i in pairs])):
            high[pair] = value
        return [decoding_error(low[u][i][1], high[u, i][1]) for u, i in pairs]

    differing = guard.check(margins, recheck, lambda pair: low[pair[0]][pair[1]][0] != high[pair][0])
    if differing:
        u, i = differing[0]
        guard.fall_back(f"{exact.task.name}: an audited bf16 decision (a greedy completion) differed from fp32's "
                        f"outside the band (item {requests[i].item_id}, {format_heads(interventions[u])}, bf16 margin "
                        f"{margins[u, i]:.4g}, band {guard.band:.4g})", margins.size)
        return stacked_completions(exact, interventions, desc)
    return [[high[u, i][0] if (u, i) in high else low[u][i][0] for i in range(n)] for u in range(len(interventions))]
