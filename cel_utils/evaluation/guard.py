"""The evidence about bf16's error in one guarded run (:class:`Guard`): the audit, the guard bands, the rechecks and the
fall-back, shared by the log-likelihood guard (:mod:`cel_utils.evaluation.guarded`) and the decoding guard
(:mod:`cel_utils.evaluation.guarded_generation`), which is why it sits in a module of its own.
"""
from __future__ import annotations

import dataclasses
import warnings
from typing import Callable, Sequence

import numpy as np

# The stated safety multiple: the band is this many times the largest error the audit saw (per unit of error scale).
SAFETY_MULTIPLE = 2.0
AUDIT_PAIRS = 256  # pairs computed in both precisions before bf16 is trusted
AUDIT_SHARE = 0.02  # of the pairs outside the band, in every later call
# The log-likelihood guard's bands: one per third of the layers, by the intervention's first ablated layer (the fast
# pass computes the layers from there up in bf16). A third's band is its own once this many of its pairs were computed
# in both precisions; until then it is the run's widest (multiple x the largest error seen anywhere).
DEPTH_GROUPS = 3
GROUP_EVIDENCE = 32


# --- the guard -------------------------------------------------------------------------------------------------

Pair = tuple[int, int]  # (intervention index, item index) within one call


def depth_group(first_layer: int, n_layers: int, groups: int = DEPTH_GROUPS) -> int:
    """The third (of ``groups`` equal parts) of the layers where an intervention's first ablated layer lies (0: the
    lowest, the most layers in bf16)."""
    return min(groups - 1, first_layer * groups // n_layers)


@dataclasses.dataclass
class Guard:
    """The evidence about bf16's error in one run, shared by the run's evaluators, and what it decided.

    Each run's guard sees one task. A pair's band is ``multiple`` times the largest error audited among pairs whose
    intervention starts in the same third of the layers (:func:`depth_group`; the decoding guard, and a fast pass that
    is bf16 throughout, pass no depth and get the run's band). With one band per run, one unlucky pair set it for every
    pair. Replayed over 200 random first audits on 24-32 items x 24-30 interventions of each log-likelihood task
    (benchmarks/bench_guard_band.py, book/speed.md), a band per third took the share of pairs inside a 2x band from
    19.1% to 14.3% (BoolQ), 27.5% to 22.1% (HellaSwag) and 10.6% to 7.5% (3-shot arithmetic) on the default model, and
    from 5.4-11.8% to 3.1-9.0% on Gemma 3 270M. No replay left a differing decision outside a band; pairs whose error
    exceeded their band (the audit's premise broken, the decision still right) were 0.31 per replay on the default
    model's HellaSwag (0.25 with one band) and 0.36 on its arithmetic (0.02), none elsewhere: the later audits and the
    fall-back stay what makes it safe. Four or six parts narrowed it little more and let more errors past. Scaling one
    band by other predictors did not narrow it: the answer's token count or the context's length (23-30% stayed, or
    grew), each item's own full-model error (38-84%), the number of bf16 layers as a linear scale (HellaSwag, 24 items
    x 40 heads: 28% -> 26%). On the main job's own BoolQ search (the default model, 128 items x the 23 head sets its
    screen and stage 2 chose) the item explains 4% of the variance of the log error and the intervention 7%: the error
    is close to noise, heavy-tailed (median 0.036, largest 0.60), so no band per item can narrow it much (book/speed.md).
    """

    multiple: float = SAFETY_MULTIPLE
    audit_pairs: int = AUDIT_PAIRS
    audit_share: float = AUDIT_SHARE
    seed: int = 0
    largest_error: float | None = None  # the largest margin error seen; None before the first audit
    largest_by_depth: dict[int, float] = dataclasses.field(default_factory=dict)  # per depth_group
    seen_by_depth: dict[int, int] = dataclasses.field(default_factory=dict)  # errors seen per depth_group
    pairs: int = 0  # (item, intervention) pairs decided under the guard
    rechecked: int = 0  # of them, inside the band: recomputed in fp32
    audited: int = 0  # of them, outside the band but computed in fp32 too, as evidence
    caught: int = 0  # rechecked pairs whose bf16 decision differed from fp32's (plain bf16 would have got them wrong)
    differed: int = 0  # audited pairs outside the band whose decisions differed: the band was wrong
    fell_back: str | None = None  # why the run went on in fp32, if it did
    fp32_pairs: int = 0  # pairs computed in fp32 alone after the fall-back

    def __post_init__(self):
        self.rng = np.random.default_rng(self.seed)
        self.first_audit_left = self.audit_pairs  # pairs the first audit has still to compute

    @property
    def band(self) -> float:
        """The run's widest band: ``multiple`` times the largest error seen anywhere."""
        return self.multiple * (self.largest_error or 0.0)

    def depth_band(self, depth: int | None) -> float:
        """The band of pairs whose intervention starts in third ``depth`` of the layers (None: the run's band)."""
        if depth is None or self.seen_by_depth.get(depth, 0) < GROUP_EVIDENCE:
            return self.band
        return self.multiple * self.largest_by_depth[depth]

    def see(self, error: float, depth: int | None = None) -> None:
        self.largest_error = max(self.largest_error or 0.0, error)
        if depth is not None:
            self.largest_by_depth[depth] = max(self.largest_by_depth.get(depth, 0.0), error)
            self.seen_by_depth[depth] = self.seen_by_depth.get(depth, 0) + 1

    def call(self, shape: tuple[int, int], exact_rows: Sequence[int] = (),
             depths: Sequence[int | None] | None = None) -> "CallCheck":
        """The guard over one call's ``shape`` = (interventions, items) pairs, taken a part at a time (:class:`CallCheck`);
        ``exact_rows`` are interventions whose fast numbers are fp32's own (neither audited nor rechecked); ``depths``
        each intervention's :func:`depth_group` (None: the run's band for all)."""
        return CallCheck(self, shape, frozenset(exact_rows), depths)

    def check(self, margins: np.ndarray, recheck: Callable[[list[Pair]], list[float]], differs: Callable[[Pair], bool],
              exact_rows: Sequence[int] = (), depths: Sequence[int | None] | None = None) -> list[Pair]:
        """One call's pairs under the guard all at once: :meth:`CallCheck.part` over every pair, then
        :meth:`CallCheck.finish` (the arguments are theirs)."""
        margins = np.asarray(margins, dtype=float)
        check = self.call(margins.shape, exact_rows, depths)
        pairs = [(int(u), int(i)) for u, i in np.ndindex(*margins.shape)]
        check.part(pairs, [margins[pair] for pair in pairs], recheck)
        return check.finish(recheck, differs)

    def fall_back(self, reason: str, pairs: int) -> None:
        """The evidence was wrong: the call of ``pairs`` pairs and every later one are computed in fp32."""
        self.fell_back = f"{reason}; the rest of the run is computed in fp32"
        warnings.warn(self.fell_back, RuntimeWarning, stacklevel=4)  # at the caller of GuardedEvaluator.evaluate
        self.pairs -= pairs  # this call is fp32's after all
        self.fp32_pairs += pairs

    def to_json(self) -> dict:
        return {"multiple": self.multiple, "band": self.band, "largest_error": self.largest_error,
                "depth_bands": [self.depth_band(d) for d in range(DEPTH_GROUPS)] if self.seen_by_depth else None,
                "depth_evidence": [self.seen_by_depth.get(d, 0) for d in range(DEPTH_GROUPS)] if self.seen_by_depth
                else None, "group_evidence": GROUP_EVIDENCE,
                "initial_audit_pairs": self.audit_pairs, "audit_share": self.audit_share, "pairs": self.pairs,
                "rechecked": self.rechecked, "share_rechecked": self.rechecked / self.pairs if self.pairs else None,
                "audited": self.audited, "bf16_decisions_caught": self.caught,
                "audited_decisions_differed": self.differed, "fell_back_to_fp32": self.fell_back,
                "pairs_after_fall_back": self.fp32_pairs}


class CallCheck:
    """One call's (intervention, item) pairs under the guard, a part at a time: the fast engine hands each batch's pairs
    over while it still holds the batch's clean pass, so the pairs it must recompute in fp32 run stacked from the kept
    states, at the cost of a stacked fp32 pair (:mod:`cel_utils.evaluation.guarded`).

    Each part is audited and rechecked against the band as it stands (:meth:`part`); a band widened by a later part
    takes in pairs of earlier parts, which :meth:`finish` rechecks (without a held pass) before it counts. So every pair
    inside the final band is fp32's, as if the call had been checked whole. The first audit (``Guard.audit_pairs``
    random pairs before bf16 is trusted) is drawn from the whole call's pairs, and each part computes its share: drawn
    from the first parts alone, it would hold only the longest items (the engine's batches come longest first), and
    each of its pairs would cost 2.7x an average one (BoolQ, 64 items x 21 interventions)."""

    def __init__(self, guard: Guard, shape: tuple[int, int], exact_rows: frozenset[int],
                 depths: Sequence[int | None] | None = None):
        self.guard, self.exact_rows = guard, exact_rows
        self.depths = list(depths) if depths is not None else [None] * shape[0]
        if len(self.depths) != shape[0]:
            raise ValueError(f"the guard's call has {shape[0]} interventions but {len(self.depths)} depths")
        self.margins = np.full(shape, np.nan)  # the fast pass's; NaN until its part came
        self.done: set[Pair] = set()  # computed in fp32 too
        self.sample: set[Pair] = set()  # the first audit's pairs in this call, computed as their parts come
        if guard.first_audit_left:
            open_pairs = [(u, i) for u, i in np.ndindex(*shape) if u not in exact_rows]
            sample = guard.rng.choice(len(open_pairs), min(len(open_pairs), guard.first_audit_left), replace=False)
            guard.first_audit_left -= len(sample)
            self.sample = {open_pairs[j] for j in sample}

    def bands(self) -> np.ndarray:
        """Each intervention's band as the evidence stands."""
        return np.array([self.guard.depth_band(depth) for depth in self.depths])

    def band(self, row: int) -> float:
        return self.guard.depth_band(self.depths[row])

    def _compute(self, todo: list[Pair], recheck: Callable[[list[Pair]], list[float]]) -> None:
        todo = [pair for pair in todo if pair not in self.done]
        if todo:
            for pair, error in zip(todo, recheck(todo)):
                self.done.add(pair)
                self.guard.see(error, self.depths[pair[0]])

    def part(self, pairs: Sequence[Pair], margins: Sequence[float], recheck: Callable[[list[Pair]], list[float]]) -> None:
        """``pairs`` whose fast ``margins`` just came: audit them, then recheck those inside their band (until the bands
        hold).

        ``recheck(pairs)`` computes pairs in fp32 (the caller keeps the values, which replace the fast ones) and
        returns each one's margin error."""
        guard = self.guard
        for pair, margin in zip(pairs, margins):
            self.margins[pair] = np.inf if pair[0] in self.exact_rows else margin
        open_pairs = [pair for pair in pairs if pair[0] not in self.exact_rows]
        todo = [pair for pair in open_pairs if pair in self.sample]  # the first audit's share
        drawn: set = set()  # each pair outside the band has one chance to be audited
        while True:  # a larger error seen widens a band: recheck what it takes in, until the bands hold
            bands = self.bands()
            todo += [pair for pair in open_pairs if self.margins[pair] <= bands[pair[0]]]
            fresh = [pair for pair in open_pairs
                     if self.margins[pair] > bands[pair[0]] and pair not in self.done and pair not in drawn]
            drawn.update(fresh)
            picked = guard.rng.random(len(fresh)) < guard.audit_share if fresh else []
            # one recomputation for all of them: its forwards stack more rows
            self._compute(list(dict.fromkeys(todo + [pair for pair, chosen in zip(fresh, picked) if chosen])), recheck)
            todo = []
            if (self.bands() <= bands).all():
                break

    def finish(self, recheck: Callable[[list[Pair]], list[float]], differs: Callable[[Pair], bool]) -> list[Pair]:
        """After the last part: recheck what a band widened since takes in, and count. ``differs(pair)`` says whether a
        pair computed in fp32 was decided otherwise by the fast pass. Returns the pairs outside the band, computed in
        fp32 as evidence, that were decided otherwise: if any, the evidence was wrong and the call must be fp32's
        (:meth:`Guard.fall_back`)."""
        guard, margins = self.guard, self.margins
        if np.isnan(margins).any():
            raise RuntimeError("the guard's call finished with pairs whose fast margins never came")
        while True:
            bands = self.bands()
            self._compute([(int(u), int(i)) for u, i in zip(*np.nonzero(margins <= bands[:, None]))], recheck)
            if (self.bands() <= bands).all():
                break
        inside = [pair for pair in self.done if margins[pair] <= bands[pair[0]]]
        outside = [pair for pair in self.done if margins[pair] > bands[pair[0]]]
        guard.pairs += margins.size
        guard.rechecked += len(inside)
        guard.audited += len(outside)
        guard.caught += sum(differs(pair) for pair in inside)
        differing = sorted(pair for pair in outside if differs(pair))
        guard.differed += len(differing)
        return differing
