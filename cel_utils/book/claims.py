"""The book's tests as families, from the artifacts a page is built from (:mod:`cel_utils.stats.multiplicity`).

* The **primary family**: every run's holdout test on the page (one per model x task x seed shown); a page built from
  one artifact is a family of one, and so is a run page executed alone.
* One **transfer family** per model (and seed): its matrix's off-diagonal cells.

Everything here is computed from the stored per-item outcomes, so the adjusted numbers of any set of artifacts can be
recomputed by anyone who has them (book/reading_group.md has it as an exercise).
"""
from __future__ import annotations

import json
from pathlib import Path

from cel_utils.pipeline.schema import RunArtifact, TransferArtifact
from cel_utils.stats.multiplicity import Adjusted, adjust_family, noninferiority

PRIMARY = "the primary verdicts"
FIRST_LOOKS = Path(__file__).resolve().parents[2] / "data" / "first_looks.json"


def run_key(artifact: RunArtifact) -> tuple[str, str, int]:
    return artifact["model"]["name"], artifact["task"]["name"], int(artifact["config"]["seed"])


def primary_family(artifacts: list[RunArtifact]) -> dict[tuple[str, str, int], Adjusted]:
    """Each run's test adjusted among all the runs given (Holm; Bonferroni intervals). Runs without per-item outcomes
    (artifacts older than the paired test) are left out of the family and of the result."""
    tested = [a for a in artifacts if a["holdout"]["full_correct"] is not None]
    m = len(tested)
    name = f"{PRIMARY}, {m} run{'s' if m != 1 else ''}"
    adjusted = adjust_family(name, [(a["holdout"]["full_correct"], a["holdout"]["ablated_correct"],
                                     int(a["config"]["seed"])) for a in tested])
    return {run_key(a): adj for a, adj in zip(tested, adjusted)}


def transfer_family(transfer: TransferArtifact) -> dict[tuple[str, str], dict]:
    """Per off-diagonal cell of one model's matrix: its :class:`Adjusted` (as JSON) among the matrix's off-diagonal
    cells, and its non-inferiority against the margin, one-sided at the family's level."""
    cells = [c for c in transfer["cells"] if not c["diagonal"]]
    m = len(cells)
    name = f"{transfer['model']['name']}'s transfer cells, {m} tests"
    seed = int(transfer["seed"])
    adjusted = adjust_family(name, [(c["full_correct"], c["ablated_correct"], seed) for c in cells])
    return {(c["source"], c["target"]): {"adjusted": adj.to_json(),
                                         "noninferiority": noninferiority(c["full_correct"], c["ablated_correct"],
                                                                          m=m, seed=seed)}
            for c, adj in zip(cells, adjusted)}


def first_looks(path: Path = FIRST_LOOKS) -> list[dict]:
    """The results of holdouts that were scored before a later sizing change (data/first_looks.json): the runs whose
    book verdict is a second look at the same pool. Each record names the run (model, task, seed) and its first
    result."""
    if not Path(path).is_file():
        return []
    return json.loads(Path(path).read_text(encoding="utf-8"))["first_looks"]


def second_look(artifact: RunArtifact, looks: list[dict] | None = None) -> dict | None:
    """The first look of this run, when its holdout had been scored before (None: a single look)."""
    model, task, seed = run_key(artifact)
    looks = first_looks() if looks is None else looks
    return next((r for r in looks if (r["model"], r["task"], r["seed"]) == (model, task, seed)), None)
