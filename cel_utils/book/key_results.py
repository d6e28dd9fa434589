"""Each run page's key result, written at the top of its executed notebook when the book is built.

A run page is executed once, by its grid cell, before the other runs exist; its verdict there is that of a family of
one. When the book is assembled, every run's test is placed among all the runs the book shows
(:func:`cel_utils.book.claims.primary_family`), and a box with the key result (full -> ablated, the floor, the verdict
with its family-adjusted p, the heads, the control) goes right under the page's title, before the parameters. The box is
a Markdown cell tagged :data:`TAG`, replaced on every build (idempotent), never executed: the numbers are the
artifact's, as on the rest of the page.
"""
from __future__ import annotations

from pathlib import Path

from cel_utils.book.baselines import floor_rows
from cel_utils.book.claims import primary_family, run_key, second_look
from cel_utils.book.run_page import run_stem, significance, verdict_of, verdict_word
from cel_utils.book.text import ci_text, p_text, transition_text
from cel_utils.book.titles import TITLE_PREFIX
from cel_utils.paths import atomic_write
from cel_utils.pipeline.artifacts import load_artifacts
from cel_utils.pipeline.schema import RunArtifact

TAG = "cel-key-result"


def key_result(artifact: RunArtifact, family: dict | None = None, second: dict | None = None) -> str:
    """The run's key result as a MyST admonition, for the top of its page: full -> ablated with the floor beside it,
    the verdict's kind, the heads, the control; ``family`` as for :func:`~cel_utils.book.run_page.verdict_of`; ``second``: the first look of
    a holdout scored twice (:func:`cel_utils.book.claims.second_look`)."""
    h = artifact["holdout"]
    found = verdict_of(artifact, family) or {"kind": "n/a", "text": "no paired test stored", "at_floor": False}
    floors = floor_rows(artifact)
    floor = max(floors, key=lambda r: r[1]) if floors else None
    sig = significance(artifact)
    lines = [f"**{h['heads_label']}** ablated: {artifact['task']['metric']} "
             f"**{transition_text(h['full_accuracy'], h['ablated_accuracy'], h['gain_points'])}** on {h['n_items']} "
             "held-out items"]
    if floor:
        lines.append(f"floor: {floor[0]} scores {100 * floor[1]:.1f}%" + (" (the full model is at its floor)"
                                                                            if found.get("at_floor") else ""))
    if sig:
        p_line = f"{ci_text(sig)}"
        if family and family["m"] > 1:
            p_line += (f"; among the book's {family['m']} primary tests: Holm p = {p_text(family['p_adjusted'])}, "
                       f"family-adjusted CI [{family['ci_low']:+.1f}, {family['ci_high']:+.1f}]")
        lines.append(p_line)
    lines.append(f"verdict: **{verdict_word(found)}**. In words: {found['text']}.")
    control = artifact["control"]
    if control:
        lines.append(f"control ({control['ablation']}-ablation of the same heads): "
                     f"{100 * control['accuracy']:.1f}% ({control['vs_full']['gain_points']:+.1f} points)")
    if second:
        lines.append(f"a second look: this holdout pool was scored before ({second['n_holdout']} items, "
                     f"{second['gain_points']:+.1f} points, {second['heads']})")
    return "\n".join(["```{admonition} Key result", ":class: tip", *[f"- {line}" for line in lines], "```"])


def set_key_result(notebook: Path, text: str) -> bool:
    """Put ``text`` in the notebook's key-result cell (after the title cell; created if missing). Returns whether the
    notebook changed."""
    import nbformat

    nb = nbformat.read(notebook, as_version=4)
    before = nbformat.writes(nb)
    nb.cells = [cell for cell in nb.cells if TAG not in cell.metadata.get("tags", [])]
    title = next((i for i, cell in enumerate(nb.cells)
                  if cell.cell_type == "markdown" and cell.source.startswith(TITLE_PREFIX)), -1)
    cell = nbformat.v4.new_markdown_cell(text, metadata={"tags": [TAG]})
    cell.pop("id", None)  # a fixed cell: the same notebook bytes on every build
    nb.cells.insert(title + 1, cell)
    nbformat.validator.normalize(nb)
    after = nbformat.writes(nb)
    if after != before:
        atomic_write(notebook, after)
    return after != before


def add_key_results(results_dir: Path, pages: list[Path]) -> int:
    """Write every run page's key result from the artifacts in ``results_dir``, each run adjusted among all of them.
    Returns how many pages got one (a page without an artifact keeps none)."""
    artifacts = load_artifacts(results_dir) if Path(results_dir).is_dir() else []
    family = primary_family(artifacts)
    by_stem = {run_stem(a): a for a in artifacts}
    done = 0
    for page in pages:
        artifact = by_stem.get(page.stem)
        if artifact is None:
            continue
        adjusted = family.get(run_key(artifact))
        set_key_result(page, key_result(artifact, adjusted.to_json() if adjusted else None, second_look(artifact)))
        done += 1
    return done
