"""A refactor changes no number: runs on a tiny random model, one per task kind, still write the artifacts in
tests/fixtures/reference/. The fixtures were made at commit 208c6ca, before the package was split into layers, and
remade once since, when the split rules changed on purpose (the holdout keeps duplicate items, issue 14); the layered
package wrote byte-identical sections for all four before that change.

Every section the fixture has must come out identical to the byte (as JSON text), except what names the machine
(library versions, the mirror's absolute path, the sandbox's layers) and the values in CHANGED. Sections and
settings added since are listed here, each with the change that added it; anything else new is an error, so an
accidental change of the artifact shows up.
"""
import json
from pathlib import Path

import pytest

from cel_utils.config import RunConfig
from cel_utils.pipeline.schema import SCHEMA_VERSION
from cel_utils.pipeline.protocol import run_cel
from cel_utils.stats.significance import EXACT_BELOW, exact_gain_interval

FIXTURES = Path(__file__).resolve().parent / "fixtures" / "reference"
SETTINGS = dict(model="random:llama:tiny", n_discovery=6, n_holdout=8, p=3, k=2, batch_size=4, max_new_tokens=24,
                n_random_sets=3, n_resamples=2, cache=False, results_dir="results")
# Changed after the fixtures were made: new settings (their defaults keep the old computation), removed ones (their
# values here were the defaults, which computed what the new defaults compute) and new sections.
# issue 14: BOS as the tokenizer adds it by default (SmolLM2's: none, as before); the model and memory options
ADDED_SETTINGS = {"bos": "auto", "attn_implementation": "sdpa", "revision": None, "device_map": None, "token_budget": None,
                  "screen_candidates": 80, "screen_items": 16,
                  "null_items": None,  # issue 13: the random-set null on a subset of the holdout (none: all, as before)
                  "precision": "fp32",  # issue 27: fp32 is the computation the fixtures were made with
                  "ablation": "zero",  # issue 42: the search's ablation (zero, as before); mean is the control
                  # issue 43: MBPP's execution limits as settings (their values are the constants they replaced)
                  "exec_timeout_s": 10.0, "exec_memory_mb": 1024}
REMOVED_SETTINGS: dict = {}
ADDED_HOLDOUT: set = set()
# The prompt as resolved: the default model's tokenizer adds no BOS, so its token sequences (and every number below)
# are unchanged by the BOS policy.
ADDED_SECTIONS = {"prompt": {"format": "plain", "bos": False},
                  # issue 27: the precision the evaluations computed in (fp32, as the fixtures were), no guard audit
                  "precision": {"setting": "fp32", "resolved": "fp32", "approximate": False, "audit": None}}
# issue 29: the discovery items each scored set flipped, which a run page lists on a click. Derived from per-item
# outcomes of which the fixture holds the counts and the full model's vector: checked against those.
DERIVED_SECTIONS = {"discovery_flips"}
ADDED_RELIABILITY = {"power", "calibration", "verdict",  # issue 13: power, the calibration baseline, the verdict
                     "margin"}  # issue 42: the gold answer's margin change, a secondary measure
# issue 42: the floors under the holdout accuracy and the mean-ablation control, new computations checked on their own
# (test_claims.py); here only that they are there and describe this run
ISSUE_42_SECTIONS = {"floors", "control"}
# Values that changed on purpose, (section, key) -> the change: each must differ from the fixture's.
CHANGED = {("model", "fingerprint"): "issue 16: the sha256 of every tensor (of the weight files, for checkpoints), "
                                     "not of a strided sample that missed the weights between samples"}
MACHINE_SECTIONS = ("versions", "sandbox")  # sandbox (issue 16): the layers MBPP code ran in, per machine and user


def _machine_free(artifact: dict, data_dir: str) -> dict:
    """The artifact without what names the machine; the mirror's absolute path (also quoted in the data notes, which
    differ between a developer's tree and CI's clone) becomes a placeholder."""
    artifact = {key: value for key, value in artifact.items() if key not in MACHINE_SECTIONS}
    text = json.dumps(artifact["data"])
    for spelling in {str(Path(data_dir).resolve()), str(Path(data_dir))}:
        text = text.replace(spelling, "<data>")
    artifact["data"] = json.loads(text)
    artifact["data"]["splits"] = [{k: v for k, v in split.items() if k != "path"} for split in artifact["data"]["splits"]]
    return artifact


@pytest.mark.parametrize("task", ["arithmetic", "boolq", "hellaswag", "mbpp"])
def test_artifacts_are_unchanged_by_refactors(task, tiny_models, data_dir, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("CEL_DATA_DIR", data_dir)
    run = run_cel(RunConfig(task=task, **SETTINGS), lm=tiny_models["llama"], progress=False)
    written = json.loads(run.artifact.read_text())
    assert (written["sandbox"] is None) == (task != "mbpp")  # only MBPP runs code, and records where it ran
    new = _machine_free(written, data_dir)
    old = _machine_free(json.loads((FIXTURES / run.artifact.name).read_text()), "/work/shared/data")  # made here

    assert {k: v for k, v in new["config"].items() if k not in old["config"]} == ADDED_SETTINGS
    assert {k: v for k, v in old["config"].items() if k not in new["config"]} == REMOVED_SETTINGS
    assert set(new["holdout"]) - set(old["holdout"]) == ADDED_HOLDOUT
    assert {k: new[k] for k in new if k not in old and k not in DERIVED_SECTIONS | ISSUE_42_SECTIONS} == ADDED_SECTIONS
    assert new["floors"]["n_items"] == new["holdout"]["n_items"]
    assert new["control"]["ablation"] == "mean" and new["control"]["heads"] == new["holdout"]["heads"]
    assert_flips_agree_with(new["discovery_flips"], old)
    new = {k: v for k, v in new.items() if k in old}
    old["config"] = {k: v for k, v in old["config"].items() if k not in REMOVED_SETTINGS}
    new["config"] = {k: v for k, v in new["config"].items() if k in old["config"]}
    new["holdout"] = {k: v for k, v in new["holdout"].items() if k in old["holdout"]}
    assert set(new["reliability"]) - set(old["reliability"]) == ADDED_RELIABILITY
    new["reliability"] = {k: v for k, v in new["reliability"].items() if k in old["reliability"]}
    new["reliability"]["significance"] = exact_below_ten(new["reliability"]["significance"],
                                                         old["reliability"]["significance"])
    assert list(new) == list(old)
    # issue 43: the typed schema's version, the one value that changed with it (the migration reads version 1)
    assert (new["schema_version"], old["schema_version"]) == (SCHEMA_VERSION, 1)
    new["schema_version"] = old["schema_version"]
    for section, key in CHANGED:
        assert new[section][key] != old[section][key], f"{section}.{key} was meant to change: {CHANGED[section, key]}"
        new[section] = {**new[section], key: old[section][key]}
    for section in old:
        assert json.dumps(new[section], indent=1) == json.dumps(old[section], indent=1), section


def exact_below_ten(new: dict, old: dict) -> dict:
    """issue 42: with fewer than 10 changed answers the gain's interval is exact, not bootstrapped. Every other number of
    the test is the fixture's; the interval must be the exact one of the fixture's counts. Returns ``new`` with the
    fixture's interval back, for the byte comparison of the rest."""
    changed = old["help"] + old["harm"]
    if changed >= EXACT_BELOW:
        return new
    assert (new["ci_low"], new["ci_high"]) == exact_gain_interval(old["n_items"], old["help"], old["harm"])
    assert new["interval"].startswith("exact")
    return {**new, "ci_low": old["ci_low"], "ci_high": old["ci_high"], "interval": old["interval"]}


def assert_flips_agree_with(flips: dict, old: dict) -> None:
    """Every set the fixture scored has as many helped and harmed items as its counts, each one an item the full model
    got wrong (helped) or right (harmed), named as in the fixture's discovery items."""
    scored = {"+".join(s["heads"]): s for s in old["stage1"] + old["stage2"]}
    assert set(flips["sets"]) == set(scored)
    full, ids = old["discovery"]["full_correct"], old["discovery"]["item_ids"]
    for name, score in scored.items():
        for direction, full_was in (("help", 0), ("harm", 1)):
            assert len(flips["sets"][name][direction]) == score[direction], (name, direction)
            for index in flips["sets"][name][direction]:
                assert full[int(index)] == full_was and flips["items"][index]["item"] == ids[int(index)], (name, index)
