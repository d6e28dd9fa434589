"""Load task data from the Hugging Face hub or from a local mirror directory, with provenance.

A local mirror is a folder laid out like ``shared/data`` (one sub-folder per dataset, HF dataset cards
declaring configs and splits), so ``datasets.load_dataset(f"{data_dir}/{sub}", config)`` returns exactly the
hub schema. The directory comes from the ``data_dir`` argument, else ``$CEL_DATA_DIR``; without either,
rows come from the hub. Every loader returns the rows *and* a provenance record that ends up in the
result artifact, so a reader can always tell hub data, mirror data and generated data apart.

A dataset as a task declaration names it (lm-eval's ``dataset_path``, ``dataset_name`` and ``dataset_kwargs``) is
loaded by :func:`load_declared`, which maps the declaration onto the mirror (:func:`mirror_candidates` says where it
looks) and, without a mirror, asks the hub.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

_HUB_UNREACHABLE: list[str] = []  # remembered per process: each failed hub call costs ~20 s of retries


class SplitUnavailable(LookupError):
    """The requested split does not exist in this source (e.g. BoolQ train in the local mirror)."""


@dataclass(frozen=True)
class Source:
    hub_id: str  # e.g. "google/boolq"
    mirror_subdir: str  # folder name inside a local mirror, e.g. "boolq"
    # A source that loads its own splits (an lm-eval task, through load_declared): (config, split, data_dir) ->
    # (rows, provenance), raising SplitUnavailable for a split it lacks. None: load_split's own loading.
    loader: Callable[[str | None, str, str | os.PathLike | None], tuple[list[dict], dict]] | None = None


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

    if source.loader is not None:
        return source.loader(config, split, data_dir)
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


# datasets' builders that read files named by ``data_files`` (lm-eval's arithmetic: ``dataset_path: json``)
FILE_BUILDERS = ("json", "csv", "parquet", "text", "arrow")


def mirror_candidates(mirror: Path, reference: str) -> list[Path]:
    """Where in ``mirror`` a dataset or a data file named by ``reference`` may lie, in the order tried: a hub id
    ``owner/name`` as ``<mirror>/owner/name`` or ``<mirror>/name``; a hub file ``hf://datasets/owner/name/dir/file`` as
    ``<mirror>/name/dir/file``, or ``<mirror>/name/raw/file`` (shared/data keeps upstream files in ``raw/``)."""
    if reference.startswith("hf://datasets/"):
        owner, name, *rest = reference.removeprefix("hf://datasets/").split("/")
        inside = "/".join(rest)
        return [mirror / name / inside, mirror / name / "raw" / Path(inside).name, mirror / owner / name / inside]
    return [mirror / reference, mirror / reference.rsplit("/", 1)[-1]]


def _mirrored_file(mirror: Path, reference: str, dataset: str) -> str:
    if "://" not in reference and Path(reference).expanduser().is_file():
        return str(Path(reference).expanduser())
    candidates = mirror_candidates(mirror, reference)
    for candidate in candidates:
        if candidate.is_file():
            return str(candidate)
    raise FileNotFoundError(f"the data file {reference} of {dataset} is not in the local mirror {mirror}: put a copy "
                            f"at {candidates[0]}, or leave data_dir and $CEL_DATA_DIR empty to load it from the hub")


def _map_files(files, mirror: Path, dataset: str):
    if isinstance(files, dict):
        return {split: _map_files(value, mirror, dataset) for split, value in files.items()}
    if isinstance(files, (list, tuple)):
        return [_mirrored_file(mirror, str(f), dataset) for f in files]
    return _mirrored_file(mirror, str(files), dataset)


def load_declared(path: str, name: str | None = None, kwargs: dict | None = None,
                  data_dir: str | os.PathLike | None = None):
    """The ``datasets.DatasetDict`` that a declaration names (``load_dataset(path, name, **kwargs)``), and its source.

    With a mirror (``data_dir``, else ``$CEL_DATA_DIR``): a file builder's ``data_files`` are mapped file by file, a hub
    id to its folder (:func:`mirror_candidates`); inside the folder, a sub-folder named like the config holds that
    config's split files (``super_glue/boolq/validation.jsonl``), else the folder's dataset card declares the config.
    Without one: the hub. Either way a dataset that cannot be had raises an error naming it and the fix.
    """
    import datasets

    kwargs = {key: value for key, value in (kwargs or {}).items() if key != "trust_remote_code"}
    label = path + (f" ({name})" if name else "")
    mirror = resolve_data_dir(data_dir)
    if mirror is None:
        if _HUB_UNREACHABLE:
            raise ConnectionError(_HUB_UNREACHABLE[0])
        try:
            dataset = datasets.load_dataset(path, name, **kwargs)
        except Exception as error:  # offline: ConnectionError, or an HTTP client's own error for hf:// files
            message = (f"cannot load {label} from the Hugging Face hub ({type(error).__name__}: {error}); pass "
                       f"data_dir= or set CEL_DATA_DIR to a local mirror that holds it (laid out like shared/data: a folder "
                       f"{path.rsplit('/', 1)[-1]!r}{f' with a sub-folder {name!r}' if name else ''} of split files)")
            if isinstance(error, (ConnectionError, OSError)) or "connect" in type(error).__name__.lower():
                _HUB_UNREACHABLE.append(message)
            raise ConnectionError(message) from error
        return dataset, {"source": "hub", "dataset": path, "config": name,
                         "fingerprint": {split: getattr(d, "_fingerprint", None) for split, d in dataset.items()}}
    if path in FILE_BUILDERS:
        files = _map_files(kwargs.pop("data_files", None) or {}, mirror, label)
        dataset = datasets.load_dataset(path, name, data_files=files, **kwargs)
        return dataset, {"source": "mirror", "path": files, "dataset": path, "config": name}
    if Path(path).expanduser().exists():  # a local dataset folder or script, named by the declaration itself
        folder = Path(path).expanduser()
    else:
        folders = [c for c in mirror_candidates(mirror, path) if c.is_dir()]
        if not folders:
            raise FileNotFoundError(
                f"the local mirror {mirror} has no folder for {label}: add {mirror_candidates(mirror, path)[-1]}"
                f"{f'/{name}' if name else ''} with its split files (train.jsonl, validation.jsonl, test.jsonl with "
                "the hub's fields), point data_dir at a mirror that has it, or leave data_dir and $CEL_DATA_DIR empty to "
                "load it from the Hugging Face hub")
        folder = folders[0]
    if name and (folder / name).is_dir():
        dataset, where = datasets.load_dataset(str(folder / name), **kwargs), folder / name
    else:
        dataset, where = datasets.load_dataset(str(folder), name, **kwargs), folder
    return dataset, {"source": "mirror", "path": str(where), "dataset": path, "config": name}
