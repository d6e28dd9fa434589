"""What one batch row of a log-likelihood forward holds, and which of its positions are scored.

A request (a context and its continuations) becomes one row (:func:`layout`):

* one-token answers compared by plain accuracy (BoolQ, the *shortcut*): the context; every answer is read at its last
  position;
* one continuation (greedy match, MBPP's reference solution): context + continuation, teacher forced;
* several continuations (HellaSwag's endings): *packed*, the context once, then every continuation, each attending to
  the context and to itself only (:func:`block_mask`), with position ids continuing from the context. That is the
  same computation as scoring each (context, continuation) pair alone, with the context done once.

The evaluation engine (:mod:`cel_utils.evaluation.engine`) and attribution patching
(:mod:`cel_utils.search.attribution`) both lay rows out this way.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from cel_utils.models.plumbing import AttentionWindows
from cel_utils.tasks.prompts import Request


@dataclass
class Row:
    tokens: list[int]
    positions: list[int] | None  # explicit position ids (packed continuations), else 0..n-1
    segments: list[tuple[int, int]]  # packed: [start, end) of each continuation's tokens inside the row
    context_len: int
    scored: list[tuple[list[int], list[int]]]  # per continuation: (positions read, target token ids)


def layout(request: Request, shortcut: bool) -> Row:
    """The request's row; ``shortcut``: only the last context position is read (one-token answers)."""
    context = list(request.context)
    n = len(context)
    conts = [list(c) for c in request.continuations]
    if shortcut:  # one position, the answers' vocabulary rows
        return Row(tokens=context, positions=None, segments=[], context_len=n,
                   scored=[([n - 1], [c[0]]) for c in conts])
    if len(conts) == 1:  # greedy match: context + target, teacher forced
        cont = conts[0]
        return Row(tokens=context + cont[:-1], positions=None, segments=[], context_len=n,
                   scored=[(list(range(n - 1, n - 1 + len(cont))), cont)])
    tokens, positions, segments, scored = list(context), list(range(n)), [], []
    for cont in conts:
        start = len(tokens)
        tokens += cont[:-1]
        positions += list(range(n, n + len(cont) - 1))
        segments.append((start, len(tokens)))
        scored.append(([n - 1] + list(range(start, len(tokens))), cont))
    return Row(tokens=tokens, positions=positions, segments=segments, context_len=n, scored=scored)


def after_prefix(row: Row, n: int) -> Row:
    """The part of a (non-packed) row after a shared prefix of ``n`` tokens, its scored positions shifted."""
    return Row(tokens=row.tokens[n:], positions=None, segments=[], context_len=row.context_len - n,
               scored=[([p - n for p in positions], targets) for positions, targets in row.scored])


def block_mask(rows: list[Row], width: int, dtype: torch.dtype, window: int | None = None) -> torch.Tensor:
    """Additive 4D mask [rows, 1, width, width]: causal over the context, each continuation sees the context and
    itself. Padding positions see only themselves, so no softmax row is empty (no NaN).

    ``window``: a sliding-window layer's span, counted in position ids as the model's own mask counts it (a query at
    position q sees keys at positions above q - window): a continuation then sees what it would see scored alone."""
    allowed = torch.zeros(len(rows), width, width, dtype=torch.bool)
    causal = torch.tril(torch.ones(width, width, dtype=torch.bool))
    for r, row in enumerate(rows):
        n = row.context_len
        allowed[r, :n, :n] = causal[:n, :n]
        for start, end in row.segments:
            allowed[r, start:end, :n] = True
            allowed[r, start:end, start:end] = causal[: end - start, : end - start]
        if window is not None:
            length = len(row.tokens)
            position = torch.tensor(row.positions or list(range(length)))
            allowed[r, :length, :length] &= position[:, None] - position[None, :] < window
        for pad in range(len(row.tokens), width):
            allowed[r, pad, pad] = True
    mask = torch.zeros(allowed.shape, dtype=dtype)
    mask.masked_fill_(~allowed, torch.finfo(dtype).min)
    return mask[:, None]


# What a packed row's mask is: one tensor for every layer, or one per layer type (the model's ``layer_types``).
Mask = torch.Tensor | dict[str, torch.Tensor]


def row_inputs(rows: list[Row], pad: int, dtype: torch.dtype, device: torch.device | str = "cpu",
               windows: AttentionWindows = None) -> tuple[torch.Tensor, torch.Tensor | None, Mask | None]:
    """Token ids [rows, width], right padded, and, where a row is packed, its position ids and the block mask
    (otherwise None: the model's own causal mask and positions, which a right pad never affects), on ``device``.

    ``windows``: the model's sliding windows (:func:`cel_utils.models.plumbing.attention_windows`). A custom mask is
    used as it is by every layer, sliding ones included, so a model with sliding-window layers gets the windowed mask
    there: one tensor when every layer slides, else one per layer type (a dict, which such models take as it is)."""
    width = max(len(row.tokens) for row in rows)
    ids = torch.full((len(rows), width), pad, dtype=torch.long)
    for r, row in enumerate(rows):
        ids[r, :len(row.tokens)] = torch.tensor(row.tokens)
    if all(row.positions is None for row in rows):
        return ids.to(device), None, None
    positions = torch.zeros((len(rows), width), dtype=torch.long)
    for r, row in enumerate(rows):
        positions[r, :len(row.tokens)] = torch.tensor(row.positions or list(range(len(row.tokens))))
        positions[r, len(row.tokens):] = torch.arange(len(row.tokens), width)
    if isinstance(windows, dict):
        mask = {kind: block_mask(rows, width, dtype, window).to(device) for kind, window in windows.items()}
    else:
        mask = block_mask(rows, width, dtype, windows).to(device)
    return ids.to(device), positions.to(device), mask


def repeat_mask(mask: Mask | None, times: int) -> Mask | None:
    """The mask of ``times`` stacked copies of a batch (the engine's stacked interventions)."""
    if isinstance(mask, dict):
        return {kind: part.repeat(times, 1, 1, 1) for kind, part in mask.items()}
    return None if mask is None else mask.repeat(times, 1, 1, 1)
