"""The transfer matrix (cel_utils.pipeline.transfer): each frozen set scored on the other tasks' holdouts, from tiny
random-model runs of the smoke preset; and its place on the results page beside the paper's Table 1."""
from __future__ import annotations

import json
import re

import numpy as np
import pytest

from cel_utils.cli import main
from cel_utils.config import RunConfig, TransferConfig
from cel_utils.evaluation.evaluator import NaiveEvaluator
from cel_utils.models.heads import parse_head
from cel_utils.models.loading import load_model
from cel_utils.pipeline.artifacts import read_artifact
from cel_utils.pipeline.protocol import run_cel
from cel_utils.pipeline.transfer import (load_transfers, matrix, read_transfer, run_transfer, transfer_item_indices,
                                         transfer_path)
from cel_utils.tasks.splits import load_task_data

MODEL = "random:llama:tiny"
TASKS = ("arithmetic_2da", "boolq", "hellaswag")
SEED = 0


@pytest.fixture(scope="module")
def lm():
    return load_model(MODEL)


@pytest.fixture(scope="module")
def runs(tmp_path_factory, data_dir, lm):
    """The three tasks' runs of one tiny model (smoke preset), as the grid would leave them."""
    results = tmp_path_factory.mktemp("results")
    for task in TASKS:
        config = RunConfig.from_dict({"model": MODEL, "task": task, "seed": SEED, "preset": "smoke",
                                      "results_dir": str(results), "data_dir": data_dir, "n_resamples": 0})
        run_cel(config, lm=lm, progress=False)
    return results


def test_off_diagonal_cells_equal_a_direct_evaluation_of_the_set_on_those_items(runs, lm, data_dir):
    result = run_transfer(runs, MODEL, SEED, TASKS, given={"transfer_items": 5}, lm=lm, progress=False, say=lambda _: None)
    transfer = read_transfer(result.path)
    assert result.status == "ok" and result.n_evaluations == 6 and transfer["tasks"] == list(TASKS)
    arts = {task: read_artifact(runs / f"random-llama-tiny__{task}__seed{SEED}.json") for task in TASKS}
    for cell in transfer["cells"]:
        if cell["diagonal"]:
            continue
        target = arts[cell["target"]]
        data = load_task_data(cell["target"], target["data"]["n_discovery"], target["holdout"]["n_items"], seed=SEED,
                              num_fewshot=target["config"]["num_fewshot"], data_dir=data_dir)
        indices = transfer_item_indices(len(data.holdout), 5, SEED)
        assert cell["item_indices"] == indices.tolist() and cell["n_items"] == 5 < len(data.holdout)
        direct = NaiveEvaluator(lm, data.task, [data.holdout[i] for i in indices], data.fewshot, progress=False)
        heads = [parse_head(h) for h in arts[cell["source"]]["frozen"]["heads"]]
        full, ablated = direct.evaluate([(), heads])
        assert cell["heads"] == arts[cell["source"]]["frozen"]["heads"]
        assert cell["ablated_correct"] == ablated.correct.astype(int).tolist()
        assert cell["full_correct"] == full.correct.astype(int).tolist()  # the run's stored outcomes, on those items
        assert cell["gain_points"] == pytest.approx(100 * (ablated.accuracy - full.accuracy))
        assert (cell["help"], cell["harm"]) == (int((ablated.correct & ~full.correct).sum()),
                                                int((full.correct & ~ablated.correct).sum()))
        assert cell["power"]["n_items"] == 5 and cell["verdict"]["kind"] in ("gain", "loss", "not significant",
                                                                              "underpowered")


def test_diagonal_is_each_runs_own_holdout_result(runs, lm):
    transfer = read_transfer(run_transfer(runs, MODEL, SEED, TASKS, given={"transfer_items": 5}, lm=lm,
                                          progress=False, say=lambda _: None).path)
    gains = matrix(transfer)
    for i, task in enumerate(TASKS):
        art = read_artifact(runs / f"random-llama-tiny__{task}__seed{SEED}.json")
        (cell,) = [c for c in transfer["cells"] if c["source"] == c["target"] == task]
        stored = art["reliability"]
        assert cell["significance"] == stored["significance"] and cell["power"] == stored["power"]
        assert cell["verdict"] == stored["verdict"]  # with the run's calibration clause
        assert cell["n_items"] == art["holdout"]["n_items"] and cell["item_indices"] is None
        assert gains[i, i] == pytest.approx(art["holdout"]["gain_points"])


def test_an_up_to_date_matrix_is_kept_and_a_changed_input_recomputes_it(runs, lm):
    quiet = {"lm": lm, "progress": False, "say": lambda _: None}
    first = run_transfer(runs, MODEL, SEED, TASKS, given={"transfer_items": 4}, **quiet)
    assert run_transfer(runs, MODEL, SEED, TASKS, given={"transfer_items": 4}, **quiet).status == "skipped"
    again = run_transfer(runs, MODEL, SEED, TASKS, given={"transfer_items": 6}, **quiet)
    assert again.status == "ok" and {c["n_items"] for c in read_transfer(first.path)["cells"] if not c["diagonal"]} == {6}


def test_bad_input_is_a_clear_error_and_leaves_no_file(runs, lm, tmp_path, monkeypatch):
    with pytest.raises(FileNotFoundError, match=r"random-llama-tiny__mbpp__seed0\.json.*cel grid"):
        run_transfer(runs, MODEL, SEED, (*TASKS, "mbpp"), lm=lm, progress=False)
    with pytest.raises(ValueError, match=r"\['n_holdout'\] differ"):
        run_transfer(runs, MODEL, SEED, TASKS, given={"n_holdout": 3}, lm=lm, progress=False)
    # a failure while evaluating leaves no matrix (and keeps none half-written)
    import shutil

    copy = tmp_path / "results"
    shutil.copytree(runs, copy, ignore=shutil.ignore_patterns("transfer"))
    calls = []

    def failing(self, interventions, desc=None):
        calls.append(desc)
        if len(calls) == 2:
            raise RuntimeError("killed")
        return original(self, interventions, desc)

    from cel_utils.evaluation.evaluator import Evaluator

    original = Evaluator.evaluate
    monkeypatch.setattr(Evaluator, "evaluate", failing)
    with pytest.raises(RuntimeError, match="killed"):
        run_transfer(copy, MODEL, SEED, TASKS, lm=lm, progress=False, say=lambda _: None)
    assert not transfer_path(copy, "random-llama-tiny", SEED).exists() and load_transfers(copy) == []
    # from the command line: exit 1, the missing artifact named
    assert main(["transfer", "--results-dir", str(copy), "--models", MODEL, "--seeds", "0", "--tasks", "boolq",
                 "mbpp"]) == 1


def test_transfer_items_is_one_declared_setting_the_presets_can_size():
    assert "transfer_items" not in RunConfig.__dataclass_fields__  # the runs' artifacts do not change
    cpu = TransferConfig.from_dict({"task": "boolq", "preset": "cpu"})
    assert RunConfig.from_dict({"task": "boolq", "preset": "cpu"}).n_holdout == cpu.n_holdout
    with pytest.raises(ValueError, match="transfer_items"):
        TransferConfig.from_dict({"task": "boolq", "transfer_items": 0}).validate()
