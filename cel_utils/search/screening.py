"""Screens for stage 1: rank every head cheaply on the whole discovery set, so that only the top m are evaluated exactly.

Exact stage 1 evaluates every head alone on every discovery item (hundreds of interventions). A screen orders all
heads by a cheaper number instead; :func:`cel_utils.search.algorithm.run_search` then evaluates the screen's top m
exactly and draws the pool (top p by the paper's key, on exact scores) and stage 2 from those, unchanged. With m equal
to the number of heads the screened search is the exact one.

Screens (``SCREENS``):

* ``attribution`` -- attribution patching (:mod:`cel_utils.search.attribution`): the first-order change of each item's
  decision margin (MBPP: of the reference solution's log-likelihood) when the head is removed, averaged over items.
  One forward and one backward pass over the items: about 3 forward-equivalents per item for *all* heads.
* ``attribution-flips`` -- the same estimates, counted as decisions: items whose margin the estimate moves across zero,
  wrong -> right minus right -> wrong (the accuracy gain to first order), ties broken by the mean estimate. Not for
  generation, which has no decision margin.
* ``bf16`` -- exact single-head evaluation in bfloat16 (about half the cost of float32 on a CPU, all heads), ranked
  by the paper's key on those outcomes (gain, then harm).

Every screen keeps its per-item numbers, so a resampled discovery set (the stability analysis) is screened again by
indexing them (:meth:`Screen.view`), with no new pass.
"""
from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass

import numpy as np

from cel_utils.models.heads import HeadId

SCREENS = ("attribution", "attribution-flips", "bf16")


@dataclass
class Screen:
    """A screen's per-item numbers for every head, and the order they give."""

    method: str
    heads: list[HeadId]  # every head, in (layer, head) order
    per_item: np.ndarray  # [items, heads]: attribution -> estimated change of M; bf16 -> ablated - full correctness
    full_margins: np.ndarray | None = None  # [items]: the full model's decision margins (attribution-flips)
    forward_equivalents: float = 0.0  # the screen's cost, in forward passes of the full model over one item
    seconds: float = 0.0

    def view(self, indices: np.ndarray) -> "Screen":
        """The same screen on the items at ``indices`` (repeats allowed): what a resampled discovery set would see."""
        margins = None if self.full_margins is None else self.full_margins[indices]
        return dataclasses.replace(self, per_item=self.per_item[indices], full_margins=margins)

    def scores(self) -> np.ndarray:
        """The number per head the order sorts by first (higher is more promising), for tables and figures."""
        if self.method == "attribution":
            return self.per_item.mean(axis=0)
        if self.method == "attribution-flips":
            return _estimated_flips(self.per_item, self.full_margins)
        return self.per_item.sum(axis=0)  # bf16: the gain count

    def order(self) -> list[HeadId]:
        """Every head, most promising first; ties in (layer, head) order (a stable sort of the heads' own order)."""
        primary = self.scores()
        if self.method == "attribution-flips":
            secondary = self.per_item.mean(axis=0)
        elif self.method == "bf16":
            secondary = -(self.per_item < 0).sum(axis=0)  # fewer harmed items first, as the paper's key
        else:
            secondary = np.zeros_like(primary)
        keys = np.lexsort((-secondary, -primary))  # the last key sorts first; lexsort is stable
        return [self.heads[i] for i in keys]

    def top(self, m: int, candidates: list[HeadId] | None = None) -> list[HeadId]:
        """The screen's best ``m`` heads (among ``candidates`` when given)."""
        allowed = None if candidates is None else set(candidates)
        return [h for h in self.order() if allowed is None or h in allowed][:m]

    def to_json(self, keep: int) -> dict:
        """What the artifact records: the method, m, the cost and every head's score as a [layers, heads] grid."""
        n_heads = max(h.head for h in self.heads) + 1
        return {"method": "screened", "screen": self.method, "keep": keep, "n_heads": len(self.heads),
                "forward_equivalents": self.forward_equivalents, "order": [str(h) for h in self.order()],
                "scores": self.scores().reshape(-1, n_heads).tolist()}


def _estimated_flips(per_item: np.ndarray, margins: np.ndarray) -> np.ndarray:
    """Per head: items whose margin the estimate moves from below zero to above, minus those moved the other way."""
    after = margins[:, None] + per_item
    return ((margins[:, None] <= 0) & (after > 0)).sum(axis=0) - ((margins[:, None] > 0) & (after <= 0)).sum(axis=0)


def run_screen(method: str, discovery) -> Screen:
    """Screen every head of the discovery evaluator's model on all its items (``discovery``: an Evaluator or an
    OutcomeTable wrapping one; the bf16 screen builds a bfloat16 copy of the model for its own evaluator)."""
    if method not in SCREENS:
        raise ValueError(f"unknown screen {method!r}: choose from {', '.join(SCREENS)}")
    evaluator = getattr(discovery, "evaluator", discovery)
    heads = evaluator.lm.geometry.all_heads()
    start = time.perf_counter()
    if method.startswith("attribution"):
        from cel_utils.evaluation.kinds import kind_of
        from cel_utils.search.attribution import head_attributions

        if method == "attribution-flips" and not kind_of(evaluator.task).loglikelihood:
            raise ValueError(f"the attribution-flips screen counts decisions; {evaluator.task.name} is decided by "
                             "running code: use the attribution screen (it attributes the reference's likelihood)")
        attribution = head_attributions(evaluator)
        per_item = attribution.per_item.reshape(len(attribution.per_item), -1)
        screen = Screen(method, heads, per_item, attribution.full_margins, attribution.forward_equivalents)
    else:
        outcomes = _bf16_evaluator(evaluator).evaluate([()] + [(h,) for h in heads], desc=f"bf16 screen: {len(heads)} heads")
        full = outcomes[0].correct.astype(int)
        per_item = np.stack([o.correct.astype(int) - full for o in outcomes[1:]], axis=1)
        cost = len(full) * (1 + sum(evaluator.lm.geometry.n_layers - h.layer for h in heads) / evaluator.lm.geometry.n_layers)
        screen = Screen(method, heads, per_item, None, cost / 2)  # bfloat16 runs about twice as fast as float32
    screen.seconds = time.perf_counter() - start
    return screen


def _bf16_evaluator(evaluator):
    """An evaluator of the same items and settings on a bfloat16 copy of the model (no store: a screen is cheap)."""
    import copy

    import torch

    lm = dataclasses.replace(evaluator.lm, model=copy.deepcopy(evaluator.lm.model).to(torch.bfloat16), dtype=torch.bfloat16)
    return type(evaluator)(lm, evaluator.task, evaluator.items, evaluator.fewshot, fmt=evaluator.fmt,
                           bos="always" if evaluator.bos else "never",
                           batch_size=evaluator.batch_size, max_new_tokens=evaluator.max_new_tokens, progress=evaluator.progress)
