"""The settings of a CEL run, declared once.

:class:`RunConfig` is the one place a run setting is declared: its name, type, default, help text, and whether it
changes results. Everything else is derived from it:

* the command line's run flags and their ``--help`` (:func:`add_setting_flags`, :func:`given_settings`);
* the run notebook's input: ``model``, ``task``, ``seed``, ``preset`` and one ``config`` dict of any other setting,
  turned into a checked configuration by :func:`from_notebook` (a setting passed on its own is refused, never
  silently dropped);
* what ``--skip-existing`` compares (:func:`result_settings`; beside them it compares the weights and the data
  source the artifact's run read, :func:`cel_utils.grid.cells.same_inputs`) and every artifact's ``config`` section;
* the checks: :meth:`RunConfig.validate` checks every field by its declared type, bounds and choices, then what
  involves several fields or the machine. It only checks; folders are created when something is written.

Presets (:data:`PRESETS`, tabled and read in :mod:`cel_utils.presets`) are data: partial configurations per task
family, applied by :meth:`RunConfig.from_dict` on the machine where the run happens (so ``auto`` means "paper with
CUDA, else cpu" *there*, not where a Slurm job was submitted). Values given explicitly win over the preset's.
"""
from __future__ import annotations

import dataclasses
import typing
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path
from typing import Any, Mapping

from cel_utils.checks import check_int
from cel_utils.presets import (BOOK_MODELS, BOOK_SEED, MODEL_PRESETS, PRESET_TASKS, PRESETS, RUN_MINUTES,  # noqa: F401
                               TASK_FAMILIES)  # (re-exported)
from cel_utils.presets import PRESET_NAMES, preset_values, resolve_preset
from cel_utils.sandbox import MEMORY_MB, TIMEOUT_S
from cel_utils.search.screening import DECISION_SCREENS, SCREENS
from cel_utils.tasks.prompts import BOS_POLICIES, FORMATS

DEFAULT_MODEL = "smollm2-135m-instruct"
ENGINES = ("fast", "naive")
RESAMPLE_METHODS = ("bootstrap", "halves")
STAGE1_MODES = ("exact", "screened")
PRECISIONS = ("fp32", "bf16", "guarded", "auto")  # what each means, and auto: cel_utils.evaluation.precision
ATTENTION_KERNELS = ("sdpa", "eager", "flash_attention_2")
ABLATIONS = ("zero", "mean")  # cel_utils.models.ablation


def setting(default: Any, help: str, *, results: bool = True, choices: tuple | None = None,
            minimum: int | None = None, flag: bool = True):
    """One run setting: ``results`` says whether changing it can change the artifact's numbers (``--skip-existing``
    reruns a cell when such a setting differs); ``minimum``: the least value of an int setting, a bound a float setting
    must exceed; ``flag=False`` keeps it off the generic run flags (the CLI names model, task, seed, preset and paths
    in their own groups)."""
    return field(default=default, metadata={"help": help, "results": results, "choices": choices, "minimum": minimum,
                                            "flag": flag})


@dataclass
class RunConfig:
    """Everything that defines a run; stored verbatim in the artifact. Build it with :meth:`from_dict` to apply a
    preset; the plain constructor applies none (its defaults are the paper's protocol)."""

    ARTIFACT_SUBDIR: typing.ClassVar[str] = ""  # where under results_dir the artifact goes

    model: str = setting(DEFAULT_MODEL, "model spec: 'smollm2-135m-instruct' (the embedded default), a hub id, a "
                         "checkpoint folder, a .gguf file, or random:<family>:<size> (tests)", flag=False)
    task: str = setting("arithmetic", "task: arithmetic (10 configs pooled), arithmetic_2da etc., boolq, hellaswag, mbpp",
                        flag=False)
    n_discovery: int | None = setting(None, "discovery items (none: the paper's Table 3 size, or as many as the data "
                                      "allow)", minimum=1)
    n_holdout: int | None = setting(None, "holdout items (none: the paper's Table 3 size, or as many as the data allow)",
                                    minimum=1)
    p: int = setting(10, "pool size: the best p single heads go on to stage 2", minimum=1)
    k: int = setting(3, "budget: at most k heads are ablated together", minimum=1)
    seed: int = setting(0, "seeds the discovery/holdout/few-shot draw and every resample", minimum=0, flag=False)
    fmt: str = setting("plain", "prompt format: plain (lm-eval's prompts) or chat (the model's chat template)",
                       choices=FORMATS)
    bos: str = setting("auto", "start plain prompts with the BOS token: auto (as the tokenizer does by default, like "
                       "lm-eval: Llama-3.x and Gemma yes, SmolLM2 and Qwen no), always, never", choices=BOS_POLICIES)
    num_fewshot: int | None = setting(None, "few-shot exemplars (none: the task's default, MBPP 3, others 0)", minimum=0)
    data_dir: str | None = setting(None, "local data mirror laid out like shared/data (none: $CEL_DATA_DIR, else the "
                                   "Hugging Face hub); the artifact records what was read", results=False)
    results_dir: str = setting("results", "folder of the JSON artifacts", results=False, flag=False)
    batch_size: int = setting(8, "items per batch (decisions do not depend on it)", results=False, minimum=1)
    device: str = setting("auto", "auto (CUDA if present, else CPU), cpu, cuda, cuda:1, ...")
    dtype: str = setting("auto", "weights' dtype: auto (float32 on CPU, bfloat16 on GPU), float32, bfloat16, float16")
    max_new_tokens: int = setting(256, "generation budget per MBPP item", minimum=1)
    # MBPP's verdicts depend on these two, its completions not: the store keeps completions whatever the limits, and
    # the sandbox's cache keys each verdict by them (cel_utils.sandbox.cache).
    exec_timeout_s: float = setting(TIMEOUT_S, "MBPP: seconds of wall clock a completion and its tests may run in the "
                                    "sandbox (CPU time is limited alike); a program still running then fails as a "
                                    "timeout", minimum=0)
    exec_memory_mb: int = setting(MEMORY_MB, "MBPP: MiB of address space per process running a completion "
                                  "(RLIMIT_AS); a program that needs more fails with MemoryError", minimum=1)
    attn_implementation: str = setting("sdpa", "attention kernel: sdpa, eager, flash_attention_2 (CUDA; the engine runs "
                                       "packed answers in sdpa, as flash attention takes no custom mask)",
                                       choices=ATTENTION_KERNELS)
    revision: str | None = setting(None, "hub branch, tag or commit of the model (none: the default branch; the "
                                   "artifact records the commit loaded)")
    device_map: str | None = setting(None, "spread a model larger than one GPU over the GPUs: auto (accelerate's "
                                     "device map); none: the whole model on device", results=False)
    token_budget: int | None = setting(None, "tokens per stacked forward (none: 4096 on a CPU, scaled to free memory "
                                       "on a GPU; halved automatically on out-of-memory)", results=False, minimum=1)
    engine: str = setting("fast", "fast (the exact engine that reuses shared work) or naive (one full forward per "
                          "intervention)", choices=ENGINES)
    ablation: str = setting("zero", "how the search ablates a head: zero (its o_proj-input slice set to 0, the paper's) "
                            "or mean (set to its mean over the discovery items' tokens); every run also scores its "
                            "frozen set under the other one on the same holdout items, as a control",
                            choices=ABLATIONS)
    precision: str = setting("fp32", "what the evaluations compute in: fp32 (the model as loaded, float32 unless dtype "
                             "says otherwise), bf16 (a bfloat16 copy; approximate: rounding flips ~1% of decisions), "
                             "guarded (the search in bf16, with fp32 recomputing every decision bf16's audited error "
                             "could flip, and the holdout in fp32: fp32's numbers), auto (guarded where it was measured "
                             "faster: multiple-choice tasks on a CUDA GPU or a CPU with AMX; else fp32); see "
                             "cel_utils.evaluation.precision", choices=PRECISIONS)
    cache: bool = setting(True, "keep every finished evaluation in the store under $CEL_CACHE_DIR (a killed run "
                          "resumes); off: compute everything afresh and store nothing", results=False)
    stage1: str = setting("exact", "stage 1 of Algorithm 1: exact (every head evaluated on every discovery item, the "
                          "paper's) or screened (a cheap screen ranks every head; only its top screen_keep are "
                          "evaluated exactly)", choices=STAGE1_MODES)
    screen: str = setting("attribution", "the screen of a screened stage 1: attribution (attribution patching on the "
                          "decision margin; MBPP: on the reference solution's likelihood), attribution-flips (its "
                          "first-order flip count), boundary (attribution-flips' top screen_candidates evaluated "
                          "exactly on the screen_items items nearest the decision boundary), bf16 (exact in "
                          "bfloat16); see cel_utils.search.screening", choices=SCREENS)
    screen_keep: int = setting(30, "m: heads the screen passes on to exact evaluation (at least p)", minimum=1)
    screen_candidates: int = setting(80, "boundary screen: heads attribution-flips passes on to the boundary items",
                                     minimum=1)
    screen_items: int = setting(16, "boundary screen: discovery items nearest the decision boundary (smallest |margin| "
                                "of the full model) on which its candidates are evaluated exactly", minimum=1)
    n_random_sets: int = setting(100, "random head sets of the frozen set's size scored on the holdout, a null for "
                                 "the search (0: off)", minimum=0)
    null_items: int | None = setting(None, "holdout items the random sets are scored on: a seeded random subset of n "
                                      "(the frozen set is compared on the same items; none: all)", minimum=1)
    n_resamples: int = setting(50, "reruns of the whole selection on resampled discovery sets, for stability (0: off)",
                               minimum=0)
    resample: str = setting("bootstrap", "how discovery sets are resampled: bootstrap (with replacement) or halves "
                            "(complementary random halves)", choices=RESAMPLE_METHODS)
    # Each way in has its own default preset, for its own use: none here (a configuration built in code is its declared
    # defaults, the paper's protocol, on any machine), auto on the command line (cli.py: `cel grid` and `main`, which
    # `make book` runs, take the paper's sizes where the cells have CUDA and cpu's elsewhere), quick in the run
    # notebook (NOTEBOOK_PARAMETERS: opened on a laptop as it is, it finishes in minutes).
    preset: str = setting("none", "the preset the other settings were filled from (see cel_utils.config.PRESETS); "
                          "default none in code (the declared defaults), auto on the command line (paper with CUDA, "
                          "else cpu), quick in the run notebook (minutes on a laptop)",
                          results=False, choices=PRESET_NAMES, flag=False)

    @classmethod
    def from_dict(cls, values: Mapping[str, Any]) -> "RunConfig":
        """A configuration from explicit ``values`` (any fields) over the preset they name (``preset``, default
        ``none``), resolved here; unknown names are an error, not ignored."""
        values = dict(values)
        unknown = sorted(set(values) - set(field_names(cls)))
        if unknown:
            raise ValueError(f"unknown run setting(s) {unknown}: the settings are {', '.join(field_names(cls))} "
                             f"(cel_utils.config.{cls.__name__})")
        preset = resolve_preset(values.get("preset", _default(cls, "preset")))
        task = values.get("task", _default(cls, "task"))
        model = values.get("model", _default(cls, "model"))
        # a preset row may hold settings of a subclass (TransferConfig's transfer_items): each class takes its own
        own = {name: value for name, value in preset_values(preset, task, model).items() if name in field_names(cls)}
        return cls(**{**own, **values, "preset": preset})

    def validate(self, here: bool = True) -> "RunConfig":
        """Cheap checks that catch bad input before any model or data is loaded; creates nothing. ``here=False``: the
        run happens on another machine (a Slurm job), so the device is only checked to be a device's name; whether it
        exists there is checked by the job when it starts (a login node without a GPU submits GPU jobs)."""
        for f in dataclasses.fields(self):
            check_setting(type(self), f.name, getattr(self, f.name))
        from cel_utils.models.loading import check_model_spec, parse_device, resolve_device, resolve_dtype
        from cel_utils.paths import check_writable
        from cel_utils.search.algorithm import check_search_params
        from cel_utils.tasks.data import resolve_data_dir
        from cel_utils.tasks.catalog import get_task

        check_model_spec(self.model)
        get_task(self.task)
        check_search_params(self.p, self.k, 10**9)  # the head count is checked once the model is loaded
        resolve_dtype(self.dtype, resolve_device(self.device) if here else parse_device(self.device))
        if self.attn_implementation == "flash_attention_2":
            import importlib.util

            if importlib.util.find_spec("flash_attn") is None:
                raise ValueError("attn_implementation flash_attention_2 needs the flash-attn package (CUDA only): "
                                 "`pip install flash-attn --no-build-isolation`, or use sdpa")
        if self.revision is not None and check_model_spec(self.model) != "hub":
            raise ValueError(f"revision {self.revision!r} names a hub commit, but model {self.model!r} is not a hub id: "
                             "drop revision")
        if self.precision == "guarded" and self.dtype not in ("auto", "float32", "fp32"):
            raise ValueError(f"precision {self.precision} rechecks bfloat16's decisions in float32, but dtype is "
                             f"{self.dtype}: use dtype auto or float32, or precision bf16 or fp32")
        if self.precision == "guarded" and self.engine != "fast":
            raise ValueError("precision guarded rechecks single (item, intervention) pairs with the fast engine: use "
                             "engine fast, or precision bf16 or fp32 with the naive engine")
        if self.ablation == "mean" and self.precision == "guarded":
            raise ValueError(f"ablation mean with precision {self.precision}: the guarded precision's fp32 rechecks zero "
                             "the heads; use precision fp32 or bf16 with ablation mean")
        if self.stage1 == "screened":
            from cel_utils.evaluation.kinds import kind_of

            if self.screen_keep < self.p:
                raise ValueError(f"screen_keep m={self.screen_keep} is smaller than the pool size p={self.p}: the pool "
                                 "is drawn from the heads the screen passes on, so use screen_keep >= p")
            if self.screen in DECISION_SCREENS and not kind_of(get_task(self.task)).loglikelihood:
                raise ValueError(f"the {self.screen} screen counts decisions by their margins; {self.task} is "
                                 "decided by running code: use screen='attribution'")
        resolve_data_dir(self.data_dir)
        if self.cache:  # fails now, not after the search, if the store cannot be written
            from cel_utils.evaluation.store import default_root

            check_writable(default_root(), "the evaluation store",
                           "set $CEL_CACHE_DIR to a writable directory, or turn the store off (cache=False, --no-cache)")
        check_writable(self.results_dir, "results directory", "choose another results_dir")
        return self

    @property
    def artifact_path(self) -> Path:
        from cel_utils.models.loading import display_name
        from cel_utils.pipeline.artifacts import artifact_name

        return Path(self.results_dir) / self.ARTIFACT_SUBDIR / artifact_name(display_name(self.model), self.task, self.seed)


@dataclass
class StrategiesConfig(RunConfig):
    """A run's settings plus the search strategies' own (``python -m cel_utils strategies``); the summary goes to
    ``<results_dir>/strategies/``, beside the runs' artifacts but not among them."""

    ARTIFACT_SUBDIR: typing.ClassVar[str] = "strategies"

    beam_width: int = setting(3, "sets kept per size by beam search (greedy keeps 1)", minimum=1)
    attribution_candidates: int | None = setting(None, "heads the attribution screen passes to exact evaluation "
                                                 "(none: p; at least p)", minimum=1)

    def validate(self, here: bool = True) -> "StrategiesConfig":
        super().validate(here)
        if self.attribution_candidates is not None and self.attribution_candidates < self.p:
            raise ValueError(f"attribution_candidates must be at least p = {self.p} (the pool is drawn from them), "
                             f"got {self.attribution_candidates}")
        return self


@dataclass
class TransferConfig(RunConfig):
    """A run's settings plus the transfer step's (``python -m cel_utils transfer``, run by ``main`` after the grid):
    each frozen set scored on the holdouts of the model's other tasks. One configuration per target task, built from
    that task's artifact; the matrix goes to ``<results_dir>/transfer/``, beside the runs' artifacts but not among
    them."""

    ARTIFACT_SUBDIR: typing.ClassVar[str] = "transfer"

    transfer_items: int | None = setting(None, "transfer matrix: holdout items of each task on which the other tasks' "
                                         "frozen sets are scored, a seeded random subset (none: the whole holdout); "
                                         "each cell states its power", minimum=1)


# --- the declaration, read back -----------------------------------------------------------------------------------

@cache
def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def field_names(cls: type = RunConfig) -> list[str]:
    return [f.name for f in dataclasses.fields(cls)]


def setting_type(cls: type, name: str) -> tuple[type, bool]:
    """(the setting's value type, whether None is allowed)."""
    hint = _hints(cls)[name]
    args = typing.get_args(hint)
    if type(None) in args:
        (inner,) = [a for a in args if a is not type(None)]
        return inner, True
    return hint, False


def result_settings(cls: type = RunConfig) -> list[str]:
    """The settings whose change can change a run's numbers (what ``--skip-existing`` compares)."""
    return [f.name for f in dataclasses.fields(cls) if f.metadata["results"]]


def _default(cls: type, name: str) -> Any:
    return next(f.default for f in dataclasses.fields(cls) if f.name == name)


def check_value(name: str, value: Any, kind: tuple[type, bool], metadata: Mapping) -> None:
    """The generic check of one setting against its declaration: type, lower bound, choices."""
    value_type, optional = kind
    if value is None and optional:
        return
    if value_type is int:
        check_int(name, value, metadata.get("minimum"), optional=optional)
    elif value_type is float and type(value) is int:  # stored as given, it would reach the artifact as 5, not 5.0
        raise ValueError(f"{name} must be a float: write {value}.0, got {value!r}")
    elif not isinstance(value, value_type):
        raise ValueError(f"{name} must be {value_type.__name__}{' or None' if optional else ''}, got {value!r}")
    elif value_type is float and metadata.get("minimum") is not None and not metadata["minimum"] < value < float("inf"):
        raise ValueError(f"{name} must be a finite number > {metadata['minimum']:g}, got {value!r}")
    if metadata.get("choices") and value not in metadata["choices"]:
        raise ValueError(f"unknown {name} {value!r}: choose from {', '.join(metadata['choices'])}")


def check_setting(cls: type, name: str, value: Any) -> None:
    """:func:`check_value` for one field of ``cls``, with the setting's own help in the message."""
    f = next(f for f in dataclasses.fields(cls) if f.name == name)
    try:
        check_value(name, value, setting_type(cls, name), f.metadata)
    except ValueError as error:
        raise ValueError(f"{error} ({name}: {f.metadata['help']})") from None


# --- the run notebook's input --------------------------------------------------------------------------------------

# notebooks/cel_run.ipynb's parameters cell holds exactly these names and values (tests/test_notebook.py checks it):
# opened in Jupyter on a laptop with its defaults, it runs the quick preset in minutes (auto would take the cpu
# preset's sizes there: 6 to 16 minutes a run in RUN_MINUTES). Grid cells always pass their preset: this default is
# only the notebook's own.
NOTEBOOK_PARAMETERS: dict[str, Any] = {"model": DEFAULT_MODEL, "task": "arithmetic_1dc", "seed": 0, "preset": "quick",
                                       "config": {}, "progress": "bars"}  # progress: cel_utils.progress (grid cells: log)


def from_notebook(namespace: Mapping[str, Any], cls: type = RunConfig, here: bool = True) -> RunConfig:
    """The configuration of a notebook run from its parameters (the notebook's globals after papermill's injection);
    ``here``: see :meth:`RunConfig.validate`."""
    loose = sorted(name for name in field_names(cls) if name in namespace and name not in NOTEBOOK_PARAMETERS)
    if loose:
        raise ValueError(f"run setting(s) {loose} given as separate notebook parameters would be ignored: pass them "
                         f"inside `config`, e.g. papermill -y \"config: {{{loose[0]}: ...}}\" or "
                         f"parameters={{'config': {{'{loose[0]}': ...}}}}")
    given = dict(namespace.get("config") or {})
    top = {name: namespace[name] for name in NOTEBOOK_PARAMETERS if name in field_names(cls) and name in namespace}
    clash = sorted(name for name in top if name in given and given[name] != top[name])
    if clash:
        raise ValueError(f"{clash} given both as a notebook parameter and inside `config`, with different values")
    return cls.from_dict({**given, **top}).validate(here)


# --- the command line ---------------------------------------------------------------------------------------------

def _parser_type(value_type: type, optional: bool):
    def parse(text: str):
        if optional and text.lower() == "none":
            return None
        return value_type(text)

    parse.__name__ = value_type.__name__  # argparse names the type in its error messages
    return parse


def add_setting_flags(group, cls: type = RunConfig, only: typing.Collection[str] | None = None) -> list[str]:
    """One ``--flag`` per run setting (those declared with ``flag=True``; of them, those in ``only`` if given), with the
    declared help; returns the names.

    A flag not given leaves its setting to the preset (argparse leaves no attribute), so only what the user typed
    reaches :func:`given_settings`.
    """
    import argparse

    names = []
    for f in dataclasses.fields(cls):
        if not f.metadata["flag"] or (only is not None and f.name not in only):
            continue
        value_type, optional = setting_type(cls, f.name)
        default = "none" if f.default is None else f.default
        # argparse %-formats help strings: a literal % in a declaration ("~1% of decisions") must reach it as %%
        help_text = f"{f.metadata['help']} (default: {default}, unless the preset sets it)".replace("%", "%%")
        flag = "--" + f.name.replace("_", "-")
        if value_type is bool:
            group.add_argument(flag, dest=f.name, action=argparse.BooleanOptionalAction, default=argparse.SUPPRESS,
                               help=help_text)
        else:
            group.add_argument(flag, dest=f.name, type=_parser_type(value_type, optional), default=argparse.SUPPRESS,
                               choices=f.metadata["choices"], metavar=None if f.metadata["choices"] else f.name.upper(),
                               help=help_text)
        names.append(f.name)
    return names


def given_settings(args, cls: type = RunConfig) -> dict[str, Any]:
    """The run settings the user gave on the command line (flags from :func:`add_setting_flags`)."""
    return {name: getattr(args, name) for name in field_names(cls) if hasattr(args, name)
            and next(f for f in dataclasses.fields(cls) if f.name == name).metadata["flag"]}


def setting_help(name: str, cls: type = RunConfig) -> str:
    return next(f.metadata["help"] for f in dataclasses.fields(cls) if f.name == name)
