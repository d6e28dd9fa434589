"""The presets: their tables, as data (partial run configurations per preset and task family, the tasks a grid runs
when none are named, how long runs took when last measured), and the functions that read them (which preset ``auto``
is, a task's preset values, its family and the book's task order). :mod:`cel_utils.config` applies them to a run's
settings (and re-exports the tables): they sit apart from the settings' declaration because they are long, and they
name settings, never declare one.
"""
from __future__ import annotations

from typing import Any

PRESET_NAMES = ("auto", "cpu", "paper", "quick", "smoke", "none")

# Partial configurations per preset and task family ("*": every family; a family's row adds to it). "arithmetic" also
# covers the single configs (arithmetic_2da, ...).
# cpu: a laptop-sized demonstration of the whole protocol on the default model (measured wall times: book/speed.md).
#   Arithmetic runs 3-shot: SmolLM2-135M-Instruct echoes the question at 0-shot (0.8% on the pooled configs) and gets
#   0% of the 3- to 5-digit configs at 3-shot; on 40 items per config at 3-shot it reached 1dc 12%, 2dm 8%, 2da 5%,
#   the rest 0-2% (chat format: 0-5%), so the cpu default task is arithmetic_1dc (5.2% on 500 items). MBPP decodes
#   about 1.1 s per item and intervention on 2 cores (stage 1 is 271 interventions), so its discovery set is tiny.
#   The null and the resamples are kept to a few, so that they add about a fifth to a cell's time.
# paper: the paper's Table 3 sizes with p=10, k=3 (the RunConfig defaults), for a GPU.
# quick: the run notebook's default, a few minutes on a laptop. smoke: seconds per cell with a random tiny model.
PRESETS: dict[str, dict[str, dict[str, Any]]] = {
    "cpu": {
        # Sized for `make book` (both book models, all four tasks, two runs at a time, then the transfer matrices) in
        # an hour on two cores (book/speed.md, "The main job's time").
        # The screen and m per task are the ones that froze exhaustive stage 1's set in benchmarks/bench_screening.py
        # (book/speed.md, "Screened stage 1 against exhaustive search").
        # The random sets are scored on a seeded random 50 of the holdout's items: 4 sets there reach p = 0.2 for a
        # tenth of the cost of 4 on all 500. No discovery resamples: the hour went to the second model.
        # The transfer matrix scores 3 other tasks' sets on transfer_items of each holdout (benchmarks/bench_transfer.py:
        # on the whole holdouts it would cost the default model about as much as its four runs).
        # precision auto: the search in guarded precision where the CPU has bf16 units and the task is one where it
        # pays (cel_utils.evaluation.precision.resolve_precision), fp32 elsewhere; its decisions are fp32's and the
        # holdout's evaluations are fp32 (pipeline.protocol.holdout_config), so every number the book prints is the
        # same on every machine (tests/test_printed_numbers.py).
        "*": dict(n_discovery=128, n_holdout=500, p=3, k=2, stage1="screened", screen="attribution", screen_keep=8,
                  n_random_sets=4, null_items=50, n_resamples=0, transfer_items=100, precision="auto"),
        # arithmetic's items are short and share a 3-shot prefix: it can afford p=5; on it attribution ranks heads by
        # margin changes far from the decision boundary, so it needs the boundary screen
        "arithmetic": dict(num_fewshot=3, p=5, screen="boundary", screen_candidates=60, screen_items=12,
                           screen_keep=10),
        # attribution holds BoolQ's exact top 3 from m = 20 (at m = 8 it misses one and freezes another set); its
        # passages make it the costliest holdout per item, so 300 items (HellaSwag: four endings per item, likewise)
        "boolq": dict(screen_keep=20, n_holdout=300),
        "hellaswag": dict(n_holdout=300),
        # pass@1 has no margin: the screen attributes the reference solution's likelihood; every evaluation generates
        "mbpp": dict(n_discovery=32, n_holdout=100, max_new_tokens=96, screen_keep=3, p=2, n_random_sets=0,
                     transfer_items=30),
    },
    "paper": {"*": dict(batch_size=32)},
    "quick": {
        "*": dict(n_discovery=32, n_holdout=100, p=5, k=2, stage1="screened", screen="attribution", screen_keep=10,
                  n_random_sets=2, n_resamples=2),
        "arithmetic": dict(num_fewshot=3),
        "mbpp": dict(n_discovery=4, n_holdout=10, p=3, screen_keep=5, max_new_tokens=96),
    },
    "smoke": {
        "*": dict(n_discovery=6, n_holdout=8, p=3, k=2, max_new_tokens=32, n_random_sets=3, n_resamples=3),
        "mbpp": dict(n_discovery=2, n_holdout=3),
    },
    "none": {},
}
# Rows for one model spec, over the preset's own (preset -> model spec -> task family or "*" -> settings): sizes may
# differ between models, and each run page states its power.
# cpu, gemma3-270m: the screens and m are those that froze exhaustive stage 1's set in
#   `benchmarks/bench_screening.py --model gemma3-270m` on these discovery sizes (book/speed.md, "A second architecture"):
#   on BoolQ attribution misses the exact top 3 up to m = 20 while the boundary screen freezes the exhaustive set at
#   m = 10; on HellaSwag attribution freezes it at m = 6; on arithmetic_1dc one head gains on discovery (one item net)
#   and the boundary screen ranks it first. MBPP's decoding costs 3x the default model's per item (the unembedding of
#   262k rows at every step; benchmarks/bench_model_cost.py) and the base model passes none of its MBPP items; a
#   HellaSwag item costs about 9x a BoolQ one (each ending token's log-softmax over 262k rows): both stay small, with
#   small transfer subsets.
MODEL_PRESETS: dict[str, dict[str, dict[str, dict[str, Any]]]] = {
    "cpu": {
        "gemma3-270m": {
            "boolq": dict(n_discovery=64, n_holdout=500, screen="boundary", screen_candidates=30, screen_items=12,
                          screen_keep=10),
            "hellaswag": dict(n_discovery=32, n_holdout=100, screen_keep=6, transfer_items=50),
            "arithmetic": dict(screen_candidates=30),  # the boundary screen's exact pass over 30 of the 72 heads
            "mbpp": dict(n_discovery=12, n_holdout=40, transfer_items=15),
        },
    },
}
TASK_FAMILIES = ("arithmetic", "boolq", "hellaswag", "mbpp")
# The tasks a grid runs when none are named. The paper pools the 10 arithmetic configs; on CPU the default model is
# only non-degenerate on single configs like 1dc (see the cpu rows above).
PRESET_TASKS = {"cpu": ("arithmetic_1dc", "boolq", "hellaswag", "mbpp"), "paper": TASK_FAMILIES,
                "quick": ("arithmetic_1dc", "boolq", "hellaswag", "mbpp"), "smoke": TASK_FAMILIES, "none": TASK_FAMILIES}


# Minutes each cpu-preset run took in `make book`, two at a time, per model spec ("*": the default model's, the
# estimate for a model never measured) and task family (book/speed.md, "The main job's time": at 539fbae).
# Only their order is used: the local pool starts the longest runs first (cel_utils.grid.executors.start_order).
RUN_MINUTES = {"cpu": {"*": {"boolq": 15.9, "hellaswag": 12.2, "mbpp": 10.2, "arithmetic": 6.5},
                       "gemma3-270m": {"arithmetic": 10.5, "boolq": 9.5, "mbpp": 9.5, "hellaswag": 9.2}}}

# What `cel main` (and so `make book`) runs when no models or seeds are named: the book's models, and the seed of its
# draws (discovery, holdout, few-shot exemplars, the null's items, resamples). Every preset decision before it was made
# on seed 0's items, and some after seed-0 holdout scores had been read (the results page says which), so the
# published book draws with a seed that no preset decision has seen: its holdouts are a single look.
BOOK_MODELS = ("smollm2-135m-instruct", "gemma3-270m")
BOOK_SEED = 1


# --- reading the tables ---------------------------------------------------------------------------------------------

def resolve_preset(name: str, cuda: bool | None = None) -> str:
    """``auto``: ``paper`` where the run happens has CUDA, else ``cpu``; ``cuda``: whether it has (None: this machine)."""
    if name not in PRESET_NAMES:
        raise ValueError(f"unknown preset {name!r}: choose from {', '.join(PRESET_NAMES)}")
    if name == "auto":
        import torch

        return "paper" if (torch.cuda.is_available() if cuda is None else cuda) else "cpu"
    return name


def task_family(task: str) -> str:
    return "arithmetic" if task.startswith("arithmetic") else task


def task_sort_key(task: str) -> tuple:
    """The book's task order (TASK_FAMILIES'), then the name: tables and matrices list tasks alike."""
    family = task_family(task)
    return (TASK_FAMILIES.index(family) if family in TASK_FAMILIES else len(TASK_FAMILIES)), task


def preset_values(preset: str, task: str, model: str | None = None) -> dict[str, Any]:
    """The preset's partial configuration for ``task`` (its family's row over the ``*`` row) and, where the preset has
    rows for ``model`` (:data:`MODEL_PRESETS`), those over them in the same order."""
    preset, family = resolve_preset(preset), task_family(task)
    values = {}
    for table in (PRESETS[preset], MODEL_PRESETS.get(preset, {}).get(model, {})):
        values.update({**table.get("*", {}), **table.get(family, {})})
    return values


def expected_minutes(preset: str, task: str, model: str | None = None) -> float | None:
    """How long a run of ``task`` under ``preset`` took when last measured (:data:`RUN_MINUTES`): ``model``'s row, else
    the default model's (``"*"``), as an estimate for a model never measured; None if the task never was."""
    table = RUN_MINUTES.get(resolve_preset(preset), {})
    return table.get(model, table.get("*", {})).get(task_family(task))


def default_tasks(preset: str, cuda: bool | None = None) -> tuple[str, ...]:
    """The tasks a grid runs when none are named, for runs on a machine with CUDA or not (None: this one)."""
    return PRESET_TASKS[resolve_preset(preset, cuda)]
