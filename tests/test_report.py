"""Aggregation and per-run tables from hand-made artifacts (no model), the paper reference, and the toc."""
import math
import re
import shutil
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import yaml

from cel_utils.book import key_results, paper_comparison, results_page, run_page, strategies_page, text
from cel_utils.book.build import BookPaths, toc_dict
from cel_utils.book.titles import run_title
from cel_utils.pipeline import stats_schema
from cel_utils.pipeline.artifacts import from_json, load_artifacts, write_json

REPO = Path(__file__).resolve().parents[1]


def make_artifact(model="tiny-model", task="arithmetic_2da", seed=0, full=0.5, ablated=0.75, n_items=8,
                  data=None) -> dict:
    """A small artifact, numbers chosen by hand, in the oldest form pages still read (version 1, before per-item
    outcomes, floors, the control or the run info: its timings inline), brought to today's form by the schema's
    migration as every artifact read from disk is."""
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
    return from_json({
        "schema_version": 1, "kind": "cel-run",
        "config": {"model": model, "task": task, "seed": seed, "p": 2, "k": 2, "fmt": "plain", "engine": "naive",
                   "n_discovery": 4, "n_holdout": n_items},
        "model": {"spec": f"random:{model}", "name": model, "source": {"kind": "random"}, "dtype": "float32",
                  "device": "cpu", "fingerprint": "f", "model_type": "llama",
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
        "discovery": {"item_ids": ["d0", "d1", "d2", "d3"], "full_accuracy": 0.5, "full_correct": [1, 1, 0, 0],
                      "full_metrics": {"acc": 0.5}},
        "n_interventions_evaluated": 8, "timings": {"search_s": 1.0, "holdout_s": 0.5}, "versions": {},
    }, "make_artifact")


def reliability(**parts) -> dict:
    """A reliability section with the given parts, the others absent (None), as the schema has it."""
    return {**dict.fromkeys(stats_schema.Reliability.__required_keys__), **parts}


def floors(**parts) -> dict:
    """A floors section with the given parts, the others absent."""
    return {"n_items": 8, "chance": None, "best_constant": None, "labels": None, "labels_shared": True,
            "gold_shares": None, **parts}


def test_cell_text_from_a_hand_made_artifact(tmp_path):
    write_json(tmp_path / "tiny-model__arithmetic_2da__seed0.json", make_artifact(full=0.50, ablated=0.75))
    table = results_page.summarize(load_artifacts(tmp_path))
    assert len(table) == 1
    assert table.holdout[0] == "50.0 -> 75.0 (+25.0)"
    assert table.heads[0] == "L0.H0+L1.H2"


def test_numbers_as_text():
    assert text.transition_text(0.704, 0.835) == "70.4 -> 83.5 (+13.1)"
    assert text.transition_text(0.5, 0.25) == "50.0 -> 25.0 (-25.0)"
    # 32/80 - 35/80 is -0.0374999... in floats; the printed gain must match the printed accuracies
    assert text.transition_text(35 / 80, 32 / 80, 100 * (32 / 80 - 35 / 80)) == "43.8 -> 40.0 (-3.8)"
    assert text.rer_text(100 * 13.1 / 29.6) == "44.3%"
    assert text.rer_text(float("nan")) == "n/a"
    assert text.provenance_text({"source": "mirror", "fallback": "no train"}).startswith("mirror (no train split")
    assert text.provenance_text({"source": "generated"}) == "generated"
    assert [text.ordinal(x) for x in (1, 2, 3, 4, 11, 12, 13, 21, 62.4, 100, 101, 111, 112)] == [
        "1st", "2nd", "3rd", "4th", "11th", "12th", "13th", "21st", "62nd", "100th", "101st", "111th", "112th"]
    assert (text.p_is(0.0004), text.p_is(0.2), text.p_is(0.031)) == ("p < 0.001", "p = 0.20", "p = 0.031")


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
    assert "| [tiny-model, arithmetic_2da (seed 0)](runs/tiny-model__arithmetic_2da__seed0.ipynb) | 50.0 -> 75.0 (+25.0) |" in text
    assert "| tiny-model, boolq (seed 0) | 60.0 -> 55.0 (-5.0) |" in text  # no page: no link
    verdicts = text[text.index("## Verdicts"):]
    assert verdicts.index("arithmetic_2da (seed 0)") < verdicts.index("boolq (seed 0)")  # tasks in the paper's order
    assert "70.40 -> 83.50 (+13.10), 44.26%" in text
    intro = (page.parent / results_page.INTRO_FIGURE).read_text()  # the intro's small copy: both runs, one link
    assert intro.count('class="plotly-graph-div"') == 1 and "boolq (seed" not in intro and "tiny-model \\u00b7 boolq" in intro
    assert "runs\\u002ftiny-model__arithmetic_2da__seed0.html" in intro and "tiny-model__boolq__seed0.html" not in intro


def test_results_page_without_runs(tmp_path):
    page = results_page.write_results_page(tmp_path / "missing", tmp_path / "results.md")
    assert "No runs yet" in page.read_text()
    assert "No runs yet" in (tmp_path / results_page.INTRO_FIGURE).read_text()  # the intro still has its file


PAPER_README = REPO.parent / "shared" / "paper" / "README.md"
PAPER_COLUMNS = {"SmolLM3-3B": 1, "Qwen2.5-3B-Instruct": 2, "Llama-3.2-3B-Instruct": 3}  # in the paper's table


def _paper_rows() -> list[dict]:
    return results_page.read_paper_table(REPO / "data" / "paper_table1.csv")


def test_paper_table_has_all_twelve_cells_consistent_with_their_printed_figures():
    rows = _paper_rows()
    assert {(r["model"], r["task"]) for r in rows} == {(m, t) for m in paper_comparison.PAPER_MODELS
                                                       for t in results_page.TASK_ORDER}
    assert len(rows) == 12
    for r in rows:
        full, ablated, gain = float(r["full_accuracy"]), float(r["ablated_accuracy"]), float(r["gain_points"])
        assert abs((ablated - full) - gain) <= 0.01 + 1e-9, r  # printed gains are ablated - full up to count rounding
    # The two printed relative error reductions are the column's extremes and the formula reproduces them.
    printed = {(r["model"], r["task"]): float(r["relative_error_reduction"]) for r in rows if r["relative_error_reduction"]}
    assert printed == {("SmolLM3-3B", "arithmetic"): 44.26, ("SmolLM3-3B", "mbpp"): 3.23}
    rers = {(r["model"], r["task"]): paper_comparison.paper_rer(r) for r in rows}
    for cell, value in printed.items():
        assert rers[cell] == (value, False)
    computed = [value for value, was_computed in rers.values() if was_computed]
    assert len(computed) == 10 and all(3.23 <= value <= 44.26 for value in computed)
    by_cell = {(r["model"], r["task"]): r for r in rows}
    assert paper_comparison.paper_cell(by_cell[("SmolLM3-3B", "arithmetic")]) == "70.40 -> 83.50 (+13.10), 44.26%"
    # printed gain 1.29 although 77.05 - 75.75 = 1.30; relative error reduction computed and marked
    assert paper_comparison.paper_cell(by_cell[("SmolLM3-3B", "hellaswag")]) == "75.75 -> 77.05 (+1.29), 5.32%\\*"


def _readme_table1() -> dict:
    """The paper README's Table 1, parsed: {(model, task): (full, ablated, gain, rer or None)}."""
    pattern = re.compile(r"([\d.]+) -> ([\d.]+) \(\+([\d.]+)\), ([\d.]+)%(\*?)")
    cells = {}
    for line in PAPER_README.read_text().splitlines():
        parts = [part.strip() for part in line.strip().strip("|").split("|")]
        if len(parts) != 4 or parts[0].lower() not in results_page.TASK_ORDER:
            continue
        for model, column in PAPER_COLUMNS.items():
            match = pattern.fullmatch(parts[column])
            assert match, parts[column]
            full, ablated, gain, rer, star = match.groups()
            cells[(model, parts[0].lower())] = (float(full), float(ablated), float(gain), None if star else float(rer),
                                                float(rer))
    return cells


@pytest.mark.skipif(not PAPER_README.exists(), reason=f"the paper's documents are not beside the checkout ({PAPER_README})")
def test_paper_table_transcription_matches_the_papers_table():
    table = _readme_table1()
    assert len(table) == 12
    for row in _paper_rows():
        full, ablated, gain, printed_rer, any_rer = table[(row["model"], row["task"])]
        assert (float(row["full_accuracy"]), float(row["ablated_accuracy"]), float(row["gain_points"])) == (full, ablated, gain)
        assert (float(row["relative_error_reduction"]) if row["relative_error_reduction"] else None) == printed_rer
        rer, computed = paper_comparison.paper_rer(row)
        assert computed == (printed_rer is None) and round(rer, 2) == any_rer  # what the page shows, computed or printed


def test_results_page_shows_the_papers_twelve_cells(tmp_path):
    page = results_page.write_results_page(tmp_path / "no-results", tmp_path / "results.md",
                                           paper_table=REPO / "data" / "paper_table1.csv").read_text()
    section = page[page.index("## The paper's Table 1"):]
    rows = [line for line in section.splitlines() if line.startswith("| ") and "->" in line]
    assert len(rows) == 4 and all(line.count("->") == 3 for line in rows)
    assert section.count("\\*") == 10 and "Can Capability Enhancement Be Localized to Specific Attention Heads?" in section


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
    # Nothing helps: every single head scores like the full model (MBPP on 2 items), the first one is frozen.
    flat = {"accuracy": 0.5, "gain_points": 0.0, "n_correct": 2, "harm": 0, "help": 0}
    art["stage1"] = [dict(flat, heads=[h]) for h in ("L0.H0", "L0.H1", "L0.H2")]
    art["stage2"] = [dict(flat, heads=["L0.H0", "L0.H1"])] + art["stage1"][:2]
    art["frozen"] = {"heads": ["L0.H0"], "label": "L0.H0", "discovery": art["stage1"][0]}
    note = run_page.selection_note(art)
    assert "gain is +0.0 points), so the search found nothing" in note and "4 of the 4 evaluated sets tie" in note
    assert run_page.holdout_sentence(art).endswith(note)


def test_heatmap_puts_each_gain_in_its_cell_and_marks_pool_and_frozen_heads():
    from cel_utils.book import interactive, plots

    art = make_artifact()
    gains = plots.stage1_gains(art)
    assert gains.shape == (2, 3)
    assert gains[1, 2] == 25.0 and gains[0, 1] == -25.0 and gains[0, 0] == 0.0
    figure = interactive.stage1_heatmap_figure(art)
    heatmap = figure.figure.data[0]
    assert heatmap.z[1][2] == 25.0
    assert [list(row) for row in heatmap.text] == [["2", "", ""], ["", "", "1"]]  # pool ranks where the pool heads are
    assert heatmap.customdata[1][2][0] == "L1.H2"
    assert heatmap.customdata[0][1][1] == "discovery gain -25.00 points<br>harm 1, help 0<br>accuracy 25.0%"
    assert "FROZEN" in heatmap.customdata[0][0][2] and "pool rank 2" in heatmap.customdata[0][0][2]
    # a head a screened stage 1 never scored exactly says so on hover, instead of "+NaN points"
    screened = {**art, "stage1": [s for s in art["stage1"] if s["heads"] != ["L0.H1"]]}
    cell = interactive.stage1_heatmap_figure(screened).figure.data[0].customdata[0][1]
    assert list(cell[1:]) == ["discovery gain: not scored", "not scored exactly (screened out)"]
    outlined = {(s.x0 + 0.5, s.y0 + 0.5) for s in figure.figure.layout.shapes}
    assert outlined == {(0, 0), (2, 1)}  # the frozen heads L0.H0 and L1.H2 (x = head, y = layer)
    bundle = figure._repr_mimebundle_()
    assert "plotly-graph-div" in bundle["text/html"] and "<script src" not in bundle["text/html"]  # nothing fetched
    assert set(bundle) == {"text/html", "text/plain"} and len(bundle["text/plain"]) < 200


def test_heatmap_colours_are_not_washed_out_by_a_few_very_harmful_heads():
    from cel_utils.book.interactive import NEUTRAL, colour_limits

    step = 100 / 80  # one of 80 discovery items
    gains = np.array([1.25, 2.5] + [0.0] * 90 + [-1.25] * 5 + [-40.0, -45.0, -50.0, -60.0])
    limits = colour_limits(gains, step)
    assert limits.high == 2.5  # the best head gets the deepest blue, whatever the negative side holds
    assert -5 < limits.low < 0 and limits.clipped == 4  # the four catastrophic heads are clipped, and counted
    # white sits at zero, and the +1.25 head is half-way up the positive side (a symmetric +-60 scale: 1/48 of it)
    assert limits.colourscale()[2] == [limits.zero_at, NEUTRAL] and 0 < limits.zero_at < 1
    assert (1.25 - limits.low) / (limits.high - limits.low) == pytest.approx(limits.zero_at + 0.5 * (1 - limits.zero_at))
    nothing_helps = colour_limits(np.array([0.0, -2.5, 0.0]), step)
    assert nothing_helps.high == step and nothing_helps.low <= -step  # each side at least one item wide


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
    from cel_utils.tasks.catalog import get_task

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


def test_committed_toc_globs_pick_up_run_theory_and_strategy_pages(tmp_path):
    shutil.copy(REPO / "_toc.yml", tmp_path / "_toc.yml")
    book = tmp_path / "book"
    runs, theory, failed = book / "runs", book / "theory", tmp_path / "results" / "failed"
    for folder in (runs, theory, failed, book / "strategies"):
        folder.mkdir(parents=True)
    (runs / "Qwen2.5-3B-Instruct__boolq__seed1.ipynb").write_text("{}")
    (runs / "m__arithmetic__seed0.ipynb").write_text("{}")
    (runs / ".m__boolq__seed0.abc.ipynb").write_text("{}")  # a staging file being written: never a page
    (failed / "bad__boolq__seed0.ipynb").write_text("{}")
    paths = BookPaths(root=tmp_path)
    parts = {p["caption"]: p for p in toc_dict(paths)["parts"]}
    assert parts["Runs"]["chapters"] == [{"file": "book/runs/Qwen2.5-3B-Instruct__boolq__seed1.ipynb"},
                                         {"file": "book/runs/m__arithmetic__seed0.ipynb"}]
    assert parts["Theory"]["chapters"] == [{"file": "book/theory"}]  # no executed theory notebooks yet
    assert "sections" not in next(c for c in parts["CEL"]["chapters"] if c["file"] == "book/beyond")
    assert "glob" not in yaml.safe_dump(toc_dict(paths))

    (theory / "theory_simulation.ipynb").write_text("{}")
    (theory / "theory_derivation.ipynb").write_text("{}")
    for page in runs.glob("*.ipynb"):
        page.unlink()
    toc = toc_dict(paths)
    assert "Runs" not in [p["caption"] for p in toc["parts"]]  # an empty part disappears
    theory_part = next(p for p in toc["parts"] if p["caption"] == "Theory")
    assert theory_part["chapters"][0]["sections"] == [{"file": "book/theory/theory_derivation.ipynb"},
                                                      {"file": "book/theory/theory_simulation.ipynb"}]
    with pytest.raises(ValueError, match="runs pages must be in"):
        toc_dict(BookPaths(root=tmp_path, runs_dir=tmp_path / "elsewhere" / "runs"))


def test_committed_toc_lists_every_committed_page():
    toc = yaml.safe_load((REPO / "_toc.yml").read_text())
    listed = {toc["root"]} | {entry["file"] for entry in _toc_entries(toc["parts"]) if "file" in entry}
    committed = {f"book/{p.stem}" for p in (REPO / "book").glob("*.md") if p.name != "results.md"} | {"book/results"}
    assert committed <= listed, committed - listed
    assert {entry["glob"] for entry in _toc_entries(toc["parts"]) if "glob" in entry} == {
        "book/runs/*", "book/strategies/*", "book/theory/*"}


def _toc_entries(entries: list[dict]) -> list[dict]:
    return [e for entry in entries for e in [entry] + _toc_entries(entry.get("chapters", []) + entry.get("sections", []))]


def test_run_title():
    assert run_title("smollm2-135m-instruct__boolq__seed0") == "smollm2-135m-instruct on boolq (seed 0)"
    assert run_title("odd") == "odd"


def test_nan_relative_error_reduction_when_the_full_model_is_perfect(tmp_path):
    write_json(tmp_path / "x.json", make_artifact(full=1.0, ablated=1.0))
    table = results_page.summarize(load_artifacts(tmp_path))
    assert table.holdout[0] == "100.0 -> 100.0 (+0.0)" and table.gain_points[0] == 0.0
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


def test_a_table_row_wider_than_its_header_is_an_error():
    from cel_utils.book.text import md_table

    assert md_table(["a", "b"], [["1", "2"]]).splitlines()[-1] == "| 1 | 2 |"
    with pytest.raises(ValueError, match="3 cells for 2 columns"):
        md_table(["a", "b"], [["1", "2", "3"]])


def _answered(task: str, full: list[int], ablated: list[int], labels: list[str], model: str = "tiny-model") -> dict:
    art = make_artifact(model=model, task=task, full=0.5, ablated=0.5, n_items=len(full))
    art["floors"] = floors(labels=labels, chance=1 / len(labels), n_items=len(full))
    art["holdout"]["full_predictions"], art["holdout"]["ablated_predictions"] = full, ablated
    return art


def test_the_results_page_names_a_response_bias_shift_only_where_the_changed_answers_go_one_way(tmp_path):
    one_way = _answered("boolq", [0] * 20 + [1] * 4, [1] * 19 + [0] + [1] * 4, ["no", "yes"])  # 19 no->yes, 0 back
    both_ways = _answered("boolq", [0] * 10 + [1] * 10, [1] * 10 + [0] * 10, ["no", "yes"], model="other")  # 10 and 10
    arts = [one_way, both_ways]
    write_json(tmp_path / "a.json", one_way)
    write_json(tmp_path / "b.json", both_ways)
    table = results_page.summarize(load_artifacts(tmp_path))
    sentence = results_page.bias_sentence(table, arts)
    assert "tiny-model on boolq, where 19 of the 19 changed answers went 'no' -> 'yes'" in sentence
    assert "other on boolq" not in sentence
    assert results_page.bias_sentence(table, [both_ways, dict(both_ways, model={"name": "tiny-model"})]).startswith(
        "In none of the 2 multiple-choice runs")


def test_the_results_page_keeps_each_runs_details_on_its_run_page(tmp_path):
    """The long verdict sentence is in the run page's key-result box, not on the results page; the results page's
    verdict table is one short row per run."""
    art = make_artifact(task="boolq", full=0.5, ablated=0.6, n_items=40)
    art["holdout"]["full_correct"] = [1] * 20 + [0] * 20
    art["holdout"]["ablated_correct"] = [1] * 20 + [1] * 4 + [0] * 16
    write_json(tmp_path / "results" / "a.json", art)
    page = results_page.write_results_page(tmp_path / "results", tmp_path / "results.md").read_text()
    verdict = run_page.verdict_of(art)["text"]
    assert verdict not in page and verdict in key_results.key_result(art)
    row = next(line for line in page.splitlines() if line.startswith("| tiny-model, boolq"))
    assert row.count("|") == 8 and "**" + run_page.verdict_word(run_page.verdict_of(art)) + "**" in row


def test_every_run_at_once_lists_the_runs_top_down_in_the_tables_order(tmp_path):
    from cel_utils.book.overview_figure import overview_figure

    with_null = make_artifact(task="boolq")
    with_null["reliability"] = reliability(null={"size": 2, "n_sets": 1, "sets": ["L0.H1+L1.H0"], "gains_points": [1.0],
                                                 "selected_gain_points": 25.0, "percentile": 100.0, "p_value": 0.5, "n": 1,
                                                 "quantiles": {"min": -1.0, "q25": 0.0, "median": 0.0, "q75": 0.0,
                                                               "max": 1.0}})
    write_json(tmp_path / "a.json", make_artifact(task="arithmetic_2da"))  # no random sets: its row has no band
    write_json(tmp_path / "b.json", with_null)
    table = results_page.summarize(load_artifacts(tmp_path))
    figure = overview_figure(table, {r.stem: a for r, a in zip(table.itertuples(), [make_artifact(), with_null])}, [])
    order = list(figure.figure.layout.yaxis.categoryarray)
    assert order[::-1] == [f"{r.model} · {r.task}" for r in table.itertuples()]  # plotly's first category is the bottom
