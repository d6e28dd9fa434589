"""One lm-eval task declaration, resolved (:class:`Declared`): lm-eval's settings with its defaults filled in, what CEL
cannot score refused with a reason (:func:`unsupported`), its identity (:func:`config_sha256`) and lm-eval's own task
object built on CEL's data (:func:`build`), with HF evaluate's ``code_eval`` kept from running anything while a code
task's functions are imported (:func:`no_code_eval`).

:mod:`cel_utils.tasks.lmeval` turns a declaration into a :class:`~cel_utils.tasks.specs.TaskSpec`; its docstring says
what is supported and how the splits, the exemplars and the data are chosen.
"""
from __future__ import annotations

import contextlib
import hashlib
import inspect
import json
from pathlib import Path
from typing import Any

from cel_utils.tasks.data import SplitUnavailable, load_declared, resolve_data_dir
from cel_utils.tasks.lmeval_registry import compile_templates_once, no_progress_bars, quiet

SAMPLES_SPLIT = "fewshot_samples"  # the split a task's fixed exemplars (fewshot_config.samples) are served as
KINDS = {"multiple_choice": "choice", "loglikelihood": "greedy", "generate_until": "generate"}


# --- the code-execution guard ---------------------------------------------------------------------------------------

class _NoCodeEval:
    """Stands in for HF evaluate's ``code_eval``, which lm-eval's code tasks load when their functions are imported
    (from the hub) and which runs model-written code in threads of this process. It runs nothing: CEL runs such code in
    its sandbox (:mod:`cel_utils.sandbox`). The import-time self-check of those modules only needs an answer
    of the right shape, so it gets NaN."""

    def compute(self, *, references=None, predictions=None, k=(1,), **_) -> tuple[dict, dict]:
        return {f"pass@{n}": float("nan") for n in k}, {}


@contextlib.contextmanager
def no_code_eval(code_task: bool):
    """While a code task's functions are imported (``unsafe_code: true``; importing evaluate takes seconds, so only
    then), ``evaluate.load("code_eval")`` gives :class:`_NoCodeEval`."""
    try:
        if not code_task:
            raise ImportError
        import evaluate
    except ImportError:  # not a code task, or no evaluate: then a code task's module cannot load code_eval either
        yield
        return
    original = evaluate.load

    def load(path, *args, **kwargs):
        return _NoCodeEval() if path == "code_eval" else original(path, *args, **kwargs)

    evaluate.load = load
    try:
        yield
    finally:
        evaluate.load = original


# --- the resolved declaration ---------------------------------------------------------------------------------------

def _canonical(value: Any) -> Any:
    """JSON-able form of a resolved config for hashing: a function by its name and its module's source."""
    if isinstance(value, dict):
        return {str(k): _canonical(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_canonical(v) for v in value]
    if isinstance(value, (str, int, float, bool)) or value is None:
        return value
    if callable(value):
        try:
            source = inspect.getsource(inspect.getmodule(value) or value)
        except (OSError, TypeError):
            source = None
        return {"function": getattr(value, "__qualname__", repr(value)), "module_source": source}
    return repr(value)


def config_sha256(config: dict) -> str:
    """sha256 of a resolved task config: every value, and the source of each function's module (where it was read)."""
    canonical = _canonical({k: v for k, v in config.items() if k != "metadata"} | {
        "metadata": {k: v for k, v in (config.get("metadata") or {}).items() if k != "config_source"}})
    return hashlib.sha256(json.dumps(canonical, sort_keys=True, default=str).encode()).hexdigest()


def shown_path(path: Path) -> str:
    """A registry task's YAML relative to the lm_eval package (the same on every machine), else the path itself."""
    parts = path.parts
    return "/".join(parts[parts.index("lm_eval"):]) if "lm_eval" in parts else str(path)


def unsupported(config, name: str) -> str | None:
    output = config.output_type
    if output == "loglikelihood_rolling":
        return (f"lmeval:{name} is a perplexity task (output_type loglikelihood_rolling): it scores a text's "
                "likelihood and has no per-item right or wrong answer, so no ablation can be said to improve an item; "
                "choose a multiple_choice, loglikelihood or generate_until task")
    if output not in KINDS:
        return f"lmeval:{name} has output_type {output!r}, which CEL cannot score"
    if config.gen_prefix:
        return f"lmeval:{name} sets gen_prefix, which CEL's prompts do not support yet"
    if config.doc_to_image or config.doc_to_audio:
        return f"lmeval:{name} has images or audio; CEL's models read text only"
    if (config.repeats or 1) > 1:
        return f"lmeval:{name} repeats each request {config.repeats} times (sampling); CEL decodes greedily, once"
    kwargs = config.generation_kwargs or {}
    if output == "generate_until" and (kwargs.get("do_sample") or float(kwargs.get("temperature") or 0) > 0):
        return f"lmeval:{name} samples its generations ({kwargs}); CEL decodes greedily"
    if output != "generate_until" and callable(config.process_results):
        return (f"lmeval:{name} decides items with a process_results function of its own, which CEL cannot reproduce "
                "from its log-likelihood statistics")
    if callable(config.custom_dataset):
        return f"lmeval:{name} builds its dataset in Python (custom_dataset); CEL loads declared datasets only"
    return None


def metric_names(config) -> list[str]:
    from lm_eval.api.registry import DEFAULT_METRIC_REGISTRY

    if config.metric_list is None:
        return list(DEFAULT_METRIC_REGISTRY[config.output_type])
    return [m["metric"] if isinstance(m["metric"], str) else m["metric"].__name__ for m in config.metric_list]


class Declared:
    """One lm-eval task declaration, resolved, and the lm-eval task objects built from it (one per data location).

    lm-eval's templates are methods of a task object, and a task object is built with its dataset; the spec's functions
    therefore use the last object built (:attr:`template`): the data is loaded (:meth:`rows`) before any prompt is
    made."""

    def __init__(self, spelling: str, name: str, path: Path, config: dict):
        from lm_eval.api.task import TaskConfig

        self.spelling, self.name, self.path, self.config = spelling, name, path, config
        compile_templates_once()
        with quiet():
            self.settings = TaskConfig(**config)  # lm-eval's defaults filled in (delimiters, generation settings)
        problem = unsupported(self.settings, name)
        if problem:
            raise ValueError(problem)
        self.output_type = self.settings.output_type
        self.runs_code = bool(self.settings.unsafe_code)
        self.generation = dict(self.settings.generation_kwargs or {})
        until = self.generation.get("until") or []
        self.until = [until] if isinstance(until, str) else list(until)
        self.fewshot = self.settings.fewshot_config
        self._built: dict[str, Any] = {}
        self._last = None

    @property
    def template(self):
        if self._last is None:
            raise RuntimeError(f"{self.spelling}: its prompts come from lm-eval's task object, which is built with its "
                               "data: load the data first (cel_utils.tasks.splits.load_task_data)")
        return self._last

    def built_for(self, data_dir):
        """lm-eval's task object with its dataset from ``data_dir`` (else $CEL_DATA_DIR, else the hub)."""
        mirror = resolve_data_dir(data_dir)
        key = str(mirror)
        if key not in self._built:
            self._built[key] = build(self, mirror)
        self._last = self._built[key]
        return self._last

    def rows(self, config: str | None, split: str, data_dir) -> tuple[list[dict], dict]:
        """The processed documents of one split (lm-eval's ``process_docs`` applied), as :func:`load_split` returns."""
        task = self.built_for(data_dir)
        where = task.cel_provenance
        if split == SAMPLES_SPLIT:
            samples = self.fewshot.samples
            docs = samples() if callable(samples) else samples
            provenance = {**where, "split": split, "note": "the task's fixed exemplars (fewshot_config.samples)"}
        else:
            if split not in task.dataset:
                place = f"local mirror {where.get('path')}" if where["source"] == "mirror" else "hub"
                raise SplitUnavailable(f"{split!r} split of {where['dataset']} is not in the {place}")
            process = self.fewshot.process_docs if split == self.fewshot.split else self.settings.process_docs
            with no_progress_bars():
                docs = process(task.dataset[split]) if process is not None else task.dataset[split]
            provenance = {**where, "split": split}
        rows = [dict(doc) for doc in docs]
        provenance["rows"] = len(rows)
        return rows, provenance


def build(declared: Declared, mirror: Path | None):
    from lm_eval.api.task import ConfigurableTask

    class MirroredTask(ConfigurableTask):
        """lm-eval's task object, its dataset loaded by :func:`cel_utils.tasks.data.load_declared`. A declared split
        that the data lacks counts as undeclared (lm-eval would fail on it)."""

        def download(self, dataset_kwargs=None, **kwargs) -> None:
            self.dataset, self.cel_provenance = load_declared(self.config.dataset_path, self.config.dataset_name,
                                                              dataset_kwargs, mirror)

        def _present(self, split: str | None) -> bool:
            return split is not None and split in self.dataset

        def has_training_docs(self) -> bool:
            return self._present(self.config.training_split)

        def has_validation_docs(self) -> bool:
            return self._present(self.config.validation_split)

        def has_test_docs(self) -> bool:
            return self._present(self.config.test_split)

        def fewshot_docs(self):
            if self.fewshot_cfg.split is not None and not self._present(self.fewshot_cfg.split):
                return None
            return super().fewshot_docs()

    evaluation = [s for s in (declared.settings.test_split, declared.settings.validation_split) if s]
    with quiet():
        try:
            task = MirroredTask(config=dict(declared.config))
        except (KeyError, TypeError, IndexError, ValueError, AttributeError) as error:  # e.g. no evaluation split
            raise SplitUnavailable(f"{declared.spelling}: lm-eval cannot build the task from its data "
                                   f"({type(error).__name__}: {error}); the data must hold one of the evaluation "
                                   f"splits {evaluation} it declares, with rows") from None
    if task.multiple_input:
        raise ValueError(f"{declared.spelling} is a multiple-input task (its doc_to_text gives a choice index: the "
                         "choices are contexts, as Winogrande's), which CEL's requests do not support yet")
    return task
