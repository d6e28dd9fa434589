"""A fast evaluation engine that is exact by construction.

Screening evaluates hundreds of interventions on the same items. Most of that work repeats, and this
engine skips the repeats without changing what is computed:

* **Reuse below the ablated layer.** Ablating heads whose lowest layer is l changes nothing in layers
  0..l-1. For each batch the full model runs once with the residual stream kept at every layer boundary;
  an intervention starting at layer l then runs only layers l..L-1 from the kept state. This is done with
  the model's own forward (masks, rotary embeddings and all), with layers 0..l-1 swapped for stand-ins
  that hand back the kept state, so every supported family works unchanged.
* **Stack interventions.** Interventions with the same starting layer run together, each as its own
  copy of the batch with its own per-row head mask (:func:`cel_utils.models.ablation.ablated_rows`), so the
  matmuls are larger.
* **Only the scored logits.** The unembedding runs only at the positions the scorer reads; for
  two-choice tasks scored by plain accuracy with one-token answers (BoolQ), only those vocabulary rows:
  the log-softmax normaliser is shared by both answers, so comparing logits decides exactly as comparing
  log-likelihoods.
* **Shared contexts.** Multiple-choice answers that share a context are packed into one sequence: the
  context once, then every answer, each answer attending to the context and to itself only
  (:mod:`cel_utils.evaluation.layout`).
* **Length batching.** Items are tokenized once, sorted by length and batched under a token budget, a
  new batch starting where padding would exceed ``MAX_PADDING`` of a row.
* **Reuse across calls.** Given a :class:`~cel_utils.evaluation.clean_passes.CleanPasses`, a batch's kept states
  outlive its call, and a later call on the same inputs that needs no others (stage 2 after stage 1, the control after
  the holdout) starts from them instead of running the clean pass again.

Loop order is batch-outer, intervention-inner: memory is bounded by one batch's kept states,
``rows x tokens x hidden x layers`` values (e.g. 16 x 200 x 576 x 30 fp32 = 221 MB for SmolLM2-135M),
plus one stacked forward of at most ``token_budget`` tokens.

MBPP (generation) stacks interventions as rows of one batch and decodes incrementally with a KV cache;
the shared few-shot prefix is computed once per head set and only from its lowest ablated layer on
(:mod:`cel_utils.evaluation.generation`); there is no below-layer reuse for the tokens after it.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

import numpy as np
import torch

from cel_utils.evaluation.batching import length_batches
from cel_utils.evaluation.clean_passes import CleanPasses
from cel_utils.evaluation.evaluator import Evaluator, Intervention
from cel_utils.evaluation.layout import Row, after_prefix, layout, repeat_mask, row_inputs
from cel_utils.evaluation.prefix import (MIN_SHARED_PREFIX, CleanPrefix, clean_prefix, prefix_cache, prefix_states,
                                        shared_prefix_length, sliding_window)
from cel_utils.models.ablation import ablated_rows, head_mask
from cel_utils.models.heads import format_heads
from cel_utils.models.loading import LoadedModel
from cel_utils.models.plumbing import (attention_windows, attention_with_mask, base_model, capture_layer_outputs,
                                      start_at_layer, unembed)
from cel_utils.tasks.scoring import ContinuationStats, Outcome, continuation_loglikelihood, continuation_stats

# Bump when the engine's stored numbers change (tests/test_store_versions.py). 2: packed answers see a sliding
# window (Gemma 3) as the model does; before, a packed row longer than the window attended past it. 3: a kind whose
# decision does not read the greedy statistics stores them empty (TaskKind.reads_greedy).
ENGINE_VERSION = "3"
# An item shorter than this fraction of its batch's longest starts a new batch. Small batches cost little
# here because interventions are stacked up to the token budget anyway, while padding is computed in full:
# BoolQ's and HellaSwag's lengths vary 4x, and batches of 8 were 36% padding.
MAX_PADDING = 0.25
# The prefix's keys and values are copied into every row of a stacked forward: cap their memory.
PREFIX_CACHE_BYTES = 256 * 2**20
MIN_TOKEN_BUDGET = 256  # below this, an out-of-memory error is not a budget problem


@dataclass
class BatchPass:
    """One batch's clean pass, as a call of :meth:`EngineEvaluator.continuation_stats` made it: what a forward of the
    batch's rows from any kept layer needs (the guarded precision's recheck, :mod:`cel_utils.evaluation.guarded`, reuses
    it). ``kept[l]`` is the residual stream after layer ``l`` for the layers the call's interventions start above;
    ``clean`` the last hidden state; ``prefix`` the call's clean pass over the shared prefix, if any."""

    batch: list[int]
    ids: torch.Tensor
    positions: torch.Tensor | None
    attn: torch.Tensor | dict | None
    kept: dict[int, torch.Tensor]
    clean: torch.Tensor | None  # None where the call had no full model to score and a kept clean pass served
    prefix: CleanPrefix | None


# --- The evaluator ----------------------------------------------------------------------------------------

class EngineEvaluator(Evaluator):
    """Drop-in replacement for :class:`cel_utils.evaluation.NaiveEvaluator`, same decisions, less work.

    ``token_budget`` caps the tokens of one forward (rows x width), which bounds memory; ``batch_size``
    caps the items per batch.
    """

    store_kind = f"engine-{ENGINE_VERSION}"
    # What ENGINE_VERSION stands for (see Evaluator.store_sources): batching is not among them, as a batch's name is a
    # hash of its requests, so batches cut otherwise are other records, never old numbers under a new meaning.
    store_sources = ("cel_utils.evaluation.engine", "cel_utils.evaluation.clean_passes", "cel_utils.evaluation.layout",
                     "cel_utils.evaluation.prefix",
                     "cel_utils.evaluation.generation", "cel_utils.tasks.scoring", "cel_utils.models.ablation",
                     "cel_utils.models.plumbing")

    def __init__(self, *args, token_budget: int | None = None, above: LoadedModel | None = None,
                 clean_passes: CleanPasses | None = None, **kwargs):
        super().__init__(*args, **kwargs)
        self.clean_passes = clean_passes  # clean passes kept across calls, shared with the evaluators given the same
        # The engine's one seam for another precision: the model that computes from an intervention's lowest ablated
        # layer up, and decodes. ``lm`` itself, or the guarded precision's fast pass's bfloat16 copy
        # (cel_utils.evaluation.guarded), below which the clean pass, the kept states and the unembedding stay ``lm``'s.
        self.above = above or self.lm
        # what sibling() carries besides the base's
        self.settings.update(token_budget=token_budget, above=above, clean_passes=clean_passes)
        self.token_budget = token_budget or default_token_budget(self.lm.device)
        self.budget_halvings: list[int] = []  # the token budgets an out-of-memory error made it fall back to
        if self.kind.loglikelihood:
            self.shortcut = (self.kind.compares_answers and self.task.metric == "acc"
                             and all(len(c) == 1 for r in self.requests for c in r.continuations))
            self.rows = [layout(r, self.shortcut) for r in self.requests]
            self.prefix = self._shared_prefix()
            if self.prefix:
                self.rows = [after_prefix(row, len(self.prefix)) for row in self.rows]
            self.batches = self._make_batches()

    def _shared_prefix(self) -> tuple[int, ...]:
        """The tokens every row starts with (few-shot exemplars), when long enough to compute once per head set.

        Not for packed answers (their block mask is written for whole rows) nor for sliding-window attention."""
        rows = self.rows
        if len(rows) < 2 or any(row.positions is not None for row in rows) or sliding_window(self.lm):
            return ()
        n = min(shared_prefix_length([row.tokens for row in rows]), min(row.context_len for row in rows) - 1)
        return tuple(rows[0].tokens[:n]) if n >= MIN_SHARED_PREFIX else ()

    def _make_batches(self) -> list[list[int]]:
        order = sorted(range(len(self.rows)), key=lambda i: -len(self.rows[i].tokens))
        spans = length_batches([len(self.rows[i].tokens) for i in order], self.batch_size, self.token_budget,
                               MAX_PADDING)
        return [order[start:stop] for start, stop in spans]

    def store_fields(self) -> dict:
        # The shortcut stores answer logits, not log-probabilities: a different quantity under the same name.
        fields = super().store_fields()
        if self.above is not self.lm:  # numbers partly or wholly computed in another dtype: never served as lm's own
            fields["fast_dtype"] = str(self.above.dtype).removeprefix("torch.")
        if not self.kind.loglikelihood:
            return fields
        # A prefix computed apart gives the same numbers up to float rounding, not to the bit: its own context.
        return {**fields, "shortcut": self.shortcut, **({"shared_prefix": len(self.prefix)} if self.prefix else {})}

    def _evaluate(self, interventions: list[Intervention], desc: str | None) -> list[Outcome]:
        """On out-of-memory, start again with half the token budget (what finished is stored and read back)."""
        while True:
            try:
                if not self.kind.loglikelihood:
                    return self._evaluate_generation(interventions, desc)
                return [self.decide(stats) for stats in self.continuation_stats(interventions, desc)]
            except torch.OutOfMemoryError:
                if self.token_budget <= MIN_TOKEN_BUDGET:
                    raise
                self.token_budget //= 2
                self.budget_halvings.append(self.token_budget)
                if self.kind.loglikelihood:
                    self.batches = self._make_batches()
                if self.lm.device.type == "cuda":
                    torch.cuda.empty_cache()

    # Log-likelihood tasks -----------------------------------------------------------------------------

    @torch.no_grad()
    def continuation_stats(self, interventions: Sequence[Intervention], desc: str | None = None,
                           after_batch: Callable[[list[int], BatchPass | None, list], None] | None = None
                           ) -> list[list[ContinuationStats]]:
        """Per intervention, per request: the same statistics the naive path computes.

        ``after_batch(batch, batch_pass, per)``, if given, is called once each batch's statistics are all in ``per``
        (``per[intervention][item]``), with the batch's clean pass while it is still held (None where the store served
        the whole batch and none ran).

        With a store, each batch first reads what is stored; the clean pass runs only if some forward is
        missing, and each forward's results are written as it finishes. The forwards ("chunks") are cut
        from the whole list, whatever is stored, and a chunk with anything missing is recomputed whole,
        so a resumed run runs exactly the forwards an uninterrupted one would have run (same bits).
        """
        n_layers = self.lm.geometry.n_layers
        per = [[None] * len(self.requests) for _ in interventions]
        by_layer: dict[int, list[int]] = {}
        for index, heads in enumerate(interventions):
            start = min(h.layer for h in heads) if heads else n_layers  # "L" = full model
            by_layer.setdefault(start, []).append(index)
        wanted = [layer - 1 for layer in by_layer if 0 < layer < n_layers]
        masks = {i: head_mask(interventions[i], self.lm.geometry) for i in range(len(interventions))}
        labels = [format_heads(heads) for heads in interventions]
        progress = self.progress_bar(len(self.batches) * len(interventions), desc)
        prefix_pass = clean_prefix(self.lm, self.prefix) if self.prefix else None  # once per call, for every head set
        clean_states = [prefix_pass.kv] if self.prefix else None
        for batch in self.batches:
            rows = [self.rows[i] for i in batch]
            stack = max(1, self.token_budget // (len(batch) * max(len(row.tokens) for row in rows)))
            if self.prefix:  # each row also holds the prefix's keys and values, at every layer
                stack = max(1, min(stack, PREFIX_CACHE_BYTES // (len(batch) * self.prefix_bytes())))
            chunks = []  # (starting layer, interventions of one forward)
            for layer, members in sorted(by_layer.items()):
                size = stack if layer < n_layers else len(members)  # the full model is the clean pass itself
                chunks += [(layer, members[s:s + size]) for s in range(0, len(members), size)]
            key = self.store_key(batch) if self.stored else None
            counts = self.continuation_counts(batch) if self.stored else None
            stored = self.stored.load_stats(key, counts) if self.stored else {}
            todo = []
            for layer, chunk in chunks:
                if all(labels[i] in stored for i in chunk):
                    self._fill(per, chunk, batch, labels, stored)
                    self.stored.served(len(chunk))
                    progress.update(len(chunk))
                else:
                    todo.append((layer, chunk))
            if not todo:
                if after_batch:
                    after_batch(batch, None, per)
                continue
            ids, positions, attn = self.batch_inputs(rows)
            kept, clean = self.clean_pass(batch, ids, positions, attn, wanted, clean_states,
                                          any(layer == n_layers for layer, _ in todo))
            for layer, chunk in todo:
                if layer == n_layers:  # the full model: the clean pass itself
                    for index in chunk:
                        self.collect_stats(per[index], batch, rows, clean)
                else:
                    m, above = len(chunk), self.above
                    row_masks = torch.cat([masks[i].expand(len(batch), -1, -1) for i in chunk])
                    state = kept[layer - 1].to(above.dtype).repeat(m, 1, 1) if layer > 0 else None
                    states = (prefix_states(above, self.prefix, None, torch.stack([masks[i] for i in chunk]), m,
                                            prefix_pass) if self.prefix else None)
                    chunk_attn = _in_dtype(attn, above.dtype)
                    with attention_with_mask(above.model, chunk_attn), \
                            ablated_rows(above.model, row_masks, above.geometry), \
                            start_at_layer(above.model, layer, state):
                        hidden = base_model(above.model)(
                            input_ids=ids.repeat(m, 1), attention_mask=repeat_mask(chunk_attn, m),
                            position_ids=None if positions is None else positions.repeat(m, 1),
                            **self.prefix_kwargs(states, len(batch), above)).last_hidden_state.to(self.lm.dtype)
                    for j, index in enumerate(chunk):
                        self.collect_stats(per[index], batch, rows, hidden[j * len(batch):(j + 1) * len(batch)])
                if self.stored:
                    new = {labels[i]: [per[i][r] for r in batch] for i in chunk if labels[i] not in stored}
                    self._fill(per, [i for i in chunk if labels[i] in stored], batch, labels, stored)  # one value per label
                    self.stored.save_stats(key, counts, new)
                progress.update(len(chunk))
            if after_batch:
                after_batch(batch, BatchPass(batch, ids, positions, attn, kept, clean, prefix_pass), per)
            del kept
        progress.close()
        return per

    # A batch's forward, in parts: the guarded precision's pair recheck (cel_utils.evaluation.guarded.pair_stats) runs
    # the rows of one batch otherwise stacked, with these same parts.

    def clean_pass(self, batch: list[int], ids: torch.Tensor, positions: torch.Tensor | None, attn, wanted: list[int],
                   clean_states, full_model: bool) -> tuple[dict[int, torch.Tensor], torch.Tensor | None]:
        """The batch's states after each ``wanted`` layer and, if the ``full_model`` is among what runs, its last hidden
        state (else None): from the kept clean passes where they hold them, else from a clean pass (kept for later)."""
        key = None
        if self.clean_passes is not None:
            key = self.clean_passes.key(self.lm, ids, positions, attn, self.prefix)
            if not full_model and (kept := self.clean_passes.get(key, wanted)) is not None:
                return kept, None
        with attention_with_mask(self.lm.model, attn), capture_layer_outputs(self.lm.model, wanted) as kept:
            clean = base_model(self.lm.model)(input_ids=ids, position_ids=positions, attention_mask=attn,
                                              **self.prefix_kwargs(clean_states, len(batch))).last_hidden_state
        if key is not None:
            self.clean_passes.put(key, kept)
        return kept, clean

    def prefix_bytes(self) -> int:
        """Memory of one row's copy of the prefix's keys and values."""
        geometry = self.lm.geometry
        return 2 * geometry.n_layers * geometry.n_kv_heads * geometry.head_dim * len(self.prefix) * self.lm.dtype.itemsize

    def prefix_kwargs(self, states, repeats: int, lm: LoadedModel | None = None) -> dict:
        """What a forward over the rows after the prefix needs: the prefix's keys and values, one per head set."""
        return {"cache": prefix_cache(lm or self.lm, states, repeats), "use_cache": True} if states else {}

    def _fill(self, per: list, indices: list[int], batch: list[int], labels: list[str], stored: dict) -> None:
        for index in indices:
            for r, stats in zip(batch, stored[labels[index]]):
                per[index][r] = stats

    def batch_inputs(self, rows: list[Row]) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """The rows' token ids, position ids (None: the model's own) and additive attention mask."""
        ids, positions, attn = row_inputs(rows, self.lm.tokenizer.pad_token_id, self.lm.dtype, self.lm.device,
                                          attention_windows(self.lm.model))
        if self.prefix:  # the rows continue after the shared prefix (prefixed rows are never packed)
            positions = (torch.arange(ids.shape[1], device=ids.device) + len(self.prefix)).expand(len(rows), -1)
        return ids, positions, attn

    def collect_stats(self, out: list, batch: list[int], rows: list[Row], hidden: torch.Tensor) -> None:
        """Unembed only the scored positions of the batch (one matmul) and turn them into statistics."""
        model, device = self.lm.model, hidden.device
        if self.shortcut:
            vocab = sorted({targets[0] for row in rows for _, targets in row.scored})
            column = {token: j for j, token in enumerate(vocab)}
            last = torch.tensor([row.context_len - 1 for row in rows], device=device)
            logits = unembed(model, hidden[torch.arange(len(rows), device=device), last],
                             torch.tensor(vocab, device=device)).double().cpu().numpy()
            for r, (index, row) in enumerate(zip(batch, rows)):
                lls = np.array([logits[r, column[targets[0]]] for _, targets in row.scored])
                out[index] = ContinuationStats.log_likelihoods_only(lls)
            return
        row_index = [r for r, row in enumerate(rows) for positions, _ in row.scored for _ in positions]
        pos_index = [p for row in rows for positions, _ in row.scored for p in positions]
        logits = unembed(model, hidden[torch.tensor(row_index, device=device), torch.tensor(pos_index, device=device)])
        offset = 0
        for index, row in zip(batch, rows):
            parts = []
            for positions, targets in row.scored:
                parts.append((logits[offset:offset + len(positions)], torch.tensor(targets, device=device)))
                offset += len(positions)
            if self.kind.reads_greedy:
                out[index] = ContinuationStats.of([continuation_stats(*part) for part in parts])
            else:
                out[index] = ContinuationStats.log_likelihoods_only(
                    np.array([continuation_loglikelihood(*part) for part in parts]))

    # Generation -------------------------------------------------------------------------------------------

    def decoding_rows(self) -> int:
        """The rows one call of :func:`~cel_utils.evaluation.generation.generate` decodes together.

        A decoding step reads every weight once whatever the number of rows, so on a CPU it is bound by memory
        bandwidth and wide steps are much cheaper per row (MBPP, 4 items x 8 heads on 2 cores: 2.5 s per row at 8 rows
        per step, 1.85 s at 32). Rows are capped by their KV cache, which is small: a row holds its own tokens and the
        ones it generates (the shared few-shot prefix is computed once per head set, see generation.generate), so a
        call may hold 4x the forward token budget. Interventions are stacked by the typical row;
        generation.MAX_PROMPT_PADDING keeps a rare long prompt from widening a whole batch."""
        from cel_utils.evaluation.generation import shared_prefix_length

        requests = self.requests
        shared = shared_prefix_length([r.context for r in requests]) if len(requests) > 1 else 0
        typical = int(np.median([len(r.context) for r in requests])) - shared + self.max_new_tokens
        return max(self.batch_size, min(64, 4 * self.token_budget // max(1, typical)))

    def decoding_chunks(self, interventions: Sequence[Intervention]) -> list[list[Intervention]]:
        """The interventions decoded together, in one call of :meth:`decode_chunk` each."""
        stack = max(1, self.decoding_rows() // len(self.requests))
        return [list(interventions[s:s + stack]) for s in range(0, len(interventions), stack)]

    def decode_chunk(self, chunk: Sequence[Intervention], gaps: bool = False) -> list[list]:
        """Per intervention of ``chunk``, per request, its completion (with ``gaps``, the pair (completion,
        :class:`~cel_utils.evaluation.generation.Decoded`)), every row decoded in one call of ``generate``."""
        from cel_utils.evaluation.generation import generate

        n = len(self.requests)
        row_masks = torch.cat([head_mask(heads, self.lm.geometry).expand(n, -1, -1) for heads in chunk])
        result = generate(self.above, self.requests * len(chunk), row_masks=row_masks,
                          batch_size=self.decoding_rows(), max_new_tokens=self.max_new_tokens,
                          token_budget=4 * self.token_budget, gaps=gaps)
        flat = list(zip(*result)) if gaps else result
        return [flat[j * n:(j + 1) * n] for j in range(len(chunk))]

    def _evaluate_generation(self, interventions: list[Intervention], desc: str | None) -> list[Outcome]:
        """Interventions stacked as rows of one generation batch; stored whole chunks at a time, as the
        log-likelihood path does, so a resumed run decodes exactly the batches an uninterrupted one would."""
        n = len(self.requests)
        key = self.store_key(range(n)) if self.stored else None
        stored = self.stored.load_completions(key, n) if self.stored else {}
        outcomes: list[Outcome] = []
        progress = self.progress_bar(len(interventions), desc)
        for chunk in self.decoding_chunks(interventions):
            progress.update(len(chunk))
            labels = [format_heads(heads) for heads in chunk]
            missing = [label for label in labels if label not in stored]
            if missing:
                new = {label: completions for label, completions in zip(labels, self.decode_chunk(chunk))
                       if label in missing}
                if self.stored:
                    self.stored.save_completions(key, new)
                stored.update(new)
            if self.stored and len(missing) < len(labels):
                self.stored.served(len(labels) - len(missing))
            for label in labels:
                outcomes.append(self.decide(stored[label]))
        progress.close()
        return outcomes


def _in_dtype(mask, dtype: torch.dtype):
    """An additive mask (or a dict of them, one per layer type) in ``dtype``."""
    if isinstance(mask, dict):
        return {kind: part.to(dtype) for kind, part in mask.items()}
    return None if mask is None else mask.to(dtype)


def default_token_budget(device: torch.device) -> int:
    """Tokens per forward: modest on CPU (larger batches do not run faster there), larger on a GPU,
    scaled to free memory."""
    if device.type != "cuda":
        return 4096
    free, _ = torch.cuda.mem_get_info(device)
    return int(min(262144, max(8192, free / 2 ** 20 * 16)))
