"""Load task data from the Hugging Face hub or from a local mirror directory, with provenance.

A local mirror is a folder laid out like ``shared/data`` (one sub-folder per dataset, HF dataset cards
declaring configs and splits), so ``datasets.load_dataset(f"{data_dir}/{sub}", config)`` returns exactly the
hub schema. The directory comes from the ``data_dir`` argument, else ``$CEL_DATA_DIR``; without either,
rows come from the hub. Every loader returns the rows *and* a provenance record that ends up in the
result artifact, so a reader can always tell hub data, mirror data and generated data apart.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

_HUB_UNREACHABLE: list[str] = []  # remembered per process: each failed hub call costs ~20 s of retries


class SplitUnavailable(LookupError):
    """The requested split does not exist in this source (e.g. BoolQ train in the local mirror)."""


@dataclass(frozen=True)
class Source:
    hub_id: str  # e.g. "google/boolq"
    mirror_subdir: str  # folder name inside a local mirror, e.g. "boolq"


def resolve_data_dir(data_dir: str | os.PathLike | None) -> Path | None:
    """The mirror directory to use (argument, else $CEL_DATA_DIR), checked to exist; None means the hub."""
    chosen = data_dir if data_dir not in (None, "") else os.environ.get("CEL_DATA_DIR") or None
    if chosen is None:
        return None
    path = Path(chosen).expanduser()
    if not path.is_dir():
        origin = "data_dir" if data_dir not in (None, "") else "$CEL_DATA_DIR"
        raise FileNotFoundError(
            f"{origin} {str(chosen)!r} does not exist or is not a directory: point it at a local mirror laid out "
            "like shared/data (one folder per dataset), or leave it empty to load from the Hugging Face hub"
        )
    return path.resolve()


def load_split(source: Source, config: str | None, split: str, data_dir: str | os.PathLike | None = None
               ) -> tuple[list[dict], dict]:
    """Rows of one split as plain dicts, and where they came from.

    Raises :class:`SplitUnavailable` when the source exists but lacks the split, and ``ConnectionError``
    when the hub cannot be reached.
    """
    import datasets

    mirror = resolve_data_dir(data_dir)
    if mirror is not None:
        folder = mirror / source.mirror_subdir
        if not folder.is_dir():
            raise FileNotFoundError(f"local mirror {mirror} has no folder {source.mirror_subdir!r} for {source.hub_id}: "
                                    "add it (laid out like shared/data), point data_dir at a mirror that has it, or "
                                    "leave data_dir empty to load from the Hugging Face hub")
        try:
            dataset = datasets.load_dataset(str(folder), config, split=split)
        except ValueError as error:
            if "Unknown split" in str(error):
                raise SplitUnavailable(f"{split!r} split of {source.hub_id} is not in the local mirror {folder}") from None
            raise
        except datasets.exceptions.DatasetGenerationError as error:  # e.g. a field whose type changes between rows
            raise ValueError(f"cannot read the {split!r} split of {source.hub_id} in the local mirror {folder} "
                             f"({error.__cause__ or error}): fix the malformed rows (every row needs the same fields "
                             "with the same types as the Hugging Face dataset)") from None
        provenance = {"source": "mirror", "path": str(folder), "dataset": source.hub_id, "config": config, "split": split}
    else:
        if _HUB_UNREACHABLE:
            raise ConnectionError(_HUB_UNREACHABLE[0])
        try:
            dataset = datasets.load_dataset(source.hub_id, config, split=split)
        except ValueError as error:
            if "Unknown split" in str(error):
                raise SplitUnavailable(f"{split!r} split of {source.hub_id} is not on the hub") from None
            raise
        except (ConnectionError, OSError) as error:
            message = (f"cannot reach {source.hub_id} on the Hugging Face hub ({error}); pass data_dir= or set "
                       "CEL_DATA_DIR to a local mirror")
            _HUB_UNREACHABLE.append(message)
            raise ConnectionError(message) from error
        provenance = {"source": "hub", "dataset": source.hub_id, "config": config, "split": split,
                      "fingerprint": getattr(dataset, "_fingerprint", None)}
    rows = [dict(row) for row in dataset]
    provenance["rows"] = len(rows)
    return rows, provenance
