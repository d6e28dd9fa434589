"""Attention-head identifiers.

A head is a (layer, query head) pair. Its one printable form is ``L{layer}.H{head}`` (``L12.H3``); tables,
JSON artifacts and plots all use it, and :func:`parse_head` reads it back. Heads are query heads, never
KV groups: in a grouped-query model several query heads share one KV head, yet each query head writes
its own slice of the attention output and can be ablated on its own.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Iterable

_HEAD_RE = re.compile(r"^L(\d+)\.H(\d+)$")


@dataclass(frozen=True, order=True)
class HeadId:
    """One query head; ordering is (layer, head), which is also the lexicographic order of the ids."""

    layer: int
    head: int

    def __str__(self) -> str:
        return f"L{self.layer}.H{self.head}"

    def __repr__(self) -> str:
        return f"HeadId({self})"


@dataclass(frozen=True)
class HeadGeometry:
    """What ablation needs to know about a model's attention: sizes of the o_proj input."""

    n_layers: int
    n_heads: int  # query heads per layer
    n_kv_heads: int
    head_dim: int

    @property
    def n_total(self) -> int:
        return self.n_layers * self.n_heads

    def all_heads(self) -> list[HeadId]:
        return [HeadId(layer, head) for layer in range(self.n_layers) for head in range(self.n_heads)]

    def check(self, head: HeadId) -> HeadId:
        if not (0 <= head.layer < self.n_layers and 0 <= head.head < self.n_heads):
            raise ValueError(
                f"head {head} is outside the model: it has layers 0..{self.n_layers - 1} and query heads "
                f"0..{self.n_heads - 1} per layer: use ids from L0.H0 to L{self.n_layers - 1}.H{self.n_heads - 1}"
            )
        return head


def parse_head(text: str) -> HeadId:
    """Read ``"L12.H3"`` (surrounding spaces allowed) back into a :class:`HeadId`."""
    match = _HEAD_RE.match(text.strip())
    if not match:
        raise ValueError(f"cannot read head id {text!r}: expected the form 'L<layer>.H<head>', e.g. 'L12.H3'")
    return HeadId(int(match.group(1)), int(match.group(2)))


def as_head(head: HeadId | str | tuple[int, int]) -> HeadId:
    if isinstance(head, HeadId):
        return head
    if isinstance(head, str):
        return parse_head(head)
    layer, index = head
    return HeadId(int(layer), int(index))


def head_set(heads: Iterable[HeadId | str | tuple[int, int]]) -> tuple[HeadId, ...]:
    """Canonical form of a set of heads: de-duplicated and sorted, so equal sets compare and hash equal."""
    return tuple(sorted({as_head(h) for h in heads}))


def format_heads(heads: Iterable[HeadId]) -> str:
    """``"L3.H1+L12.H0"``; the empty set (the full model) prints as ``"(none)"``."""
    heads = head_set(heads)
    return "+".join(map(str, heads)) if heads else "(none)"
