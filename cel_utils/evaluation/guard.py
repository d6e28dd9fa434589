"""The evidence about bf16's error in one guarded run (:class:`Guard`): the audit, the guard band, the rechecks and the
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


# --- the guard -------------------------------------------------------------------------------------------------

Pair = tuple[int, int]  # (intervention index, item index) within one call


@dataclasses.dataclass
class Guard:
    """The evidence about bf16's error in one run, shared by the run's evaluators, and what it decided.

    One band per run: each run's guard sees one task. Scaling the band by what might drive the error did not narrow it
    on the default model: the answer's token count or the context's length (the share of pairs inside a 2x band stayed
    23-30%, or grew), each item's own full-model error (38-84%), the number of layers computed in bf16 (HellaSwag, 24
    items x 40 heads: 28% -> 26%); even each item's own largest error, known in advance, would leave 22%."""

    multiple: float = SAFETY_MULTIPLE
    audit_pairs: int = AUDIT_PAIRS
    audit_share: float = AUDIT_SHARE
    seed: int = 0
    largest_error: float | None = None  # the largest margin error seen; None before the first audit
    pairs: int = 0  # (item, intervention) pairs decided under the guard
    rechecked: int = 0  # of them, inside the band: recomputed in fp32
    audited: int = 0  # of them, outside the band but computed in fp32 too, as evidence
    caught: int = 0  # rechecked pairs whose bf16 decision differed from fp32's (plain bf16 would have got them wrong)
    differed: int = 0  # audited pairs outside the band whose decisions differed: the band was wrong
    fell_back: str | None = None  # why the run went on in fp32, if it did
    fp32_pairs: int = 0  # pairs computed in fp32 alone after the fall-back

    def __post_init__(self):
        self.rng = np.random.default_rng(self.seed)

    @property
    def band(self) -> float:
        return self.multiple * (self.largest_error or 0.0)

    def see(self, error: float) -> None:
        self.largest_error = max(self.largest_error or 0.0, error)

    def check(self, margins: np.ndarray, recheck: Callable[[list[Pair]], list[float]], differs: Callable[[Pair], bool],
              exact_rows: Sequence[int] = ()) -> list[Pair]:
        """One call's (intervention, item) pairs under the guard: audit, recheck inside the band, count.

        ``margins[u, i]`` is the fast pass's decision margin; ``recheck(pairs)`` computes those pairs in fp32 (the caller
        keeps the values, which replace the fast ones) and returns each one's margin error; ``differs(pair)`` says
        whether a pair computed in fp32 was decided otherwise by the fast pass; ``exact_rows`` are interventions whose
        fast numbers are fp32's own (neither audited nor rechecked). Returns the audited pairs outside the band that
        were decided otherwise: if any, the evidence was wrong, the call must be fp32's (:meth:`fall_back`)."""
        margins = np.array(margins, dtype=float)
        margins[list(exact_rows)] = np.inf
        done: set = set()

        def compute(todo: list[Pair]) -> None:
            todo = [pair for pair in todo if pair not in done]
            for pair, error in zip(todo, recheck(todo)):
                done.add(pair)
                self.see(error)

        if self.largest_error is None:  # the first audit: before bf16 is trusted
            open_pairs = [(u, i) for u, i in np.ndindex(*margins.shape) if u not in exact_rows]
            sample = self.rng.choice(len(open_pairs), min(len(open_pairs), self.audit_pairs), replace=False)
            compute([open_pairs[j] for j in sorted(sample)])
        outside = np.ones(margins.shape, bool)
        audit: set = set()
        while True:  # a larger error seen widens the band: recheck what it takes in, until it holds
            inside = margins <= self.band
            todo = [(int(u), int(i)) for u, i in zip(*np.nonzero(inside & outside))]
            outside &= ~inside
            candidates = [(int(u), int(i)) for u, i in zip(*np.nonzero(outside))
                          if (u, i) not in done and u not in exact_rows]
            picked = self.rng.random(len(candidates)) < self.audit_share if candidates else []
            audit.update(pair for pair, chosen in zip(candidates, picked) if chosen)
            before = self.band
            compute(todo + sorted(audit))
            if self.band <= before:
                break
        inside_pairs = [pair for pair in done if not outside[pair]]
        outside_pairs = [pair for pair in done if outside[pair]]
        self.pairs += margins.size
        self.rechecked += len(inside_pairs)
        self.audited += len(outside_pairs)
        self.caught += sum(differs(pair) for pair in inside_pairs)
        differing = sorted(pair for pair in outside_pairs if differs(pair))
        self.differed += len(differing)
        return differing

    def fall_back(self, reason: str, pairs: int) -> None:
        """The evidence was wrong: the call of ``pairs`` pairs and every later one are computed in fp32."""
        self.fell_back = f"{reason}; the rest of the run is computed in fp32"
        warnings.warn(self.fell_back, RuntimeWarning, stacklevel=4)  # at the caller of GuardedEvaluator.evaluate
        self.pairs -= pairs  # this call is fp32's after all
        self.fp32_pairs += pairs

    def to_json(self) -> dict:
        return {"multiple": self.multiple, "band": self.band, "largest_error": self.largest_error,
                "initial_audit_pairs": self.audit_pairs, "audit_share": self.audit_share, "pairs": self.pairs,
                "rechecked": self.rechecked, "share_rechecked": self.rechecked / self.pairs if self.pairs else None,
                "audited": self.audited, "bf16_decisions_caught": self.caught,
                "audited_decisions_differed": self.differed, "fell_back_to_fp32": self.fell_back,
                "pairs_after_fall_back": self.fp32_pairs}
