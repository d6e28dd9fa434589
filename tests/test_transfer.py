"""The transfer matrix (cel_utils.pipeline.transfer): each frozen set scored on the other tasks' holdouts, from tiny
random-model runs of the smoke preset; and its place on the results page beside the paper's Table 1."""
from __future__ import annotations

import re

import pytest

from cel_utils.cli import main
from cel_utils.config import RunConfig, TransferConfig
from cel_utils.evaluation.evaluator import NaiveEvaluator
from cel_utils.models.heads import parse_head
from cel_utils.models.loading import load_model
from cel_utils.pipeline.artifacts import read_artifact
from cel_utils.pipeline.protocol import run_cel
from cel_utils.pipeline.transfer import (load_transfers, matrix, read_transfer, run_transfer, run_transfers,
                                         transfer_item_indices, transfer_path)
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
    with pytest.raises(ValueError, match="transfer_items must be a positive integer or None, got 0"):
        run_transfer(runs, MODEL, SEED, TASKS, given={"transfer_items": 0}, lm=lm, progress=False)
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


def test_matrices_computed_at_once_in_workers_are_the_bytes_of_one_at_a_time(runs, lm, data_dir, tmp_path):
    """`cel main --jobs 2` runs two models' transfer steps in two worker processes: the same files as one after the
    other, and a step that fails does not stop the other (exit status 1, its reason said)."""
    import shutil

    copy = tmp_path / "results"
    shutil.copytree(runs, copy, ignore=shutil.ignore_patterns("transfer"))
    for task in TASKS:  # a second seed's runs: a second matrix
        run_cel(RunConfig.from_dict({"model": MODEL, "task": task, "seed": 1, "preset": "smoke", "results_dir": str(copy),
                                     "data_dir": data_dir, "n_resamples": 0, "cache": False}), lm=lm, progress=False)
    given = {"transfer_items": 4, "cache": False}
    said = []
    selection = [(MODEL, 0, None), (MODEL, 1, None), (MODEL, 2, ["boolq", "mbpp"])]
    assert run_transfers(copy, selection, given, jobs=2, say=said.append) == 1
    at_once = {path.name: path.read_bytes() for path in (copy / "transfer").glob("*.json")}
    assert sorted(at_once) == ["random-llama-tiny__seed0.json", "random-llama-tiny__seed1.json"]
    failed = [line for line in said if line.startswith("transfer: FAILED")]
    assert len(failed) == 1 and "(seed 2)" in failed[0] and "mbpp" in failed[0], said
    shutil.rmtree(copy / "transfer")
    assert run_transfers(copy, selection[:2], given, jobs=1, say=lambda _: None) == 0
    assert {path.name: path.read_bytes() for path in (copy / "transfer").glob("*.json")} == at_once


def test_transfer_items_is_one_declared_setting_the_presets_can_size():
    assert "transfer_items" not in RunConfig.__dataclass_fields__  # the runs' artifacts do not change
    cpu = TransferConfig.from_dict({"task": "boolq", "preset": "cpu"})
    assert RunConfig.from_dict({"task": "boolq", "preset": "cpu"}).n_holdout == cpu.n_holdout
    with pytest.raises(ValueError, match="transfer_items"):
        TransferConfig.from_dict({"task": "boolq", "transfer_items": 0}).validate()


def test_results_page_shows_the_heat_map_the_words_and_the_papers_table_beside_ours(runs, lm, tmp_path):
    from cel_utils.book.results_page import read_paper_table, write_results_page

    from conftest import REPO

    run_transfer(runs, MODEL, SEED, TASKS, given={"transfer_items": 5}, lm=lm, progress=False, say=lambda _: None)
    transfer = load_transfers(runs)[0]
    page = write_results_page(runs, tmp_path / "results.md", paper_table=REPO / "data" / "paper_table1.csv").read_text()
    section = page[page.index("(transfer-matrix)="):page.index("## The paper's Table 1 beside ours")]
    assert section.count('class="plotly-graph-div"') == 1 and "<script src" not in section  # offline figure
    figure = section[section.index("```{raw} html"):].replace("\\u003c", "<").replace("\\u003e", ">")  # plotly's JSON
    for cell in transfer["cells"]:  # every cell's hover: interval, p, helped/harmed counts
        sig = cell["significance"]
        assert (f"{cell['gain_points']:+.1f} points)<br>95% CI [{sig['ci_low']:+.1f}, {sig['ci_high']:+.1f}], McNemar "
                f"p = {sig['p_value']:.2f} alone<br>") in figure
        assert f"helped {cell['help']}, harmed {cell['harm']} of {cell['n_items']}" in figure
    for task in TASKS:  # one generated sentence per set
        assert f"The set found on {task} (`" in section
    assert re.search(r"of the 6 off-diagonal cells, \d+ (is|are) significant after Holm's adjustment for the 6, and "
                     r"\d+ rules? out harm larger than 1.29 points", section)
    paper = page[page.index("## The paper's Table 1 beside ours"):]
    header = next(line for line in paper.splitlines() if line.startswith("| task |"))
    assert header.count("paper:") == 3 and header.rstrip(" |").endswith("random-llama-tiny")
    for family in ("arithmetic", "boolq", "hellaswag", "mbpp"):
        assert f"* **{family}:** the paper's 3 models gain" in paper
    mbpp = [float(r["gain_points"]) for r in read_paper_table(REPO / "data" / "paper_table1.csv") if r["task"] == "mbpp"]
    gains = re.escape(f"* **mbpp:** the paper's 3 models gain {min(mbpp):+.2f} to {max(mbpp):+.2f} points from full")
    assert re.search(gains + r" accuracies of [\d.]+% to [\d.]+%; none of our models ran it\.", paper)
    assert "What the CPU hour left out, and what --preset paper on a GPU adds" in paper
    assert "| random-llama-tiny, boolq | 6 / 8 | 2,000 / 3,270 (or as many as the data hold) |" in paper


def _hand_matrix(rows: dict[tuple[str, str], tuple[int, int, int]], n: int = 200) -> dict:
    """A transfer matrix from (helped, harmed, unchanged-correct) counts per cell, with the real tests on them."""
    from cel_utils.pipeline.transfer import cell_json

    tasks = sorted({s for s, _ in rows})
    cells = []
    for (source, target), (helped, harmed, kept) in rows.items():
        full = [0] * helped + [1] * harmed + [1] * kept + [0] * (n - helped - harmed - kept)
        ablated = [1] * helped + [0] * harmed + [1] * kept + [0] * (n - helped - harmed - kept)
        cells.append(cell_json(source, target, ["L0.H0"], "L0.H0", full, ablated, 0, n))
    return {"tasks": tasks, "cells": cells, "model": {"name": "m"}, "seed": 0, "metrics": {t: "acc" for t in tasks}}


def test_the_words_name_a_trade_only_where_both_tests_are_significant():
    from cel_utils.book.transfer_page import transfer_sentences

    trade = _hand_matrix({("a", "a"): (30, 5, 80), ("a", "b"): (2, 25, 90), ("b", "a"): (10, 8, 80),
                          ("b", "b"): (12, 10, 80)})
    text = " ".join(transfer_sentences(trade))
    assert "a's set helps a while hurting b" in text and "significantly hurts b (-11.5 points" in text
    assert "On a harm up to" in text and "is not ruled out" in text  # b's set on a: what it leaves open, not a claim
    flat = _hand_matrix({("a", "a"): (30, 5, 80), ("a", "b"): (12, 10, 90), ("b", "a"): (10, 8, 80),
                         ("b", "b"): (1, 0, 80)})
    text = " ".join(transfer_sentences(flat))
    assert "Help here, harm there" not in text and "significantly hurts" not in text
    assert "helps" not in text.replace("helps its own task", "")
    assert "On a (18 of 200 answers changed)" not in text  # 18 changes are enough to test: not "underpowered"
    assert "b (`L0.H0`) shows no significant change on its own holdout (+0.5 points)" in text


def test_a_guarded_runs_transfer_cells_are_scored_in_fp32(runs, lm, tmp_path, monkeypatch):
    """Issue 46: a transfer cell scores holdout items, which are fp32's where the run's search was guarded
    (protocol.holdout_config), so the matrix is the same numbers on every machine."""
    import json
    import shutil

    from cel_utils.pipeline import protocol

    copy = tmp_path / "results"
    shutil.copytree(runs, copy, ignore=shutil.ignore_patterns("transfer"))
    for path in copy.glob("*.json"):  # the same runs, as a guarded search would have recorded them
        artifact = json.loads(path.read_text())
        artifact["config"]["precision"] = "guarded"
        path.write_text(json.dumps(artifact))
    precisions = []
    original = protocol.make_evaluator

    def recording(lm, data, items, config, *args, **kwargs):
        precisions.append((config.precision, protocol.run_precision(config, lm.device)))
        return original(lm, data, items, config, *args, **kwargs)

    monkeypatch.setattr(protocol, "make_evaluator", recording)
    run_transfer(copy, MODEL, SEED, TASKS, given={"transfer_items": 4, "cache": False}, lm=lm, progress=False,
                 say=lambda _: None)
    assert precisions == [("fp32", "fp32")] * len(TASKS)
