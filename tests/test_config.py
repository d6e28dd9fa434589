"""One declaration of the run settings: every RunConfig field given to `python -m cel_utils grid` reaches the artifact,
and `--skip-existing` reruns a cell when any result-changing setting differs."""
import dataclasses
import json
import os
from pathlib import Path

import pytest

from cel_utils import config, grid
from cel_utils.cli import main

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
               "n_random_sets": 3, "null_items": 6, "n_resamples": 2, "resample": "bootstrap"}
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
