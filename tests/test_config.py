"""One declaration of the run settings: every RunConfig field given to `python -m cel_utils grid` reaches the artifact,
and `--skip-existing` reruns a cell when any result-changing setting differs."""
import dataclasses
import json
import os
from pathlib import Path

import pytest
import torch

from cel_utils import config, grid
from cel_utils.cli import main
from cel_utils.tasks.splits import load_task_data

REPO = Path(__file__).resolve().parents[1]
MIRROR = Path(os.environ.get("CEL_DATA_DIR") or REPO.parent / "shared" / "data")

# A value other than the default for every setting (one consistent run), and how to see it took effect.
NON_DEFAULT = {
    "model": "random:llama:tiny", "task": "arithmetic_2da", "seed": 1, "preset": "smoke", "n_discovery": 5,
    "n_holdout": 7, "p": 3, "k": 1, "fmt": "chat", "bos": "always", "num_fewshot": 1, "max_new_tokens": 20, "data_dir": str(MIRROR),
    "results_dir": None,  # the test's folder, filled in below
    "batch_size": 3, "device": "cpu", "dtype": "bfloat16", "attn_implementation": "eager", "revision": None,
    "device_map": "auto", "token_budget": 512, "engine": "naive", "cache": False, "stage1": "screened",
    "screen": "boundary", "screen_keep": 6, "screen_candidates": 7, "screen_items": 4, "n_random_sets": 2, "null_items": 5, "n_resamples": 1, "resample": "halves",
    "precision": "bf16", "exec_timeout_s": 5.0, "exec_memory_mb": 2048, "ablation": "mean",
}
EFFECT = {  # besides the artifact's config section: where the setting shows in what was computed
    "model": lambda a: a["model"]["spec"] == "random:llama:tiny",
    "task": lambda a: a["task"]["name"] == "arithmetic_2da",
    "seed": lambda a: a["data"]["seed"] == 1,
    "n_discovery": lambda a: len(a["discovery"]["item_ids"]) == 5,
    "n_holdout": lambda a: a["holdout"]["n_items"] == 7,
    "p": lambda a: len(a["pool"]) == 3,
    "k": lambda a: all(len(s["heads"]) == 1 for s in a["stage2"]),
    "num_fewshot": lambda a: a["data"]["num_fewshot"] == 1,
    "bos": lambda a: a["prompt"]["bos"] is True,
    "data_dir": lambda a: a["data"]["source"] == "mirror",
    "fmt": lambda a: a["prompt"]["format"] == "chat",
    "device": lambda a: a["model"]["device"] == "cpu",
    "dtype": lambda a: a["model"]["dtype"] == "bfloat16",
    "stage1": lambda a: a["stage1_method"]["method"] == "screened",
    "screen": lambda a: a["stage1_method"]["screen"] == "boundary" and len(a["stage1_method"]["order"]) == 12,
    "screen_candidates": lambda a: a["stage1_method"]["candidates"] == 7,
    "screen_items": lambda a: a["stage1_method"]["boundary_items"] == 4,
    "screen_keep": lambda a: len(a["stage1"]) == 6 and a["stage1_method"]["keep"] == 6,
    "n_random_sets": lambda a: a["reliability"]["null"]["n_sets"] == 2,
    "null_items": lambda a: a["reliability"]["null"]["n_items"] == 5,
    "n_resamples": lambda a: a["reliability"]["stability"]["n_resamples"] == 1,
    "resample": lambda a: a["reliability"]["stability"]["method"] == "halves",
    "precision": lambda a: a["precision"]["resolved"] == "bf16" and a["precision"]["approximate"],
    # the search mean-ablates, so the control is zero-ablation (and the mean's digest is recorded)
    "ablation": lambda a: a["control"]["ablation"] == "zero" and len(a["control"]["means"]["sha256"]) == 64,
}


def _flags(values: dict, results: Path) -> list[str]:
    """The grid command line for ``values``: selection flags, then one derived flag per run setting."""
    args = ["grid", "--root", str(results.parent), "--results-dir", str(results), "--models", values["model"],
            "--tasks", values["task"], "--seeds", str(values["seed"]), "--preset", values["preset"]]
    for f in dataclasses.fields(config.RunConfig):
        if f.metadata["flag"]:
            value = values[f.name]
            flag = "--" + f.name.replace("_", "-")
            args += ([flag] if value else ["--no-" + f.name.replace("_", "-")]) if isinstance(value, bool) else [flag, str(value)]
    return args


@pytest.fixture(scope="module")
def ran(tmp_path_factory):
    root = tmp_path_factory.mktemp("settings")
    results = root / "results"
    values = {**NON_DEFAULT, "results_dir": str(results)}
    assert main(_flags(values, results)) == 0
    (artifact,) = results.glob("*.json")
    return values, json.loads(artifact.read_text()), results


# Settings this machine cannot give another value in the run above, and what is tested for them instead.
ELSEWHERE = {"revision": "a hub id's commit: no hub here, so test_revision_needs_a_hub_model checks the refusal",
             "results_dir": "filled in by the fixture"}


def test_every_setting_has_a_non_default_value_here():
    assert set(NON_DEFAULT) == set(config.field_names())
    for f in dataclasses.fields(config.RunConfig):
        if f.name not in ELSEWHERE:
            assert NON_DEFAULT[f.name] != f.default, f.name


def test_revision_needs_a_hub_model(tmp_path, capsys):
    args = ["grid", "--root", str(tmp_path), "--models", "random:llama:tiny", "--tasks", "boolq", "--preset", "smoke",
            "--revision", "v1.0"]
    assert main(args) == 2
    assert "revision 'v1.0' names a hub commit, but model 'random:llama:tiny' is not a hub id" in capsys.readouterr().err


@pytest.mark.parametrize("name", config.field_names())
def test_a_setting_given_to_the_grid_reaches_the_artifact(ran, name):
    values, artifact, _ = ran
    assert artifact["config"][name] == values[name]
    if name in EFFECT:
        assert EFFECT[name](artifact), name


ALTERNATIVE = {"bos": "never", "attn_implementation": "sdpa", "n_discovery": 4, "n_holdout": 6, "p": 2, "k": 2, "fmt": "plain", "num_fewshot": 0, "max_new_tokens": 21,
               "device": "auto", "dtype": "float32", "engine": "fast", "stage1": "exact", "screen": "attribution",
               "screen_keep": 7, "screen_candidates": 8, "screen_items": 5,
               "n_random_sets": 3, "null_items": 6, "n_resamples": 2, "resample": "bootstrap",
               "precision": "fp32", "exec_timeout_s": 6.0, "exec_memory_mb": 1536, "ablation": "zero"}
IDENTITY = {"model", "task", "seed"}  # another value is another cell (another file name)


def test_skip_existing_reruns_when_a_result_changing_setting_differs(ran):
    values, artifact, results = ran
    (cell,) = grid.plan([values["model"]], [values["task"]], [values["seed"]], values["preset"],
                        runs_dir=results.parent / "book" / "runs", results_dir=results,
                        **{k: v for k, v in values.items() if k not in IDENTITY | {"preset", "results_dir"}})
    assert grid.up_to_date(cell) == artifact  # the same settings: skipped
    changing = set(config.result_settings()) - IDENTITY
    assert changing == set(ALTERNATIVE) | {"revision"}  # every result-changing setting is tried (revision: elsewhere)
    for name in sorted(set(ALTERNATIVE)):
        assert grid.up_to_date(grid.with_settings(cell, **{name: ALTERNATIVE[name]})) is None, name
    for name in sorted(set(config.field_names()) - changing - IDENTITY - {"preset", "results_dir"}):
        other = {"data_dir": None, "batch_size": 8, "cache": True, "device_map": None, "token_budget": 4096}[name]
        assert grid.up_to_date(grid.with_settings(cell, **{name: other})) == artifact, name  # does not change numbers


# Result-changing settings whose effect the run above cannot show: it is not MBPP (max_new_tokens, the execution
# limits), and its artifact holds decisions, which are the same on either engine or kernel. Each changes the numbers an
# evaluator computes.
def _margins(lm, data, evaluator=None):
    from cel_utils.evaluation.engine import EngineEvaluator
    from cel_utils.models.heads import HeadId

    made = (evaluator or EngineEvaluator)(lm, data.task, data.discovery, progress=False)
    return [o.margin.tobytes() for o in made.evaluate([(), (HeadId(0, 1),), (HeadId(2, 3),)])]


def _kernel_changes_numbers(tiny_models, data_dir):
    from cel_utils.models.loading import random_model

    data = load_task_data("hellaswag", 4, 2, seed=0, data_dir=data_dir)
    sdpa = tiny_models["llama"]
    eager = random_model("llama", tokenizer=sdpa.tokenizer, device="cpu", attn_implementation="eager")
    return _margins(sdpa, data), _margins(eager, data)


def _engine_changes_numbers(tiny_models, data_dir):
    from cel_utils.evaluation.evaluator import NaiveEvaluator

    data = load_task_data("hellaswag", 4, 2, seed=0, data_dir=data_dir)
    return _margins(tiny_models["llama"], data), _margins(tiny_models["llama"], data, NaiveEvaluator)


def _max_new_tokens_changes_completions(tiny_models, data_dir):
    from cel_utils.evaluation.engine import EngineEvaluator
    from cel_utils.evaluation.generation import generate

    lm = tiny_models["llama"]
    data = load_task_data("mbpp", 2, 2, seed=0, num_fewshot=0, data_dir=data_dir)
    requests = EngineEvaluator(lm, data.task, data.discovery, progress=False).requests  # as a run decodes them
    return tuple(generate(lm, requests, (), batch_size=8, max_new_tokens=n) for n in (3, 6))


def _mbpp_decisions(tiny_models, data_dir, before: str, **limits) -> list[tuple[str, bool]]:
    """The verdicts and decisions of a run's evaluator (built from a RunConfig by make_evaluator, decided by the kind's
    decide) on MBPP items whose completions are their reference solutions with ``before`` run first."""
    from cel_utils.pipeline.protocol import make_evaluator

    data = load_task_data("mbpp", 1, 2, seed=0, num_fewshot=0, data_dir=data_dir)
    run = config.RunConfig(task="mbpp", cache=False, **limits).validate()
    evaluator = make_evaluator(tiny_models["llama"], data, data.holdout, run, progress=False)
    outcome = evaluator.decide([before + item.doc["code"] for item in data.holdout])
    return [(p["status"], bool(c)) for p, c in zip(outcome.predictions, outcome.correct)]


def _exec_timeout_changes_decisions(tiny_models, data_dir):
    # a program that sleeps 0.5 s: within 5 s it passes, under 0.2 s it is still running (the retry alone, too)
    decisions = [_mbpp_decisions(tiny_models, data_dir, "import time\ntime.sleep(0.5)\n", exec_timeout_s=limit)
                 for limit in (5.0, 0.2)]
    assert decisions == [[("passed", True)] * 2, [("timeout", False)] * 2]
    return decisions


def _exec_memory_changes_decisions(tiny_models, data_dir):
    # a program that takes 300 MiB: within 1024 MiB it passes, within 256 it raises MemoryError
    decisions = [_mbpp_decisions(tiny_models, data_dir, "_ballast = bytearray(300 << 20)\n", exec_memory_mb=limit)
                 for limit in (1024, 256)]
    assert decisions == [[("passed", True)] * 2, [("exception", False)] * 2]
    return decisions


def _ablation_changes_numbers(tiny_models, data_dir):
    from cel_utils.evaluation.engine import EngineEvaluator
    from cel_utils.evaluation.means import compute_means

    lm = tiny_models["llama"]
    data = load_task_data("hellaswag", 4, 2, seed=0, data_dir=data_dir)
    zero = EngineEvaluator(lm, data.task, data.discovery, progress=False)
    means = compute_means(lm, [r.context for r in zero.requests])
    return _margins(lm, data), _margins(lm, data, lambda *a, **k: EngineEvaluator(*a, means=means, **k))


NUMBERS = {"attn_implementation": _kernel_changes_numbers, "engine": _engine_changes_numbers, "ablation": _ablation_changes_numbers,
           "max_new_tokens": _max_new_tokens_changes_completions, "exec_timeout_s": _exec_timeout_changes_decisions,
           "exec_memory_mb": _exec_memory_changes_decisions}


@pytest.mark.parametrize("name", sorted(NUMBERS))
def test_a_result_changing_setting_changes_the_numbers(name, tiny_models, data_dir):
    one, other = NUMBERS[name](tiny_models, data_dir)
    assert one and other and one != other, name


# Settings declared results=False, and where a test shows that changing them changes no number (or, data_dir, that
# --skip-existing compares what it decides instead).
SAME_NUMBERS = {
    "batch_size": "tests/test_determinism.py: the artifact is the same bytes at batch size 1",
    "cache": "tests/test_determinism.py: the artifact is the same with the store on, written and read back",
    "token_budget": "tests/test_determinism.py: stage 1 is the same at any batch size and token budget",
    "device_map": "test_device_map_changes_no_number below",
    "data_dir": "test_skip_existing_reruns_when_the_data_source_differs below (the source, not the path, matters)",
}


def test_every_setting_has_a_test_of_what_changing_it_does():
    tested = set(EFFECT) | set(NUMBERS) | set(ELSEWHERE)
    untested = sorted(set(config.result_settings()) - tested)
    assert not untested, (f"result-changing setting(s) {untested} have no test that changing them changes the "
                          "numbers or the artifact: add one to EFFECT or NUMBERS in tests/test_config.py")
    quiet = sorted(set(config.field_names()) - set(config.result_settings()) - {"preset", "results_dir"} - set(SAME_NUMBERS))
    assert not quiet, (f"setting(s) {quiet} are declared not to change results, with no test of that: add one and "
                       "name it in SAME_NUMBERS in tests/test_config.py")


def test_device_map_changes_no_number(tiny_models, data_dir, tmp_path):
    from cel_utils.models.loading import load_model

    import copy

    lm = tiny_models["llama"]
    # a copy: save_pretrained writes into the config it saves (architectures), which the session's model is keyed by
    copy.deepcopy(lm.model).save_pretrained(tmp_path / "checkpoint")
    lm.tokenizer.save_pretrained(tmp_path / "checkpoint")
    data = load_task_data("hellaswag", 4, 2, seed=0, data_dir=data_dir)
    whole = load_model(str(tmp_path / "checkpoint"), device="cpu")
    spread = load_model(str(tmp_path / "checkpoint"), device="cpu", device_map="auto")
    # (on one device transformers loads through its device-map path but records no map: nothing else to check)
    assert _margins(spread, data) == _margins(whole, data)


def _cell_of(values: dict, results: Path, **changed):
    (cell,) = grid.plan([values["model"]], [values["task"]], [values["seed"]], values["preset"],
                        runs_dir=results.parent / "book" / "runs", results_dir=results,
                        **{k: v for k, v in {**values, **changed}.items() if k not in IDENTITY | {"preset", "results_dir"}})
    return cell


def test_skip_existing_reruns_when_the_data_source_differs(ran, monkeypatch):
    values, artifact, results = ran
    assert artifact["data"]["source"] == "mirror"
    monkeypatch.delenv("CEL_DATA_DIR", raising=False)  # no mirror: the hub, with other splits (BoolQ's train)
    assert grid.up_to_date(_cell_of(values, results, data_dir=None)) is None
    monkeypatch.setenv("CEL_DATA_DIR", str(MIRROR))  # the same mirror named by the environment: the same items
    assert grid.up_to_date(_cell_of(values, results, data_dir=None)) == artifact


def test_skip_existing_reruns_when_the_weights_differ(tokenizer, tmp_path):
    from cel_utils.models.loading import random_model

    folder, results = tmp_path / "checkpoint", tmp_path / "results"
    model = random_model("llama", tokenizer=tokenizer, device="cpu").model
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    args = ["grid", "--root", str(tmp_path), "--results-dir", str(results), "--models", str(folder), "--tasks",
            "arithmetic_1dc", "--preset", "smoke", "--n-discovery", "3", "--n-holdout", "3", "--n-random-sets", "0",
            "--n-resamples", "0", "--no-cache"]
    assert main(args) == 0
    (cell,) = grid.plan([str(folder)], ["arithmetic_1dc"], [0], "smoke", runs_dir=tmp_path / "book" / "runs",
                        results_dir=results, n_discovery=3, n_holdout=3, n_random_sets=0, n_resamples=0, cache=False)
    artifact = grid.up_to_date(cell)
    assert artifact is not None  # unchanged: skipped
    with torch.no_grad():
        model.lm_head.weight[0, 0] += 1.0
    model.save_pretrained(folder)  # the same folder, other weights (an export with --overwrite, a training step)
    assert grid.up_to_date(cell) is None


def test_every_command_prints_its_help(capsys):
    """Help is built from the settings' declarations: one with a literal % once made `cel main --help` crash."""
    from cel_utils.cli import parser

    commands = [name for action in parser()._subparsers._group_actions for name in action.choices]
    assert {"main", "grid", "transfer", "strategies"} <= set(commands)
    shown = {}
    for command in commands:
        with pytest.raises(SystemExit) as ended:
            main([command, "--help"])
        assert ended.value.code == 0, command
        shown[command] = " ".join(capsys.readouterr().out.split())
        assert shown[command].startswith("usage: cel " + command), command
    assert "flips ~1% of decisions" in shown["main"]  # the % as declared, not doubled
