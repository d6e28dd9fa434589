"""Aggregation and per-run tables from hand-made artifacts (no model), the paper reference, and the toc."""
import csv
import math
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import yaml

from cel_utils.book import results_page, run_page, strategies_page, text
from cel_utils.book.build import BookPaths, toc_dict
from cel_utils.book.titles import run_title
from cel_utils.pipeline.artifacts import SCHEMA_VERSION, load_artifacts, write_json

REPO = Path(__file__).resolve().parents[1]


def make_artifact(model="tiny-model", task="arithmetic_2da", seed=0, full=0.5, ablated=0.75, n_items=8,
                  data=None) -> dict:
    """A minimal artifact with the fields aggregation and the run tables read, numbers chosen by hand."""
    stage1 = [
        {"heads": ["L1.H2"], "accuracy": 0.75, "gain_points": 25.0, "n_correct": 3, "harm": 0, "help": 1},
        {"heads": ["L0.H0"], "accuracy": 0.5, "gain_points": 0.0, "n_correct": 2, "harm": 1, "help": 1},
        {"heads": ["L0.H1"], "accuracy": 0.25, "gain_points": -25.0, "n_correct": 1, "harm": 1, "help": 0},
        {"heads": ["L1.H0"], "accuracy": 0.5, "gain_points": 0.0, "n_correct": 2, "harm": 0, "help": 0},
        {"heads": ["L1.H1"], "accuracy": 0.5, "gain_points": 0.0, "n_correct": 2, "harm": 0, "help": 0},
        {"heads": ["L0.H2"], "accuracy": 0.5, "gain_points": 0.0, "n_correct": 2, "harm": 0, "help": 0},
    ]
    stage2 = [{"heads": ["L0.H0", "L1.H2"], "accuracy": 1.0, "gain_points": 50.0, "n_correct": 4, "harm": 0, "help": 2},
              stage1[0], stage1[1]]
    return {
        "schema_version": SCHEMA_VERSION, "kind": "cel-run",
        "config": {"model": model, "task": task, "seed": seed, "p": 2, "k": 2, "fmt": "plain", "engine": "naive",
                   "n_discovery": 4, "n_holdout": n_items},
        "model": {"name": model, "source": {"kind": "random"}, "dtype": "float32", "device": "cpu", "fingerprint": "f",
                  "geometry": {"n_layers": 2, "n_heads": 3, "n_kv_heads": 1, "head_dim": 4}},
        "task": {"name": task, "kind": "greedy", "metric": "acc", "metrics": ["acc"]},
        "data": data or {"source": "mirror", "n_discovery": 4, "n_holdout": n_items, "num_fewshot": 0},
        "stage1": stage1, "pool": ["L1.H2", "L0.H0"], "stage2": stage2,
        "frozen": {"heads": ["L0.H0", "L1.H2"], "label": "L0.H0+L1.H2", "discovery": stage2[0]},
        "holdout": {"heads": ["L0.H0", "L1.H2"], "heads_label": "L0.H0+L1.H2", "full_accuracy": full,
                    "ablated_accuracy": ablated, "gain_points": 100 * (ablated - full),
                    "relative_error_reduction": 100 * (ablated - full) / (1 - full) if full < 1 else float("nan"),
                    "harm": 0, "help": 2, "n_items": n_items, "full_metrics": {"acc": full},
                    "ablated_metrics": {"acc": ablated}},
        "n_interventions_evaluated": 8, "timings": {"search_s": 1.0, "holdout_s": 0.5},
    }


def test_cell_text_from_a_hand_made_artifact(tmp_path):
    write_json(tmp_path / "tiny-model__arithmetic_2da__seed0.json", make_artifact(full=0.50, ablated=0.75))
    table = results_page.summarize(load_artifacts(tmp_path))
    assert len(table) == 1
    assert table.holdout[0] == "50.0 -> 75.0 (+25.0)"
    assert table.rel_error_reduction[0] == "50.0%"  # 25 / (100 - 50)
    assert table.heads[0] == "L0.H0+L1.H2"
    assert table.data[0] == "mirror"


def test_numbers_as_text():
    assert text.transition_text(0.704, 0.835) == "70.4 -> 83.5 (+13.1)"
    assert text.transition_text(0.5, 0.25) == "50.0 -> 25.0 (-25.0)"
    # 32/80 - 35/80 is -0.0374999... in floats; the printed gain must match the printed accuracies
    assert text.transition_text(35 / 80, 32 / 80, 100 * (32 / 80 - 35 / 80)) == "43.8 -> 40.0 (-3.8)"
    assert text.rer_text(100 * 13.1 / 29.6) == "44.3%"
    assert text.rer_text(float("nan")) == "n/a"
    assert text.provenance_text({"source": "mirror", "fallback": "no train"}).startswith("mirror (no train split")
    assert text.provenance_text({"source": "generated"}) == "generated"


def test_results_page_links_runs_that_have_a_page(tmp_path):
    results, runs = tmp_path / "results", tmp_path / "book" / "runs"
    runs.mkdir(parents=True)
    write_json(results / "a.json", make_artifact(model="tiny-model", task="arithmetic_2da"))
    write_json(results / "b.json", make_artifact(model="tiny-model", task="boolq", full=0.6, ablated=0.55,
                                                 data={"source": "mirror", "fallback": "no train split",
                                                       "n_discovery": 4, "n_holdout": 8}))
    (runs / "tiny-model__arithmetic_2da__seed0.ipynb").write_text("{}")  # only this run has a page
    page = results_page.write_results_page(results, tmp_path / "book" / "results.md", runs, REPO / "data" / "paper_table1.csv")
    text = page.read_text()
    assert "| arithmetic_2da (acc) | [50.0 -> 75.0 (+25.0)](runs/tiny-model__arithmetic_2da__seed0.ipynb), 50.0% |" in text
    assert "| boolq (acc) | 60.0 -> 55.0 (-5.0), -12.5% |" in text  # no page: no link
    assert "mirror (no train split: discovery drawn from validation)" in text
    assert text.index("arithmetic_2da") < text.index("boolq")  # tasks in the paper's order
    assert "70.40 -> 83.50 (+13.10), 44.26%" in text
    assert text.count("not transcribed") >= 11


def test_results_page_without_runs(tmp_path):
    page = results_page.write_results_page(tmp_path / "missing", tmp_path / "results.md")
    assert "No runs yet" in page.read_text()


def test_paper_table_holds_one_transcribed_figure_and_marks_the_rest():
    rows = list(csv.DictReader(open(REPO / "data" / "paper_table1.csv", newline="")))
    cells = {(r["model"], r["task"]) for r in rows}
    assert cells == {(m, t) for m in results_page.PAPER_MODELS for t in results_page.TASK_ORDER}
    transcribed = [r for r in rows if r["status"] == "transcribed"]
    assert [(r["model"], r["task"]) for r in transcribed] == [("SmolLM3-3B", "arithmetic")]
    row = transcribed[0]
    full, ablated, rer = float(row["full_accuracy"]), float(row["ablated_accuracy"]), float(row["relative_error_reduction"])
    assert (full, ablated, rer) == (70.40, 83.50, 44.26)
    assert round(100 * (ablated - full) / (100 - full), 2) == rer
    for r in rows:
        if r["status"] != "transcribed":
            assert r["status"] == "not transcribed" and not r["full_accuracy"] and not r["ablated_accuracy"]
            assert results_page.paper_cell(r) == "not transcribed"


def test_run_tables_from_an_artifact():
    art = make_artifact()
    pool = run_page.pool_table(art)
    assert list(pool["head"]) == ["L1.H2", "L0.H0"] and list(pool.index) == [1, 2]
    top = run_page.stage2_table(art, top=2)
    assert list(top["heads"]) == ["L0.H0+L1.H2", "L1.H2"]
    hold = run_page.holdout_table(art)
    assert hold.loc["acc (primary)", "gain (points)"] == 25.0
    assert hold.loc["acc (primary)", "rel. error reduction"] == "50.0%"
    assert "50.0 -> 75.0 (+25.0)" in run_page.holdout_sentence(art)
    assert run_page.selection_note(art) == ""  # a strict winner with a positive discovery gain
    overview = run_page.run_overview(art)
    assert overview.loc["frozen heads"].iloc[0] == "L0.H0+L1.H2"


def test_selection_note_flags_ties_and_searches_that_found_nothing():
    art = make_artifact()
    tie = dict(art["stage2"][0], heads=["L0.H1", "L1.H2"])  # same counts as the frozen pair
    art["stage2"].append(tie)
    note = run_page.selection_note(art)
    assert "2 of the 8 evaluated sets tie" in note and "found nothing" not in note
    assert results_page._reliability_columns(art)["curse_text"].endswith(", 2 sets tied")  # the results page's column
    # Nothing helps: every single head scores like the full model (MBPP on 2 items), the first one is frozen.
    flat = {"accuracy": 0.5, "gain_points": 0.0, "n_correct": 2, "harm": 0, "help": 0}
    art["stage1"] = [dict(flat, heads=[h]) for h in ("L0.H0", "L0.H1", "L0.H2")]
    art["stage2"] = [dict(flat, heads=["L0.H0", "L0.H1"])] + art["stage1"][:2]
    art["frozen"] = {"heads": ["L0.H0"], "label": "L0.H0", "discovery": art["stage1"][0]}
    note = run_page.selection_note(art)
    assert "gain is +0.0 points), so the search found nothing" in note and "4 of the 4 evaluated sets tie" in note
    assert run_page.holdout_sentence(art).endswith(note)


def test_heatmap_puts_each_gain_in_its_cell():
    import matplotlib

    matplotlib.use("Agg")
    from cel_utils.book import plots

    art = make_artifact()
    gains = plots.stage1_gains(art)
    assert gains.shape == (2, 3)
    assert gains[1, 2] == 25.0 and gains[0, 1] == -25.0 and gains[0, 0] == 0.0
    fig = plots.stage1_heatmap(art)
    mesh = fig.axes[0].collections[0]
    assert mesh.norm.vmin == -25.0 and mesh.norm.vmax == 25.0  # symmetric: zero is the centre colour
    labels = sorted(t.get_text() for t in fig.axes[0].texts)
    assert labels == ["1", "2"]  # pool ranks
    import matplotlib.pyplot as plt

    plt.close(fig)


def _flip_table(predictions_full, predictions_ablated, docs, task):
    """The page's flip table for two items that the ablation flipped, one each way (stored predictions, no model)."""
    from cel_utils.pipeline.examples import flip_examples

    full = SimpleNamespace(correct=np.array([False, True]), predictions=predictions_full)
    ablated = SimpleNamespace(correct=np.array([True, False]), predictions=predictions_ablated)
    items = [SimpleNamespace(id=f"item{i}", doc=doc) for i, doc in enumerate(docs)]
    data = SimpleNamespace(task=task, holdout=items, fewshot=[])
    examples = flip_examples(None, data, SimpleNamespace(full=full, ablated=ablated, heads=()))
    return run_page.flip_table({"holdout": {"examples": examples}})


def test_flip_examples_show_choices_and_code():
    from cel_utils.tasks.specs import get_task

    boolq = get_task("boolq")
    docs = [{"question": "is it", "passage": "P", "answer": True}, {"question": "is it not", "passage": "Q", "answer": False}]
    table = _flip_table([0, 0], [1, 1], docs, boolq)
    assert list(table["flip"]) == ["wrong -> right", "right -> wrong"]
    assert list(table["full model"]) == ["[0] no", "[0] no"] and list(table["ablated model"]) == ["[1] yes", "[1] yes"]
    assert list(table["gold"]) == ["[1] yes", "[0] no"]

    mbpp = get_task("mbpp")
    docs = [{"text": "t", "code": "def f(): pass", "test_list": ["assert f() is None"], "test_setup_code": "", "task_id": 1}] * 2
    preds_full = [{"completion": "def f(): return 1", "status": "failed"}, {"completion": "def f(): pass", "status": "passed"}]
    preds_ablated = [{"completion": "def f(): pass", "status": "passed"}, {"completion": "oops", "status": "error"}]
    table = _flip_table(preds_full, preds_ablated, docs, mbpp)
    assert table["full model"][0] == "[failed]\ndef f(): return 1"
    assert table["ablated model"][1] == "[error]\noops"
    html = run_page.show_flips(table).to_html()
    assert "white-space: pre-wrap" in html


def test_toc_lists_run_pages_with_titles_and_theory_sections(tmp_path):
    (tmp_path / "_toc.template.yml").write_text((REPO / "_toc.template.yml").read_text())
    runs, theory, failed = tmp_path / "book" / "runs", tmp_path / "book" / "theory", tmp_path / "results" / "failed"
    for folder in (runs, theory, failed):
        folder.mkdir(parents=True)
    (runs / "Qwen2.5-3B-Instruct__boolq__seed1.ipynb").write_text("{}")
    (runs / "m__arithmetic__seed0.ipynb").write_text("{}")
    (failed / "bad__boolq__seed0.ipynb").write_text("{}")
    paths = BookPaths(root=tmp_path)
    toc = toc_dict(paths)
    parts = {p["caption"]: p for p in toc["parts"]}
    assert parts["Runs"]["chapters"] == [
        {"file": "book/runs/Qwen2.5-3B-Instruct__boolq__seed1.ipynb", "title": "Qwen2.5-3B-Instruct on boolq (seed 1)"},
        {"file": "book/runs/m__arithmetic__seed0.ipynb", "title": "m on arithmetic (seed 0)"},
    ]
    assert parts["Theory"]["chapters"] == [{"file": "book/theory"}]  # no executed theory notebooks yet
    assert "generated" not in yaml.safe_dump(toc)

    (theory / "theory_derivation.ipynb").write_text("{}")
    for page in runs.glob("*.ipynb"):
        page.unlink()
    toc = toc_dict(paths)
    assert [p["caption"] for p in toc["parts"]] == ["CEL", "Theory"]  # an empty Runs part is dropped
    assert toc["parts"][1]["chapters"][0]["sections"] == [{"file": "book/theory/theory_derivation.ipynb"}]


def test_run_title():
    assert run_title("smollm2-135m-instruct__boolq__seed0") == "smollm2-135m-instruct on boolq (seed 0)"
    assert run_title("odd") == "odd"


def test_nan_relative_error_reduction_when_the_full_model_is_perfect(tmp_path):
    write_json(tmp_path / "x.json", make_artifact(full=1.0, ablated=1.0))
    table = results_page.summarize(load_artifacts(tmp_path))
    assert table.rel_error_reduction[0] == "n/a" and table.holdout[0] == "100.0 -> 100.0 (+0.0)"
    assert math.isnan(make_artifact(full=1.0, ablated=1.0)["holdout"]["relative_error_reduction"])


@pytest.mark.parametrize("bad", ["{", '{"schema_version": 0}'])
def test_a_broken_artifact_is_an_error_not_a_silent_gap(tmp_path, bad):
    (tmp_path / "x.json").write_text(bad)
    with pytest.raises(ValueError):
        results_page.write_results_page(tmp_path, tmp_path / "results.md")


def test_strategies_table_shows_signed_gains_and_cost_relative_to_the_paper():
    row = {"label": "L1.H2", "discovery_gain_points": 12.5, "holdout_gain_points": -3.75, "holdout_ci": [-8.75, 0.0],
           "holdout_p_value": 0.25, "evaluations": 281, "forward_equivalents": 1204.0}
    payload = {"strategies": [dict(row, strategy="exhaustive (paper)"),
                              dict(row, strategy="greedy", discovery_gain_points=0.0, forward_equivalents=3010.0)]}
    table = strategies_page.strategies_table(payload)
    assert list(table["discovery gain"]) == ["+12.5", "+0.0"] and list(table["holdout gain"]) == ["-3.8", "-3.8"]
    assert list(table["holdout 95% CI"]) == ["[-8.8, +0.0]"] * 2
    assert list(table["cost vs exhaustive"]) == ["1.00x", "2.50x"]
