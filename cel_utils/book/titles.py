"""The one title of a run: ``model on task (seed N)``, in the page's heading and in the table of contents.

Jupyter Book takes a page's title from its first Markdown heading; a heading *displayed* by a code cell is not one
(myst-nb renders outputs inside the page, and warns), so the runner writes it into the notebook's title cell.
"""
from __future__ import annotations

import os
from pathlib import Path

TITLE_PREFIX = "# CEL run"


def run_title(stem: str) -> str:
    """``'smollm2-135m-instruct__boolq__seed0'`` -> ``'smollm2-135m-instruct on boolq (seed 0)'``."""
    parts = stem.rsplit("__", 2)
    if len(parts) != 3 or not parts[2].startswith("seed"):
        return stem
    model, task, seed = parts
    return f"{model} on {task} (seed {seed.removeprefix('seed')})"


def retitle(path: str | os.PathLike, stem: str | None = None) -> bool:
    """Make an executed run notebook's title cell read ``# CEL run: <run_title>`` (idempotent); ``stem`` defaults to
    the file's. Returns whether the notebook changed."""
    import nbformat

    from cel_utils.paths import atomic_write

    path = Path(path)
    nb = nbformat.read(path, as_version=4)
    heading = f"{TITLE_PREFIX}: {run_title(stem or path.stem)}"
    for cell in nb.cells:
        if cell.cell_type == "markdown" and cell.source.startswith(TITLE_PREFIX):
            lines = cell.source.split("\n")
            if lines[0] == heading:
                return False
            cell.source = "\n".join([heading] + lines[1:])
            break
    else:
        nb.cells.insert(0, nbformat.v4.new_markdown_cell(heading))
    atomic_write(path, nbformat.writes(nb))
    return True
