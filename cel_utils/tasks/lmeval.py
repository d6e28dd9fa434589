"""lm-evaluation-harness's tasks as CEL tasks: ``lmeval:<name>`` from its registry, ``lmeval:<file>.yaml`` for a YAML of
your own.

:func:`lmeval_task` turns one lm-eval task declaration into a :class:`~cel_utils.tasks.specs.TaskSpec`, so that every
place that names a task (``RunConfig(task=...)``, ``cel run``/``grid``, papermill, the explorer) takes it through
:func:`cel_utils.tasks.catalog.get_task`. The text of every prompt, answer and exemplar is lm-eval's own (its Jinja
templates, ``process_docs`` and delimiters, called on its own task object); CEL does the rest as for its built-in tasks:

=====================  ===========  ==============================================================================
lm-eval output_type    CEL kind     decision
=====================  ===========  ==============================================================================
multiple_choice        choice       the highest log-likelihood (``acc``), or per character (``acc_norm``, primary
                                    where the task declares it), as lm-eval's ``process_results``
loglikelihood          greedy       every target token the greedy one (lm-eval's ``is_greedy``, its ``acc``)
generate_until         generate     greedy decoding that stops at the first ``until`` string (the others cut the text
                                    afterwards, as lm-eval does), then lm-eval's filters and ``process_results``
                                    (exact_match and the like; each item's value must be 0 or 1). Code tasks
                                    (``unsafe_code: true``) run the filtered completion with the task's reference
                                    tests in CEL's sandbox (pass@1); lm-eval's code execution is never called
loglikelihood_rolling  (none)       an error: perplexity has no per-item decision to improve
=====================  ===========  ==============================================================================

Splits and exemplars. The holdout is lm-eval's evaluation split (``test_split``, else ``validation_split``); discovery
comes from ``training_split`` where there is one (else a seeded draw from the holdout's split, disjoint from the
holdout, as for arithmetic). Exemplars come from ``fewshot_config``'s split or fixed samples (``sampler: first_n``: the
first n; otherwise a draw with the run's seed), else from items in neither set, and are the same for every item (CEL's
prompts share one prefix; lm-eval's default sampler draws other exemplars for each item).

Data. The task object's dataset is loaded through :func:`cel_utils.tasks.data.load_declared`: from the local mirror
(``data_dir`` or ``$CEL_DATA_DIR``) when one is set, else from the hub; a split the mirror lacks counts as undeclared
(so discovery falls back as for the built-in tasks, and the run records it).

Identity. The data provenance of a run (the artifact's ``data.declaration``) records lm-eval's version, the YAML and
the sha256 of the resolved configuration (every value, and the source of the modules its functions come from). The
evaluation store needs no hash: its records are keyed by the exact token ids of every request (and a generation's stop
string), and the decision rule runs again on whatever is read, so a YAML whose prompt changes gets new records and one
whose metric changes re-decides stored statistics.

Unsupported, each with an error that says so: groups and tags (a run is one task; run their tasks as a grid), tasks
written as Python classes, multiple-input tasks (Winogrande's: the choices are contexts), ``gen_prefix``, images and
audio, sampled generation, repeats, and a multiple-choice ``process_results`` of the task's own.

The declaration. Reading a declaration (lm-eval's settings with its defaults, the refusals above, its identity, lm-eval's
task object on CEL's data, ``code_eval`` kept from running) is :mod:`cel_utils.tasks.lmeval_declared`; this module
turns what it read into a spec.

The version seam. Everything that depends on how lm-eval 0.4 finds and reads its task files is in
:mod:`cel_utils.tasks.lmeval_registry` (0.4.12's TaskIndex and ``load_yaml``); 0.5 changes task loading, and only that
module should need to follow it. The pinned range is in pyproject.toml.
"""
from __future__ import annotations

import json
import os
from functools import partial
from typing import Any

import numpy as np

from cel_utils.tasks.data import Source
from cel_utils.tasks.lmeval_declared import (KINDS, SAMPLES_SPLIT, Declared, config_sha256, metric_names, no_code_eval,
                                             shown_path)
from cel_utils.tasks.lmeval_registry import PREFIX, is_lmeval, lmeval_version, locate, parse, quiet, read_yaml
from cel_utils.tasks.specs import TaskSpec

CHOICE_METRICS = ("acc_norm", "acc")  # what the choice kind decides by (cel_utils.tasks.scoring.decide_choice)
DEFAULT_SIZES = (2000, 1000)  # discovery and holdout when a run gives none (the paper's arithmetic sizes)


# --- the spec -------------------------------------------------------------------------------------------------------

def _answer(a: Any, choices: list[str] | None) -> str:
    """An answer as lm-eval's build_qa_turn writes it: a choice by index, the first of several targets, or the text."""
    if choices and isinstance(a, int):
        return choices[a]
    return str(a[0] if isinstance(a, list) else a)


def _gold(declared: Declared, doc: dict) -> int:
    task = declared.template
    choices, gold = task.doc_to_choice(doc), task.doc_to_target(doc)
    if isinstance(gold, str):
        if gold not in choices:
            raise ValueError(f"its answer {gold!r} is not one of its choices {choices}")
        return choices.index(gold)
    if isinstance(gold, list) or not isinstance(gold, (int, np.integer)):
        raise ValueError(f"its answer {gold!r} is not one choice index (several right answers are not supported)")
    return int(gold)


def _validate(declared: Declared, doc: dict) -> None:
    task = declared.template
    text = task.doc_to_text(doc)
    if not isinstance(text, str):
        raise ValueError(f"doc_to_text gave {type(text).__name__} {text!r:.40}, not text")
    if declared.output_type == "multiple_choice":
        choices = task.doc_to_choice(doc)
        if not isinstance(choices, list) or len(choices) < 2 or not all(isinstance(c, str) and c for c in choices):
            raise ValueError(f"doc_to_choice gave {choices!r:.80}; a multiple-choice item needs two or more non-empty "
                             "answers")
        gold = _gold(declared, doc)
        if not 0 <= gold < len(choices):
            raise ValueError(f"its answer index {gold} is out of range for {len(choices)} choices")
    elif not str(_answer(task.doc_to_target(doc), None)):
        raise ValueError("doc_to_target gave an empty answer")


def _exemplar(declared: Declared, doc: dict) -> str:
    """A few-shot exemplar as lm-eval writes it, with fewshot_config's own templates and target delimiter."""
    task, shots = declared.template, declared.fewshot
    choices = task.doc_to_choice(doc, shots.doc_to_choice) if shots.doc_to_choice else None
    answer = _answer(task.doc_to_target(doc, shots.doc_to_target), choices)
    return task.doc_to_text(doc, shots.doc_to_text) + shots.target_delimiter + answer


def _target(declared: Declared, doc: dict) -> str:
    task = declared.template
    if declared.output_type == "multiple_choice":
        return task.doc_to_choice(doc)[_gold(declared, doc)]
    choices = task.doc_to_choice(doc) if declared.settings.doc_to_choice is not None else None
    return _answer(task.doc_to_target(doc), choices)


def _description(declared: Declared, doc: dict) -> str:
    """The text before the exemplars: lm-eval renders the task's description with the item's fields."""
    return declared.template.resolve_field(doc, declared.settings.description) or ""


def _cut(text: str, until: list[str]) -> str:
    """lm-eval's cut of a generation at each ``until`` string."""
    for term in until:
        if term:
            text = text.split(term)[0]
    return text


def _decision(metric: str, value: Any) -> bool:
    if isinstance(value, (bool, np.bool_, int, float, np.number)) and float(value) in (0.0, 1.0):
        return bool(value)
    raise ValueError(f"metric {metric} gave {value!r} for one item: CEL decides each item right or wrong, so it needs "
                     "a metric whose per-item value is 0 or 1 (exact_match, acc, pass@1); corpus metrics (bleu, f1, "
                     "...) have no per-item decision")


def _score_generations(declared: Declared, task: TaskSpec, requests: list, completions: list[str], *,
                       timeout_s: float = 10.0, memory_mb: int | None = None, workers: int = 2):
    """lm-eval's decision on each completion: cut at every ``until`` string, its filters, then its process_results; a
    code task runs the filtered completion with the reference tests (``doc_to_target``) in CEL's sandbox."""
    from lm_eval.api.instance import Instance

    from cel_utils.tasks.scoring import Outcome

    lm_task = declared.template
    instances = []
    for index, (request, completion) in enumerate(zip(requests, completions)):
        instance = Instance(request_type="generate_until", doc=request.doc, idx=0,
                            arguments=(request.prompt, dict(declared.generation)), metadata=(declared.name, index, 1))
        instance.resps = [_cut(completion, declared.until)]
        instances.append(instance)
    filters = [ensemble.name for ensemble in lm_task._filters]
    for ensemble in lm_task._filters:
        ensemble.apply(instances)
    first = [instance.filtered_resps[filters[0]] for instance in instances]
    if declared.runs_code:
        from concurrent.futures import ThreadPoolExecutor

        from cel_utils.sandbox import run_program

        limits = {"timeout_s": timeout_s} | ({} if memory_mb is None else {"memory_mb": memory_mb})

        def run(pair):
            instance, program = pair
            program = program[0] if isinstance(program, list) else program
            return run_program(str(program), [_target(declared, instance.doc)], **limits)

        with ThreadPoolExecutor(max_workers=workers) as pool:  # threads only wait on sandboxed processes
            results = list(pool.map(run, zip(instances, first)))
        metrics = {"pass@1": np.array([r.passed for r in results], dtype=bool)}
        statuses = [r.status for r in results]
    else:
        values: dict[str, list[bool]] = {name: [] for name in task.all_metrics}
        for instance in instances:
            for name in filters:
                scores = lm_task.process_results(instance.doc, [instance.filtered_resps[name]])
                for metric, value in scores.items():
                    key = metric if len(filters) == 1 else f"{metric},{name}"
                    if key in values:
                        values[key].append(_decision(key, value))
        missing = [name for name, got in values.items() if len(got) != len(instances)]
        if missing:
            raise ValueError(f"{declared.spelling}: lm-eval's process_results gave no value for {missing}; the task "
                             f"declares {task.all_metrics}")
        metrics = {name: np.array(got, dtype=bool) for name, got in values.items()}
        statuses = ["right" if ok else "wrong" for ok in metrics[task.metric]]
    correct = metrics[task.metric]
    return Outcome(item_ids=[r.item_id for r in requests], correct=correct, margin=np.where(correct, 1.0, -1.0),
                   metrics=metrics, predictions=[{"completion": c, "status": s, "filtered": f}
                                                 for c, s, f in zip(completions, statuses, first)])


def _metrics(declared: Declared) -> tuple[str, tuple[str, ...], list[str]]:
    """(primary metric, all metrics CEL reports, declared metrics it does not reproduce)."""
    declared_names = metric_names(declared.settings)
    if declared.output_type == "multiple_choice":
        ours = [m for m in CHOICE_METRICS if m in declared_names] or ["acc"]
        return ours[0], tuple(ours), [m for m in declared_names if m not in ours]
    if declared.output_type == "loglikelihood":
        return "acc", ("acc",), [m for m in declared_names if m != "acc"]
    if declared.runs_code:
        return "pass@1", ("pass@1",), [m for m in declared_names if m not in ("pass@1", "pass_at_1")]
    filters = [f["name"] for f in declared.settings.filter_list or []] or ["none"]
    names = [m if len(filters) == 1 else f"{m},{f}" for f in filters for m in declared_names]
    return names[0], tuple(names), []


def _fewshot_source(declared: Declared) -> tuple[str | None, bool]:
    """(the split exemplars come from, whether it is its first n): fewshot_config's split or samples, else none."""
    shots = declared.fewshot
    first_n = shots.sampler == "first_n"
    if shots.split is not None:
        return shots.split, first_n
    if shots.samples is not None:
        return SAMPLES_SPLIT, first_n
    return None, False


def _spec(declared: Declared) -> TaskSpec:
    settings = declared.settings
    holdout = settings.test_split or settings.validation_split
    if holdout is None:
        raise ValueError(f"{declared.spelling} declares no test_split or validation_split to evaluate on")
    training = settings.training_split if settings.training_split not in (None, holdout) else None
    metric, metrics, not_reproduced = _metrics(declared)
    fewshot_split, first_n = _fewshot_source(declared)
    kind = KINDS[declared.output_type]
    choice = kind == "choice"
    stop = (declared.until[0] if declared.until else None) if kind == "generate" else None
    provenance = {"lm_eval": lmeval_version(), "task": declared.name, "yaml": shown_path(declared.path),
                  "config_sha256": config_sha256(declared.config), "output_type": declared.output_type,
                  "metrics_not_reproduced": not_reproduced}
    if kind == "generate":
        from lm_eval.defaults import DEFAULT_MAX_GEN_TOKS

        provenance.update(until=declared.until,
                          max_gen_toks=declared.generation.get("max_gen_toks", DEFAULT_MAX_GEN_TOKS))
    return TaskSpec(
        name=declared.spelling, kind=kind, metric=metric, metrics=metrics, fields={},
        source=Source(settings.dataset_path or "", (settings.dataset_path or "").rsplit("/", 1)[-1],
                      loader=declared.rows),
        doc_to_text=lambda doc: declared.template.doc_to_text(doc),
        doc_to_target=partial(_target, declared),
        doc_to_choices=(lambda doc: list(declared.template.doc_to_choice(doc))) if choice else None,
        doc_to_gold=partial(_gold, declared) if choice else None,
        doc_to_exemplar=partial(_exemplar, declared),
        validate=partial(_validate, declared),
        # lm-eval puts the delimiter before each choice of a multiple-choice item, but not before a loglikelihood
        # target (0.4.13's construct_requests); exemplars carry fewshot_config's (doc_to_exemplar)
        target_delimiter=settings.target_delimiter if choice else "",
        fewshot_delimiter=declared.fewshot.fewshot_delimiter,
        moved_whitespace=None,
        description=partial(_description, declared) if settings.description else "",
        holdout_split=holdout, discovery_split=training, paper_sizes=DEFAULT_SIZES,
        fewshot_split=fewshot_split, fewshot_first_n=first_n, default_fewshot=settings.num_fewshot or 0,
        stop=stop, chat_stop=stop,  # lm-eval's until holds in a chat template too
        score_generations=partial(_score_generations, declared) if kind == "generate" else None,
        calibration=("answer" if isinstance(settings.doc_to_choice, list) else "length") if choice else None,
        declaration=provenance,
    )


_RESOLVED: dict[str, tuple[str, Declared, TaskSpec]] = {}  # spelling -> (its raw declaration, resolved, its spec)


def lmeval_task(spelling: str) -> TaskSpec:
    """The :class:`TaskSpec` of ``lmeval:<name>`` (lm-eval's registry, and folders in $CEL_LMEVAL_INCLUDE) or
    ``lmeval:<file>.yaml``. Built once per process and declaration: a task file edited since is read again."""
    if not is_lmeval(spelling):
        raise ValueError(f"{spelling!r} is not an lm-eval task: spell it lmeval:<name> or lmeval:<file>.yaml")
    target = spelling.removeprefix(PREFIX).strip()
    if not target:
        raise ValueError("lmeval: needs a task: lmeval:<name> (`cel list --lmeval <part of a name>`) or "
                         "lmeval:<file>.yaml")
    name, path = locate(target)
    parsed = parse(path)
    raw = json.dumps(parsed, sort_keys=True, default=str)
    known = _RESOLVED.get(spelling)
    if known is None or known[0] != raw:
        with quiet(), no_code_eval(bool(parsed.get("unsafe_code"))):
            try:
                config = read_yaml(path, resolve=True)
            except (ImportError, AttributeError, ValueError) as error:  # a !function that cannot be imported
                raise ValueError(f"{spelling}: cannot load the functions its YAML {path} names ({error}); fix the "
                                 "!function references or the module they point to") from None
        for key in ("tag", "group", "task_list"):
            config.pop(key, None)
        config["task"] = name
        declared = Declared(spelling, name, path, config)
        _RESOLVED[spelling] = (raw, declared, _spec(declared))
    return _RESOLVED[spelling][2]


def task_object(spelling: str, data_dir: str | os.PathLike | None = None):
    """lm-eval's own task object of ``lmeval:...``, its dataset loaded as CEL loads it (from ``data_dir``, else
    $CEL_DATA_DIR, else the hub): for lm-eval's evaluator (``simple_evaluate(tasks=[...])``) over the same data."""
    lmeval_task(spelling)
    return _RESOLVED[spelling][1].built_for(data_dir)
