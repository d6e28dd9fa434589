"""lm-eval's registry, the version seam of :mod:`cel_utils.tasks.lmeval`: how lm-eval 0.4 finds and reads its task files
(0.4.12's TaskIndex and ``load_yaml``), the ``lmeval:`` spelling, a search of the registry, and the quieting of its logs
and progress bars. lm-eval 0.5 changes task loading; only this module should need to follow it (the pinned range is in
pyproject.toml).
"""
from __future__ import annotations

import contextlib
import difflib
import logging
import os
import re
from functools import cache, lru_cache
from pathlib import Path

PREFIX = "lmeval:"
INCLUDE_ENV = "CEL_LMEVAL_INCLUDE"  # folders of YAML tasks (os.pathsep-separated), as lm-eval's --include_path


def is_lmeval(name: str) -> bool:
    return isinstance(name, str) and name.startswith(PREFIX)


def lmeval_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("lm_eval")
    except PackageNotFoundError:
        raise ModuleNotFoundError("lmeval: tasks need lm-evaluation-harness: `pip install 'lm-eval>=0.4.12,<0.5'` "
                                  "(a dependency of cel-book; reinstall with `pip install -e .`)") from None


@contextlib.contextmanager
def quiet():
    """lm-eval logs a warning for every default it fills in (aggregations, generation settings): not news here."""
    logger = logging.getLogger("lm_eval")
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        logger.setLevel(level)


@contextlib.contextmanager
def no_progress_bars():
    """datasets draws a bar for every ``map`` (lm-eval's process_docs): noise in a run's log."""
    from datasets.utils import disable_progress_bars, enable_progress_bars, are_progress_bars_disabled

    was = are_progress_bars_disabled()
    disable_progress_bars()
    try:
        yield
    finally:
        if not was:
            enable_progress_bars()


def read_yaml(path: Path, resolve: bool) -> dict:
    """One task file with its ``include:`` files merged; ``resolve``: import its ``!function`` references (else each is
    the string ``<folder>/<module>.<function>``)."""
    from lm_eval.tasks._yaml_loader import load_yaml

    return load_yaml(path, resolve_func=resolve, recursive=True)


def _include_folders() -> tuple[str, ...]:
    folders = tuple(p for p in os.environ.get(INCLUDE_ENV, "").split(os.pathsep) if p)
    for folder in folders:
        if not Path(folder).expanduser().is_dir():
            raise FileNotFoundError(f"${INCLUDE_ENV} names {folder!r}, which is not a folder: point it at folders of "
                                    "lm-eval YAML tasks (separated by ':'), or unset it")
    return folders


@cache
def _index(folders: tuple[str, ...]) -> dict:
    """lm-eval's index of task, group and tag names over its own tasks and ``folders`` (later ones win, as with its
    --include_path). About 10 s: it reads every YAML file it has."""
    from lm_eval.tasks import TaskManager

    lmeval_version()
    with quiet():
        return dict(TaskManager(include_path=[str(Path(f).expanduser()) for f in folders] or None).task_index)


@cache
def _find_by_text(target: str, folders: tuple[str, ...]) -> Path | None:
    """The task file that declares ``task: <target>`` on a line of its own, found by reading the files as text (a second
    or two, where lm-eval's index takes ten; once per process): the include folders first, as they win. None when no
    file does (a name made by a group's task list, a tag, a group): then the index decides."""
    import lm_eval

    quote = "['\"]?"
    pattern = re.compile(rf"^{quote}task{quote}:\s*{quote}{re.escape(target)}{quote}\s*$", re.MULTILINE)
    for root in [Path(f).expanduser() for f in reversed(folders)] + [Path(lm_eval.__file__).parent / "tasks"]:
        for path in sorted(root.glob("**/*.yaml")):
            try:
                if pattern.search(path.read_text(encoding="utf-8", errors="replace")) and \
                        read_yaml(path, resolve=False).get("task") == target:
                    return path
            except Exception:  # an unreadable file: the index reports or skips it
                continue
    return None


def _kind_of(entry) -> str:
    return entry.kind.name.lower()  # task, py_task, group, tag


def _members(entry) -> list[str]:
    if _kind_of(entry) == "tag":
        return sorted(entry.tags)
    listed = (entry.cfg or {}).get("task") or []
    return [m if isinstance(m, str) else m.get("task") or m.get("group") for m in listed]


def _unreadable_yaml(folders: tuple[str, ...]) -> list[str]:
    """The YAML files in ``folders`` that do not parse (lm-eval's index skips them without a word)."""
    bad = []
    for folder in folders:
        for path in sorted(Path(folder).expanduser().glob("**/*.yaml")):
            try:
                read_yaml(path, resolve=False)
            except Exception as error:  # a YAML syntax error, an include that is missing
                bad.append(f"{path}: {type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}")
    return bad


def locate(target: str) -> tuple[str, Path]:
    """(lm-eval's task name, its YAML file) for what follows ``lmeval:``."""
    if target.endswith((".yaml", ".yml")):
        path = Path(target).expanduser()
        if not path.is_file():
            raise FileNotFoundError(f"lmeval:{target}: no such YAML file (from {Path.cwd()}); give the path of an "
                                    "lm-eval task file, absolute for runs in other folders (grid cells, Slurm jobs)")
        raw = parse(path)
        if "group" in raw or not isinstance(raw.get("task"), str):
            raise ValueError(f"lmeval:{target} declares a group (its 'task' is a list), and a CEL run localizes heads "
                             "for one task: run each of its task files (lmeval:<file>.yaml) as a grid")
        return raw["task"], path.resolve()
    folders = _include_folders()
    found = _find_by_text(target, folders)
    if found is not None:
        return target, found
    index = _index(folders)
    entry = index.get(target)
    if entry is None:
        close = difflib.get_close_matches(target, list(index), n=5, cutoff=0.75)
        hint = f"did you mean {', '.join(close)}? " if close else ""
        bad = _unreadable_yaml(folders)
        unread = f" {len(bad)} YAML file(s) in ${INCLUDE_ENV} could not be read: {'; '.join(bad[:3])}." if bad else ""
        raise ValueError(f"unknown lm-eval task {target!r}: {hint}`cel list --lmeval <part of a name>` searches the "
                         f"{len(index)} names lm-eval {lmeval_version()} knows; a task file of your own is "
                         f"lmeval:/path/to/task.yaml, or a folder of them in ${INCLUDE_ENV}.{unread}")
    kind = _kind_of(entry)
    if kind in ("group", "tag"):
        members = _members(entry)
        shown = " ".join(PREFIX + m for m in members[:4]) + (" ..." if len(members) > 4 else "")
        raise ValueError(f"lmeval:{target} is lm-eval's {kind} of {len(members)} tasks, and a CEL run localizes heads "
                         f"for one task: run its tasks as a grid (`cel grid --tasks {shown}`; groups among them are "
                         f"expanded the same way; `cel list --lmeval {target}` lists them)")
    if kind != "task" or entry.yaml_path is None:
        raise ValueError(f"lmeval:{target} is defined by a Python class, not a YAML declaration; only YAML tasks can "
                         "be run (their prompts and metrics are declared, so CEL can score them)")
    return entry.name, Path(entry.yaml_path)


def parse(path: Path) -> dict:
    """The task file without importing its functions; a file that does not parse is an error naming it."""
    try:
        return read_yaml(path, resolve=False)
    except Exception as error:  # yaml's errors carry the line and column
        problem = " ".join(str(error).split())
        raise ValueError(f"cannot read the lm-eval task file {path}: {type(error).__name__}: {problem}; fix the YAML "
                         "(lm-eval's task format: docs/new_task_guide.md of EleutherAI/lm-evaluation-harness)"
                         ) from None


def search(part: str) -> list[dict]:
    """The registry's names (and those in $CEL_LMEVAL_INCLUDE) containing ``part``, case-insensitively: each with its
    kind (task, group, tag, py_task) and, for a task, its output type; for a group or tag, its members."""
    part = part.lower()
    rows = []
    for name, entry in sorted(_index(_include_folders()).items()):
        if part not in name.lower():
            continue
        kind = _kind_of(entry)
        row = {"name": name, "kind": kind}
        if kind == "task":
            row["output_type"] = (entry.cfg or {}).get("output_type", "generate_until")
        elif kind in ("group", "tag"):
            row["members"] = _members(entry)
        rows.append(row)
    return rows


@cache
def compile_templates_once() -> None:
    """lm-eval compiles a task's Jinja template at every use (``lm_eval.utils.apply_template``); compiled once each,
    the prompts of HellaSwag's 10,042 items take seconds instead of half a minute. A template renders the same text
    either way."""
    import lm_eval.utils

    compiled = lru_cache(maxsize=4096)(lm_eval.utils.env.from_string)

    def apply_template(template: str, doc: dict) -> str:
        return compiled(template).render(**doc)

    lm_eval.utils.apply_template = apply_template
