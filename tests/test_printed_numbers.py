"""Issue 46: every number the book prints is the same whether the search computed in fp32 or guarded.

The guarded precision keeps fp32's decisions under the primary metric and nothing more; the holdout's evaluations
(holdout, control, random-set null, transfer) are fp32's under it (``protocol.holdout_config``). So a run's artifact
must be the same bytes in both precisions, apart from the record of the precision itself, and so must every page made
from it. To make the test able to fail, the fast pass here is not bf16 on a tiny random model (where bf16 moves no
decision) but a perturbed copy of the model that gets decisions wrong, which the guard must catch.
"""
import functools
import json
import re

import pytest
from test_precision import _perturbed  # noisy weights: a stand-in for bf16 that gets decisions wrong

from cel_utils.book import baselines, key_results, results_page, run_page
from cel_utils.config import RunConfig
from cel_utils.evaluation.guard import Guard
from cel_utils.pipeline import protocol
from cel_utils.pipeline.protocol import run_cel
from cel_utils.pipeline.artifacts import from_json

# What a run page prints, function by function (those that take the artifact alone), besides the timings and the
# precision line, which say how the run was computed, not what it found.
PAGE_PARTS = {run_page: ("weights_text", "stage1_text", "pool_table", "stage2_table", "holdout_table",
                         "holdout_sentence", "selection_note", "verdict_sentence", "reliability_sentence",
                         "reliability_table", "stability_table", "flip_table"),
              baselines: ("floors_table", "answer_profile", "control_sentence"),
              key_results: ("key_result",)}


def _printed(artifact) -> dict[str, str]:
    out = {}
    for module, names in PAGE_PARTS.items():
        for name in names:
            value = getattr(module, name)(artifact)
            out[name] = value.to_string() if hasattr(value, "to_string") else str(value)
    page = results_page.results_markdown([artifact], [])
    out["results page"] = re.sub(r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}", "<plot id>", page)
    return out


@pytest.mark.parametrize("task", ["boolq", "hellaswag"])  # the tasks auto guards: one-token answers; acc_norm and acc
def test_every_printed_number_is_the_same_in_fp32_and_guarded(tiny_models, data_dir, tmp_path, monkeypatch, task):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("CEL_DATA_DIR", data_dir)
    lm = tiny_models["llama"]
    settings = dict(model="random:llama:tiny", task=task, n_discovery=16, n_holdout=12, p=3, k=2, batch_size=4,
                    n_random_sets=2, null_items=6, n_resamples=2, cache=False)
    fp32 = run_cel(RunConfig(**settings, results_dir="fp32"), lm=lm, progress=False)
    guards: list[Guard] = []

    def guard(**kwargs):
        guards.append(Guard(**kwargs, audit_pairs=16))
        return guards[-1]

    monkeypatch.setattr(protocol, "Guard", guard)
    monkeypatch.setattr(protocol, "bf16_model", functools.partial(_perturbed, scale=0.1, seed=1))  # wrong at times
    guarded = run_cel(RunConfig(**settings, precision="guarded", results_dir="guarded"), lm=lm, progress=False)
    reference, artifact = (json.loads(run.artifact.read_text()) for run in (fp32, guarded))
    audit = artifact["precision"]["audit"]
    # not void: the fast pass got decisions wrong, the guard corrected them, and it trusted some fast numbers
    assert audit["bf16_decisions_caught"] > 0 and audit["share_rechecked"] < 1 and not audit["fell_back_to_fp32"]
    assert reference["precision"]["resolved"] == "fp32" and artifact["precision"]["resolved"] == "guarded"
    for section in sorted(set(reference) | set(artifact)):
        if section == "config":
            assert {**artifact["config"], "precision": "fp32", "results_dir": "fp32"} == reference["config"]
        elif section != "precision":
            assert artifact.get(section) == reference.get(section), section
    printed, printed_guarded = _printed(from_json(reference)), _printed(from_json(artifact))
    for part, text in printed.items():
        assert printed_guarded[part] == text, part


def test_the_holdouts_evaluators_are_fp32_where_the_search_is_guarded(monkeypatch):
    """Transfer cells, the holdout, the control and the null read holdout_config: fp32 under guarded, else the run's."""
    from cel_utils import hardware

    monkeypatch.setattr(hardware, "cpu_info", lambda: {"model": "test", "flags": {"amx_bf16"}})
    for task, setting in [("boolq", "auto"), ("hellaswag", "guarded"), ("arithmetic_1dc", "guarded")]:
        config = RunConfig(task=task, precision=setting)
        assert protocol.run_precision(config, "cpu") == "guarded"
        assert protocol.holdout_config(config, "cpu").precision == "fp32"
    for setting in ("bf16", "fp32"):  # nothing to make exact: the run's own precision
        assert protocol.holdout_config(RunConfig(task="boolq", precision=setting), "cpu").precision == setting
    # auto with mean-ablation or bf16 weights: fp32 (the rechecks zero heads, from fp32 weights), not an error
    assert protocol.run_precision(RunConfig(task="boolq", precision="auto", ablation="mean"), "cpu") == "fp32"
    assert protocol.run_precision(RunConfig(task="boolq", precision="auto", dtype="bfloat16"), "cpu") == "fp32"
    with pytest.raises(ValueError, match="ablation mean"):
        RunConfig(task="boolq", precision="guarded", ablation="mean").validate()
