"""Which discovery items each head set the search scored flipped, with the items' text and what both models answered.

Stored in the artifact (section ``discovery_flips``) while the outcomes are in memory, so that a run page lists them
when a reader clicks a head of the stage-1 heat map or a set of the stage-2 table (:mod:`cel_utils.book.interactive`),
with no model, no data and no kernel. Each item's text is stored once, however many sets flipped it::

    {"items": {"<discovery index>": {"item": id, "prompt_end": ..., "gold": ..., "answers": [shown, ...], "full": a}},
     "sets": {"L3.H1": {"help": {"<discovery index>": a, ...}, "harm": {...}}, "L3.H1+L5.H0": {...}}}

``answers`` are the distinct answers the full model and the sets gave on the item, as the run page shows them
(:data:`cel_utils.evaluation.kinds.TaskKind.show`); ``full`` and each ``a`` index into them. A teacher-forced task
(arithmetic) predicts nothing: there ``answers`` is null and every ``a`` too, and a flip says right or wrong only.
"""
from __future__ import annotations

from cel_utils.evaluation.kinds import kind_of
from cel_utils.evaluation.outcomes import OutcomeTable
from cel_utils.models.heads import format_heads
from cel_utils.pipeline.examples import prompt_end
from cel_utils.search.algorithm import SearchResult
from cel_utils.tasks.splits import TaskData


def discovery_flips(data: TaskData, table: OutcomeTable, search: SearchResult) -> dict:
    """The ``discovery_flips`` section: every set of stage 1 and stage 2 (as ranked), its helped (wrong -> right) and
    harmed (right -> wrong) discovery items, and those items' text and answers."""
    task, kind, full = data.task, kind_of(data.task), search.full
    items: dict[int, dict] = {}

    def shown_at(i: int, prediction) -> int:
        """Where ``prediction``, as the page shows it, is in item ``i``'s answers (added when new)."""
        answers, shown = items[i]["answers"], kind.show(task, data.discovery[i].doc, prediction)
        if shown not in answers:
            answers.append(shown)
        return answers.index(shown)

    def flip(i: int, prediction) -> int | None:
        if i not in items:
            doc = data.discovery[i].doc
            items[i] = {"item": data.discovery[i].id, "prompt_end": prompt_end(task.doc_to_text(doc)),
                        "gold": kind.show_gold(task, doc), "answers": [] if kind.predicts else None, "full": None}
            if kind.predicts:
                items[i]["full"] = shown_at(i, full.predictions[i])
        return shown_at(i, prediction) if kind.predicts else None

    sets = {}
    for score in search.stage1 + [s for s in search.stage2 if len(s.heads) > 1]:  # stage 2's singles are stage 1's
        outcome = table.outcomes[score.heads]
        flipped = {"help": (~full.correct & outcome.correct).nonzero()[0],
                   "harm": (full.correct & ~outcome.correct).nonzero()[0]}
        sets[format_heads(score.heads)] = {
            direction: {str(i): flip(i, outcome.predictions[i] if kind.predicts else None) for i in map(int, indices)}
            for direction, indices in flipped.items()}
    return {"items": {str(i): items[i] for i in sorted(items)}, "sets": sets}
