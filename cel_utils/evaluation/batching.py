"""Length batching: rows sorted longest first, cut into consecutive batches under a row cap, a token budget and a
bound on padding. The engine's forwards (:mod:`cel_utils.evaluation.engine`) and MBPP's decoding
(:mod:`cel_utils.evaluation.generation`) both batch this way, each with its own bound."""
from __future__ import annotations

from typing import Sequence


def length_batches(lengths: Sequence[int], max_rows: int, token_budget: int | None, max_padding: float,
                   extra: int = 0) -> list[tuple[int, int]]:
    """Consecutive ``[start, stop)`` batches of rows whose ``lengths`` are sorted longest first: at most ``max_rows``
    rows; at most ``token_budget`` tokens (if given) with every row as wide as the batch's first plus ``extra``
    (tokens still to generate); and a new batch where a row would be padded by more than ``max_padding`` of the
    batch's first row. A row too long for the budget still gets a batch of its own."""
    out, start = [], 0
    for i in range(1, len(lengths) + 1):
        if i < len(lengths):
            rows, width = i - start + 1, lengths[start] + extra
            if (rows <= max_rows and (token_budget is None or rows * width <= token_budget)
                    and lengths[i] >= (1 - max_padding) * lengths[start]):
                continue
        out.append((start, i))
        start = i
    return out
