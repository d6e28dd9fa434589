"""bfloat16 at float32's word: compute in bf16, recompute in fp32 exactly the decisions bf16 could have got wrong.

A decision can only flip where its margin is smaller than the rounding error. The guarded precision evaluates every
(item, intervention) pair in a *fast pass* and recomputes in fp32 the pairs whose fast *decision margin* lies inside a
guard band that bounds the fast pass's error on that margin. The fast pass
(:class:`~cel_utils.evaluation.engine.EngineEvaluator` with ``above``, the engine's one seam for another precision)
computes in bf16 only what costs: the clean pass, the residual states kept below each ablated layer and the unembedding
are fp32's, and the stacked ablated layers run on a bf16 copy of the model
(:func:`~cel_utils.evaluation.precision.bf16_model`) from those states. So the full model's decisions are fp32's own,
never rechecked, and the error is that of the ablated layers alone: on the default model (32 BoolQ items x 30 heads,
24 HellaSwag items x 40 heads) the largest margin error fell from 0.27 to 0.19 (BoolQ) and 0.025 to 0.015 (HellaSwag)
against a whole-model bf16 copy, and the share of pairs inside a 2x band from 23% to 20% and 44% to 30%. The margins
(each kind's :class:`~cel_utils.evaluation.kinds.ItemDecision`):

* multiple choice and BoolQ: the gap between the chosen answer's score and the runner-up's under the primary metric
  (HellaSwag's ``acc_norm``, BoolQ's ``acc``); its error is bounded by the spread of the answers' score errors (the
  largest minus the smallest, so a shift shared by all answers, such as the softmax normaliser, costs nothing);
* arithmetic (teacher-forced greedy match): the smallest per-token margin of the target (target logit minus the best
  other), whose sign is the decision; its error is the difference of the two precisions' smallest margins.

The rechecks cost what a pair of fp32's stacked product costs: the fast pass hands the guard each batch's pairs while
it still holds the batch's fp32 clean pass (``after_batch``), and the pairs to recompute run from its kept states,
stacked as rows by starting layer (:func:`batch_pair_stats`); only pairs that a band widened by a later batch takes in
are recomputed after the pass, each batch's from the states the fast pass kept for later calls (the run's kept clean
passes, :mod:`cel_utils.evaluation.clean_passes`), or after a clean pass of its own where none are kept
(:func:`pair_stats`). Before, every recheck ran after the whole pass, and a rechecked pair cost 1.2-1.8x a stacked
one (book/speed.md).

The bands come from evidence (:class:`Guard`): before bf16 is trusted, a random sample of pairs is computed in both
precisions, and a pair's band is ``multiple`` times the largest error seen among pairs whose intervention starts in
the same third of the layers (the fast pass computes the layers from the first ablated one up in bf16; see
:class:`Guard` for what that narrowed and the predictors that did not). Every later call
audits a small random share of the pairs outside the band in both precisions too; any error larger than seen before
widens its band for the rest of the run (and rechecks what the wider band takes in), and an audited decision that
differs between the precisions, outside the band, means the evidence was wrong: that call and every later one are
computed in fp32 (the run *falls back*) and the artifact says so.

What is exact and what is not. A guarded decision under the primary metric (``correct``, the chosen answer) equals
fp32's (up to fp32's own float ties, which the fast engine and the naive path share). The numbers beside the decisions
are not fp32's: a pair outside the band keeps bf16's margin and scores, and its secondary metric (HellaSwag's ``acc``,
reported beside ``acc_norm``) is bf16's, approximate. The search reads decisions alone, so a run computes only its
search guarded and every evaluation of holdout items in fp32 (:func:`cel_utils.pipeline.protocol.holdout_config`): its
artifact, and every number its pages print, are fp32's (tests/test_printed_numbers.py). The store keeps the fast pass's statistics under a context of
their own (its key names the bf16 dtype of the ablated layers) and fp32's under fp32's, so neither is ever served as
the other; guarded outcomes themselves are composed anew from those each call, and the rechecked pairs (stacked
otherwise than the full product) are not stored. Generation (MBPP) is guarded by
:mod:`cel_utils.evaluation.guarded_generation`, with the same :class:`Guard`.
"""
from __future__ import annotations

from typing import Iterable, Sequence

import torch

from cel_utils.evaluation.engine import PREFIX_CACHE_BYTES, BatchPass, EngineEvaluator
from cel_utils.evaluation.evaluator import EvaluatorProtocol, Intervention
from cel_utils.evaluation.guard import Guard, Pair, depth_group
from cel_utils.evaluation.guarded_generation import guarded_completions
from cel_utils.evaluation.outcomes import Wrapper
from cel_utils.evaluation.prefix import clean_prefix, prefix_states
from cel_utils.models.ablation import ablated_rows, head_mask
from cel_utils.models.heads import HeadId, format_heads
from cel_utils.models.plumbing import attention_with_mask, base_model, start_at_layer
from cel_utils.tasks.scoring import ContinuationStats, Outcome


class GuardedEvaluator(Wrapper):
    """An evaluator whose decisions are fp32's, computed mostly in bf16 (see the module docstring).

    ``exact`` is an :class:`~cel_utils.evaluation.engine.EngineEvaluator` on the fp32 model, ``fast`` its fast pass (the
    same on the fp32 model with ``above=bf16_model(lm)``; any engine evaluator of the same items will do, e.g. one on
    the bf16 copy alone). What it evaluates (``lm``, ``task``, ``items``, ``requests``...) is ``exact``'s."""

    def __init__(self, exact: EngineEvaluator, fast: EngineEvaluator, guard: Guard):
        if exact.kind.name != fast.kind.name:
            raise ValueError("the guarded evaluator's two evaluators must score the same task")
        self.exact, self.fast, self.guard = exact, fast, guard

    @property
    def inner(self) -> EvaluatorProtocol:
        return self.exact

    @property
    def budget_halvings(self) -> list[int]:
        """The fp32 engine's (a run's info reports them)."""
        return self.exact.budget_halvings

    def evaluate(self, interventions: Iterable[Iterable[HeadId]], desc: str | None = None) -> list[Outcome]:
        interventions = self.exact._canonical(interventions)
        unique = list(dict.fromkeys(interventions))
        if self.guard.fell_back:
            outcomes = self.exact.evaluate(unique, desc)
            self.guard.fp32_pairs += len(unique) * len(self.exact.requests)
        elif self.exact.kind.loglikelihood:
            outcomes = self._guarded(unique, desc)
        else:
            outcomes = [self.exact.decide(c) for c in guarded_completions(self.exact, self.fast, self.guard, unique, desc)]
        found = dict(zip(unique, outcomes))
        return [found[heads] for heads in interventions]

    def evaluate_one(self, heads: Iterable[HeadId] = ()) -> Outcome:
        return self.evaluate([heads])[0]

    def _guarded(self, unique: list[Intervention], desc: str | None) -> list[Outcome]:
        rule, task, requests, guard = self.exact.kind.item_decision, self.exact.task, self.exact.requests, self.guard
        exact: dict[Pair, ContinuationStats] = {}
        fast: list[list] = []  # the fast pass's statistics, [intervention][item], as its batches finish

        def errors(pairs: list[Pair]) -> list[float]:
            return [rule.margin_error(task, requests[i], fast[u][i], exact[u, i]) for u, i in pairs]

        def recheck(pairs: list[Pair]) -> list[float]:  # after the pass (pair_stats)
            for pair, value in zip(pairs, pair_stats(self.exact, [(i, unique[u]) for u, i in pairs])):
                exact[pair] = value
            return errors(pairs)

        # A fast pass on fp32's model (its bf16 copy runs only above the ablated layers) computes the full model in
        # fp32's own clean pass: exact, neither audited nor rechecked; and its kept states are fp32's, so a batch's
        # rechecks start from them while the fast pass holds them.
        own = self.fast.lm is self.exact.lm
        in_pass = own and self.fast.batches == self.exact.batches
        # Its error grows with the layers computed in bf16, those from the first ablated one up: a band per third of
        # the layers (Guard). A fast pass in bf16 throughout gets the run's band.
        n_layers = self.exact.lm.geometry.n_layers
        depths = [depth_group(min(h.layer for h in heads), n_layers) if own and heads else None for heads in unique]
        check = guard.call((len(unique), len(requests)), [u for u, heads in enumerate(unique) if own and not heads],
                           depths)

        def after_batch(batch: list[int], held: BatchPass | None, per: list) -> None:
            fast[:] = per
            pairs = [(u, i) for u in range(len(unique)) for i in batch]

            def recheck_in_pass(todo: list[Pair]) -> list[float]:
                if held is None or not in_pass:
                    return recheck(todo)
                for pair, value in zip(todo, batch_pair_stats(self.exact, held, [(i, unique[u]) for u, i in todo])):
                    exact[pair] = value
                return errors(todo)

            check.part(pairs, [rule.margin(task, requests[i], per[u][i]) for u, i in pairs], recheck_in_pass)

        self.fast.continuation_stats(unique, desc, after_batch=after_batch)

        def differs(pair: Pair) -> bool:
            u, i = pair
            return rule.decision(task, requests[i], fast[u][i]) != rule.decision(task, requests[i], exact[u, i])

        differing = check.finish(recheck, differs)
        if differing:
            u, i = differing[0]
            guard.fall_back(f"{task.name}: an audited bf16 decision differed from fp32's outside the band (item "
                            f"{requests[i].item_id}, {format_heads(unique[u])}, bf16 margin {check.margins[u, i]:.4g}, "
                            f"band {check.band(u):.4g})", check.margins.size)
            return self.exact.evaluate(unique, desc)
        merged = [[exact.get((u, i), fast[u][i]) for i in range(len(requests))] for u in range(len(unique))]
        return [self.exact.decide(per) for per in merged]


@torch.no_grad()
def pair_stats(engine: EngineEvaluator, pairs: Sequence[tuple[int, Intervention]]) -> list[ContinuationStats]:
    """The statistics of single (item index, intervention) pairs, without the rest of either's product.

    The guarded precision's recheck, on ``engine`` (fp32's), where no clean pass is held: per batch of the engine's that
    holds a pair, the states below each starting layer come from the engine's kept clean passes where they hold them
    (the fast pass just ran the call's, on fp32's model: :mod:`cel_utils.evaluation.clean_passes`), else from a clean
    pass of the batch (as :meth:`EngineEvaluator.continuation_stats` takes them), then :func:`batch_pair_stats`.
    Nothing is stored: the stacking differs from the full product's, so the numbers agree with it to float rounding, not
    to the bit.
    """
    out: list = [None] * len(pairs)
    batch_of = {item: b for b, batch in enumerate(engine.batches) for item in batch}
    by_batch: dict[int, list[int]] = {}
    for p, (item, _) in enumerate(pairs):
        by_batch.setdefault(batch_of[item], []).append(p)
    prefix_pass = clean_prefix(engine.lm, engine.prefix) if engine.prefix else None  # once per call, for every head set
    clean_states = [prefix_pass.kv] if engine.prefix else None
    for b, members in sorted(by_batch.items()):
        batch = engine.batches[b]
        wanted = sorted({min(h.layer for h in pairs[p][1]) - 1 for p in members if pairs[p][1]} - {-1})
        ids, positions, attn = engine.batch_inputs([engine.rows[i] for i in batch])
        kept, clean = engine.clean_pass(batch, ids, positions, attn, wanted, clean_states,
                                        any(not pairs[p][1] for p in members))
        held = BatchPass(batch, ids, positions, attn, kept, clean, prefix_pass)
        for p, stats in zip(members, batch_pair_stats(engine, held, [pairs[p] for p in members])):
            out[p] = stats
        del kept, held
    return out


@torch.no_grad()
def batch_pair_stats(engine: EngineEvaluator, held: BatchPass, pairs: Sequence[tuple[int, Intervention]]
                     ) -> list[ContinuationStats]:
    """The statistics of (item index, intervention) pairs whose items are all in ``held``'s batch, from its clean pass:
    the pairs run stacked as rows by starting layer, each with its own item's tokens, kept state and head mask, under
    the engine's token budget (so a rechecked pair costs what a pair of the full product costs)."""
    lm = engine.lm
    model, geometry, n_layers = lm.model, lm.geometry, lm.geometry.n_layers
    out: list = [None] * len(pairs)
    where = {item: r for r, item in enumerate(held.batch)}
    start = [min(h.layer for h in heads) if heads else n_layers for _, heads in pairs]
    ids, positions, attn = held.ids, held.positions, held.attn
    stack = max(1, engine.token_budget // ids.shape[1])
    if engine.prefix:
        stack = max(1, min(stack, PREFIX_CACHE_BYTES // engine.prefix_bytes()))
    for layer in sorted(set(start)):
        # One head set's rows side by side: a chunk computes the shared prefix once per head set it holds
        # (prefix_states), and scattered pairs of the same set would recompute it in every chunk.
        group = sorted((p for p in range(len(pairs)) if start[p] == layer), key=lambda p: pairs[p][1])
        for s in range(0, len(group), stack):
            chunk = group[s:s + stack]
            index = torch.tensor([where[pairs[p][0]] for p in chunk], device=ids.device)
            if layer == n_layers:
                if held.clean is None:
                    raise RuntimeError("a full-model pair to recheck, but the batch's pass held no clean last state")
                hidden = held.clean[index]
            else:
                row_masks = torch.stack([head_mask(pairs[p][1], geometry) for p in chunk])
                states = (prefix_states(lm, engine.prefix, None, row_masks, len(chunk), held.prefix)
                          if engine.prefix else None)
                chunk_attn = _rows_of(attn, index)
                with attention_with_mask(model, chunk_attn), ablated_rows(model, row_masks, geometry), \
                        start_at_layer(model, layer, held.kept[layer - 1][index] if layer > 0 else None):
                    hidden = base_model(model)(
                        input_ids=ids[index], attention_mask=chunk_attn,
                        position_ids=None if positions is None else positions[index],
                        **engine.prefix_kwargs(states, 1)).last_hidden_state
            found: list = [None] * len(chunk)
            engine.collect_stats(found, list(range(len(chunk))), [engine.rows[pairs[p][0]] for p in chunk], hidden)
            for p, stats in zip(chunk, found):
                out[p] = stats
    return out


def _rows_of(mask, index: torch.Tensor):
    """The rows ``index`` of an additive mask, or of each mask of a dict of them (one per layer type: Gemma 3's
    sliding and full layers)."""
    if isinstance(mask, dict):
        return {kind: part[index] for kind, part in mask.items()}
    return None if mask is None else mask[index]
