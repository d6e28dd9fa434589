"""Fake evaluators shared by the search, statistics and strategies tests (no model involved)."""
from types import SimpleNamespace

import numpy as np

from cel_utils.models.heads import HeadGeometry, head_set
from cel_utils.tasks.scoring import Outcome

GEOMETRY = HeadGeometry(n_layers=4, n_heads=3, n_kv_heads=3, head_dim=8)


class XorEvaluator:
    """Item i is correct under an intervention iff base[i] XOR the heads' flip masks; margins are +-1, shifted
    by a per-head amount when ``shifts`` gives one; records every call."""

    def __init__(self, base, flips, shifts=None, geometry=GEOMETRY, first_item: int = 0, indices=None):
        """``indices``: the items' numbers (ids ``i{j}``), default ``first_item`` onwards."""
        self.lm = SimpleNamespace(geometry=geometry)
        self.base, self.flips, self.shifts, self.calls = np.asarray(base, bool), flips, shifts or {}, []
        numbers = range(first_item, first_item + len(self.base)) if indices is None else indices
        self.items = [SimpleNamespace(id=f"i{j}") for j in numbers]

    def evaluate(self, interventions, desc=None):
        interventions = [head_set(i) for i in interventions]
        self.calls.append(interventions)
        out, ids = [], [item.id for item in self.items]
        for heads in interventions:
            correct = self.base.copy()
            for head in heads:
                correct ^= self.flips.get(head, np.zeros_like(self.base))
            margin = np.where(correct, 1.0, -1.0) + sum(self.shifts.get(h, 0.0) for h in heads)
            out.append(Outcome(item_ids=list(ids), correct=correct, margin=margin,
                               metrics={"acc": correct.copy()}))
        return out
