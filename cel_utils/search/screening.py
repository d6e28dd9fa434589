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
* ``boundary`` -- a single head can only change the answers the full model is close to changing. The
  ``candidates`` heads that attribution-flips ranks first are evaluated *exactly*, but only on the ``items`` discovery
  items nearest the decision boundary (smallest |margin| of the full model, which the attribution pass computes), and
  ranked by the paper's key on those items; the other heads follow in attribution-flips order. On 128 arithmetic items
  (80 candidates, 16 items) this recovered the exact top 10 within its top 15 at about a tenth of exhaustive stage 1's
  cost (``benchmarks/bench_screening.py``).
* ``bf16`` -- exact single-head evaluation in bfloat16 (all heads), ranked by the paper's key on those outcomes (gain,
  then harm). Cheaper than float32 only where the device has bf16 units (:mod:`cel_utils.hardware`): its cost is
  counted at the bf16 / fp32 time ratio measured on the device, and on a CPU without bf16 units it warns.

Every screen keeps its per-item numbers, so a resampled discovery set (the stability analysis) is screened again by
indexing them (:meth:`Screen.view`), with no new pass; a boundary screen re-ranks its candidates on the boundary items
the resample contains.
"""
from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from cel_utils.models.heads import HeadId

if TYPE_CHECKING:  # not at run time: cel_utils.config imports this module, and the evaluators import torch
    from cel_utils.evaluation.evaluator import EvaluatorProtocol

SCREENS = ("attribution", "attribution-flips", "boundary", "bf16")
DECISION_SCREENS = ("attribution-flips", "boundary")  # they count decisions by their margins: not for generation


@dataclass
class Screen:
    """A screen's per-item numbers for every head, and the order they give."""

    method: str
    heads: list[HeadId]  # every head, in (layer, head) order
    # [items, heads]: attribution -> estimated change of M; bf16, boundary -> ablated - full correctness (boundary: 0
    # outside its items and candidates)
    per_item: np.ndarray
    full_margins: np.ndarray | None = None  # [items]: the full model's decision margins (attribution-flips)
    forward_equivalents: float = 0.0  # the screen's cost, in forward passes of the full model over one item
    seconds: float = 0.0
    # boundary: which heads were evaluated exactly (they come first), and the attribution-flips rank of the others
    evaluated: np.ndarray | None = None
    prior_rank: np.ndarray | None = None
    boundary: np.ndarray | None = None  # boundary: the items it evaluated on (indices into the discovery items)

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
        return self.per_item.sum(axis=0)  # bf16, boundary: the gain count (on the items evaluated)

    def _keys(self) -> list[np.ndarray]:
        """Sort keys, most significant first, smaller first."""
        primary = -self.scores()
        if self.method == "attribution-flips":
            return [primary, -self.per_item.mean(axis=0)]
        if self.method in ("bf16", "boundary"):
            harm = (self.per_item < 0).sum(axis=0)  # fewer harmed items first, as the paper's key
            keys = [primary, harm]
            if self.method == "boundary":  # candidates first; the rest in the order of the screen that chose them
                keys = [~self.evaluated, *keys, self.prior_rank]
            return keys
        return [primary]

    def order(self) -> list[HeadId]:
        """Every head, most promising first; ties in (layer, head) order (lexsort is stable)."""
        return [self.heads[i] for i in np.lexsort(self._keys()[::-1])]

    def top(self, m: int, candidates: list[HeadId] | None = None) -> list[HeadId]:
        """The screen's best ``m`` heads (among ``candidates`` when given)."""
        allowed = None if candidates is None else set(candidates)
        return [h for h in self.order() if allowed is None or h in allowed][:m]

    def to_json(self, keep: int) -> dict:
        """What the artifact records: the method, m, the cost and every head's score as a [layers, heads] grid."""
        n_heads = max(h.head for h in self.heads) + 1
        out = {"method": "screened", "screen": self.method, "keep": keep, "n_heads": len(self.heads),
               "forward_equivalents": self.forward_equivalents, "order": [str(h) for h in self.order()],
               "scores": self.scores().reshape(-1, n_heads).tolist()}
        if self.evaluated is not None:
            out["candidates"], out["boundary_items"] = int(self.evaluated.sum()), len(self.boundary)
        return out


def _estimated_flips(per_item: np.ndarray, margins: np.ndarray) -> np.ndarray:
    """Per head: items whose margin the estimate moves from below zero to above, minus those moved the other way."""
    after = margins[:, None] + per_item
    return ((margins[:, None] <= 0) & (after > 0)).sum(axis=0) - ((margins[:, None] > 0) & (after <= 0)).sum(axis=0)


def run_screen(method: str, discovery: EvaluatorProtocol, *, candidates: int = 80, items: int = 16) -> Screen:
    """Screen every head of the discovery evaluator's model on all its items. ``discovery``: any evaluator (e.g. the
    run's OutcomeTable); each screen computes on its siblings (:meth:`EvaluatorProtocol.sibling`: its settings, plain,
    fp32's under the guarded precision, so exact decisions), the bf16 screen on a bfloat16 copy of the model.
    ``candidates`` and ``items`` are the boundary screen's."""
    if method not in SCREENS:
        raise ValueError(f"unknown screen {method!r}: choose from {', '.join(SCREENS)}")
    heads = discovery.lm.geometry.all_heads()
    start = time.perf_counter()
    if method == "bf16":
        screen = _bf16_screen(discovery, heads)
    else:
        attribution = "attribution" if method == "attribution" else "attribution-flips"
        screen = _attribution_screen(attribution, discovery, heads)
        if method == "boundary":
            screen = _boundary_screen(screen, discovery, candidates, items)
    screen.seconds = time.perf_counter() - start
    return screen


def _attribution_screen(method: str, discovery: EvaluatorProtocol, heads: list[HeadId]) -> Screen:
    from cel_utils.search.attribution import head_attributions

    if method == "attribution-flips" and not discovery.kind.loglikelihood:
        raise ValueError(f"the attribution-flips and boundary screens count decisions; {discovery.task.name} is "
                         "decided by running code: use the attribution screen (it attributes the reference's "
                         "likelihood)")
    # on a plain evaluator: attribution reads its prompt settings (for MBPP's reference solutions) and its model
    attribution = head_attributions(discovery.sibling())
    return Screen(method, heads, attribution.per_item.reshape(len(attribution.per_item), -1), attribution.full_margins,
                  attribution.forward_equivalents)


def _boundary_screen(flips: Screen, discovery: EvaluatorProtocol, candidates: int, items: int) -> Screen:
    """The top ``candidates`` of ``flips``, evaluated exactly on the ``items`` items with the smallest |margin|."""
    order = flips.order()
    chosen = order[:candidates]
    # rounded, so that float noise in the margins cannot reorder two items the same distance from the boundary
    near = np.sort(np.argsort(np.round(np.abs(flips.full_margins), 6), kind="stable")[:items])
    sub = discovery.sibling([discovery.items[i] for i in near])
    gains, cost = _single_head_gains(sub, chosen, f"boundary screen: {len(chosen)} heads x {len(near)} items")
    index = {h: j for j, h in enumerate(flips.heads)}
    columns = [index[h] for h in chosen]
    per_item = np.zeros_like(flips.per_item, dtype=int)
    per_item[np.ix_(near, columns)] = gains
    evaluated = np.zeros(len(flips.heads), dtype=bool)
    evaluated[columns] = True
    prior = np.empty(len(order), dtype=int)
    prior[[index[h] for h in order]] = np.arange(len(order))
    return Screen("boundary", flips.heads, per_item, flips.full_margins, flips.forward_equivalents + cost,
                  evaluated=evaluated, prior_rank=prior, boundary=near)


def _bf16_screen(discovery: EvaluatorProtocol, heads: list[HeadId]) -> Screen:
    import copy
    import warnings

    import torch

    from cel_utils.hardware import bf16_is_slow, bf16_time_ratio, device_name, native_bf16

    device = discovery.lm.device
    ratio = bf16_time_ratio(str(device))  # measured here: the screen's cost in float32 forwards follows from it
    # Warned by the measured ratio, not the flags: an Intel Xeon listing avx512_bf16 without AMX took 1.6-1.7x float32's
    # time for a bf16 matmul (book/speed.md, "CPUs, numerics and bf16").
    if bf16_is_slow(device):
        which = "whose bf16 units are no faster than float32" if native_bf16(device) else "which has no bf16 units"
        warnings.warn(f"the bf16 screen runs on {device_name(device)}, {which}: a bf16 matmul took {ratio:.1f}x "
                      "float32's time here, so this screen costs more than exact float32 stage 1; the attribution and "
                      "boundary screens are the cheap ones on this machine", stacklevel=3)
    lm = dataclasses.replace(discovery.lm, model=copy.deepcopy(discovery.lm.model).to(torch.bfloat16))
    per_item, cost = _single_head_gains(discovery.sibling(lm=lm, with_store=False), heads,
                                        f"bf16 screen: {len(heads)} heads")
    return Screen("bf16", heads, per_item, None, cost * ratio)


def _single_head_gains(evaluator, heads: list[HeadId], desc: str) -> tuple[np.ndarray, float]:
    """Each head ablated alone, exactly, on the evaluator's items: ablated minus full correctness per item
    [items, heads], and the cost in forward-equivalents (the full pass, then each head from its own layer on)."""
    outcomes = evaluator.evaluate([()] + [(h,) for h in heads], desc=desc)
    full = outcomes[0].correct.astype(int)
    gains = np.stack([o.correct.astype(int) - full for o in outcomes[1:]], axis=1)
    n_layers = evaluator.lm.geometry.n_layers
    return gains, len(full) * (1 + sum(n_layers - h.layer for h in heads) / n_layers)

