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

from cel_utils.book.claims import primary_family, run_key, second_look
from cel_utils.book.run_page import key_result, run_stem
from cel_utils.book.titles import TITLE_PREFIX
from cel_utils.paths import atomic_write
from cel_utils.pipeline.artifacts import load_artifacts

TAG = "cel-key-result"


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
