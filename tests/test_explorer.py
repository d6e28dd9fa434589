"""The head explorer driven as a user drives it (set a control, press a button, read the shown HTML), with a tiny
random model: what it shows must be what the runs' evaluator computes for the same items and head set."""
from __future__ import annotations

import re
from html import escape

import numpy as np
import pytest

from cel_utils.config import RunConfig
from cel_utils.explore.app import arguments_from_environment
from cel_utils.explore.session import ExploreSession
from cel_utils.explore.widgets import Explorer
from cel_utils.models.heads import HeadId, format_heads
from cel_utils.pipeline.protocol import make_evaluator
from cel_utils.stats.significance import CI_STREAM, paired_test

SETTINGS = dict(model="random:llama:tiny", preset="smoke", n_discovery=6, n_holdout=12, cache=False)


@pytest.fixture(scope="module")
def lm(tokenizer):
    from cel_utils.models.loading import random_model

    return random_model("llama", tokenizer=tokenizer)


@pytest.fixture(scope="module")
def hellaswag(lm, data_dir):
    config = RunConfig.from_dict({**SETTINGS, "task": "hellaswag", "data_dir": data_dir})
    return Explorer(ExploreSession(config, lm))


def shown_scores(html: str, which: str) -> list[float]:
    """The per-option scores a column shows, at the precision of their data attribute."""
    return [float(v) for v in re.findall(rf'data-which="{which}" data-option="\d+" data-value="([^"]+)"', html)]


def shown_correct(html: str, which: str) -> bool:
    return re.search(rf'class="cel-answer" data-which="{which}" data-correct="(\d)"', html).group(1) == "1"


def direct(session: ExploreSession, items, heads):
    """The runs' own evaluator for these items (built as run_cel builds it), full and ablated."""
    evaluator = make_evaluator(session.lm, session.data, items, session.config, progress=False)
    return evaluator.evaluate([(), heads])


def test_switching_heads_off_shows_the_evaluators_scores(hellaswag):
    explorer, session = hellaswag, hellaswag.session
    explorer.split.value, explorer.index.value = "holdout", 3
    item = session.data.holdout[3]
    off = [HeadId(0, 1), HeadId(1, 2)]
    for head in off:
        explorer.toggles[head].value = True  # as a click on the grid does
    assert explorer.heads_text.value == "L0.H1+L1.H2"
    full, ablated = direct(session, [item], off)
    html = explorer.item_out.value
    assert item.id in html and "Ablated: L0.H1+L1.H2" in html
    np.testing.assert_array_equal(shown_scores(html, "full"), full.scores[0])
    np.testing.assert_array_equal(shown_scores(html, "ablated"), ablated.scores[0])
    assert not np.array_equal(full.scores[0], ablated.scores[0])  # the ablation changed what is shown
    assert shown_correct(html, "full") == bool(full.correct[0])
    assert shown_correct(html, "ablated") == bool(ablated.correct[0])
    chosen = int(np.argmax(ablated.scores[0]))
    assert f"chose [{chosen}]" in html.split('data-which="ablated"')[1]

    explorer.clear.click()
    assert explorer.heads == () and "no head is switched off" in explorer.item_out.value
    assert shown_scores(explorer.item_out.value, "ablated") == shown_scores(explorer.item_out.value, "full")


def test_typed_heads_and_bad_ids(hellaswag):
    hellaswag.heads_text.value = "L2.H3, L0.H0"
    assert hellaswag.heads == (HeadId(0, 0), HeadId(2, 3))
    assert hellaswag.toggles[HeadId(2, 3)].value and not hellaswag.toggles[HeadId(1, 1)].value
    hellaswag.heads_text.value = "L7.H0"
    assert "outside the model" in hellaswag.status.value and hellaswag.heads == (HeadId(0, 0), HeadId(2, 3))
    hellaswag.clear.click()


def test_search_finds_items_by_their_text(hellaswag):
    explorer, session = hellaswag, hellaswag.session
    explorer.split.value = "discovery"
    target = 4
    words = session.task.doc_to_text(session.data.discovery[target].doc).split()
    explorer.query.value = " ".join(words[2:5])  # a phrase from the middle of its text
    found = [value for _, value in explorer.found.options]
    assert target in found
    assert all(explorer.query.value.lower() in session._searchable(session.data.discovery[i].doc).lower() for i in found)
    explorer.found.value = target
    assert explorer.index.value == target and session.data.discovery[target].id in explorer.item_out.value
    explorer.query.value = "no item says this zqxj"
    assert explorer.found.options == () and "0 item(s) found" in explorer.status.value


def test_own_prompt_is_scored_as_the_dataset_row_it_reads_as(hellaswag):
    from cel_utils.tasks.specs import Item

    explorer, session = hellaswag, hellaswag.session
    endings = ["starts pulling up roofing.", "is eating a cake.", "flies to the moon.", "sleeps on the roof."]
    explorer.own_text.value = "Roof: A man is sitting on a roof. He"
    explorer.own_answers.value = "\n".join(endings)
    explorer.own_gold.value = 2
    explorer.set_heads([HeadId(1, 0)])
    explorer.own_show.click()
    html = explorer.item_out.value
    assert "own prompt" in html and "flies to the moon." in html
    # a HellaSwag row whose fields render to the same text: the task's own prompt code scores it the same
    row = Item("row", {"activity_label": "Roof", "ctx_a": "A man is sitting on a roof.", "ctx_b": "he",
                       "endings": endings, "label": "2"})
    assert session.task.doc_to_text(row.doc) == explorer.own_text.value
    full, ablated = direct(session, [row], [HeadId(1, 0)])
    np.testing.assert_array_equal(shown_scores(html, "full"), full.scores[0])
    np.testing.assert_array_equal(shown_scores(html, "ablated"), ablated.scores[0])
    assert shown_correct(html, "ablated") == bool(ablated.correct[0])
    explorer.own_answers.value = "only one option"
    explorer.own_show.click()
    assert "at least two options" in explorer.item_out.value
    explorer.source.selected_index = 0
    explorer.clear.click()


def test_scoring_n_items_equals_a_direct_evaluation_and_the_run_pages_test(hellaswag):
    explorer, session = hellaswag, hellaswag.session
    explorer.split.value = "holdout"
    explorer.set_heads([HeadId(0, 2), HeadId(2, 1)])
    explorer.n_items.value = 10
    seen = []
    explorer.bar.observe(lambda change: seen.append(change["new"]), "value")
    explorer.score_button.click()
    full, ablated = direct(session, session.data.holdout[:10], [HeadId(0, 2), HeadId(2, 1)])
    test = paired_test(full.correct, ablated.correct, seed=[session.config.seed, CI_STREAM])
    html = explorer.score_out.value
    assert f'data-gain="{test.gain_points!r}" data-help="{test.help}" data-harm="{test.harm}"' in html
    assert f"{test.help} / {test.harm} of 10" in html and f"[{test.ci_low:+.2f}, {test.ci_high:+.2f}]" in html
    np.testing.assert_array_equal(explorer.last_score.ablated.correct, ablated.correct)
    assert explorer.bar.value == explorer.bar.max and len(seen) >= 2  # the bar moved step by step
    golds = [int(item.doc["label"]) for item in session.data.holdout[:10]]  # HellaSwag: the floors of these 10 items
    assert "floor: chance</td><td>25.0%" in html
    assert f"floor: always choosing ending {max(range(4), key=golds.count)}</td><td>" \
           f"{10 * max(map(golds.count, range(4))):.1f}%" in html


def _run_artifact(config: dict, *, frozen: list[str], pool: list[str], stage2: list[list[str]], discovery_ids: list[str],
                  holdout_ids: list[str]) -> dict:
    """A run's artifact (the schema's, from tests/test_report.py) with the sets and items the explorer reads."""
    from test_report import make_artifact

    run = make_artifact(task=config["task"])
    run["config"] = config
    score = run["stage2"][0]
    run["frozen"]["heads"], run["pool"], run["stage2"] = frozen, pool, [dict(score, heads=heads) for heads in stage2]
    run["discovery"]["item_ids"], run["holdout"]["item_ids"] = discovery_ids, holdout_ids
    return run


def test_a_runs_sets_load_from_its_artifact(hellaswag, tmp_path):
    from cel_utils.pipeline.artifacts import write_json

    run = _run_artifact({**SETTINGS, "task": "hellaswag"}, frozen=["L1.H3", "L0.H2"], pool=["L0.H2", "L1.H3", "L2.H0"],
                        stage2=[["L0.H2", "L1.H3"], ["L2.H0"]], discovery_ids=[], holdout_ids=[])
    path = write_json(tmp_path / "run.json", run)
    hellaswag.artifact.value = str(path)
    hellaswag.read_run.click()
    labels = [label for label, _ in hellaswag.run_sets.options]
    assert labels == ["frozen set: L0.H2+L1.H3", "pool: L0.H2+L1.H3+L2.H0", "stage 2: L2.H0"]
    hellaswag.run_sets.value = dict(hellaswag.run_sets.options)["pool: L0.H2+L1.H3+L2.H0"]
    hellaswag.apply_set.click()
    assert hellaswag.heads == (HeadId(0, 2), HeadId(1, 3), HeadId(2, 0))
    assert "Ablated: L0.H2+L1.H3+L2.H0" in hellaswag.item_out.value
    # Another task's run, or a head the model lacks, is refused with the reason
    write_json(tmp_path / "other.json", {**run, "config": {**SETTINGS, "task": "boolq"}})
    hellaswag.artifact.value = str(tmp_path / "other.json")
    hellaswag.read_run.click()
    assert "explore(artifact=...)" in hellaswag.status.value
    write_json(tmp_path / "big.json", {**run, "pool": ["L9.H0"]})
    hellaswag.artifact.value = str(tmp_path / "big.json")
    hellaswag.read_run.click()
    assert "outside the model" in hellaswag.status.value
    hellaswag.clear.click()


def test_explore_opens_a_real_runs_artifact_with_its_items(lm, data_dir, tmp_path):
    from cel_utils import explore
    from cel_utils.pipeline.protocol import run_cel

    config = RunConfig.from_dict({**SETTINGS, "task": "boolq", "n_holdout": 6, "n_random_sets": 0, "n_resamples": 0,
                                  "data_dir": data_dir, "results_dir": str(tmp_path)})
    done = run_cel(config, lm=lm, progress=False)
    explorer = explore(artifact=done.artifact, lm=lm)
    assert explorer.session.config == config
    assert explorer.run_sets.options[0][0] == f"frozen set: {format_heads(done.search.frozen)}"
    explorer.apply_set.click()
    assert explorer.heads == tuple(done.search.frozen)
    # the run's holdout outcome of its frozen set, item by item, is what the explorer scores
    explorer.n_items.value = 6
    explorer.score_button.click()
    np.testing.assert_array_equal(explorer.last_score.ablated.correct, done.holdout.ablated.correct)
    np.testing.assert_array_equal(explorer.last_score.full.correct, done.holdout.full.correct)


def test_greedy_and_generation_items_show_answers(lm, data_dir):
    arithmetic = Explorer(ExploreSession(RunConfig.from_dict({**SETTINGS, "task": "arithmetic_2da",
                                                              "data_dir": data_dir}), lm))
    arithmetic.set_heads(["L0.H0"])
    html = arithmetic.item_out.value
    full, ablated = direct(arithmetic.session, [arithmetic.session.data.holdout[0]], ["L0.H0"])
    assert f'data-which="ablated" data-value="{float(ablated.margin[0])!r}"' in html and "(greedy)" in html
    mbpp = Explorer(ExploreSession(RunConfig.from_dict({**SETTINGS, "task": "mbpp", "n_discovery": 2,
                                                        "n_holdout": 2, "max_new_tokens": 8, "data_dir": data_dir}), lm))
    html = mbpp.item_out.value
    full, _ = direct(mbpp.session, [mbpp.session.data.holdout[0]], ())
    assert f'tests: <span class="cel-status">{full.predictions[0]["status"]}</span>' in html
    assert escape(full.predictions[0]["completion"]) in html


def test_environment_chooses_the_apps_model_task_seed_and_preset():
    env = {"CEL_EXPLORE_MODEL": "random:llama:tiny", "CEL_EXPLORE_TASK": "boolq", "CEL_EXPLORE_SEED": "3",
           "CEL_EXPLORE_PRESET": "smoke", "CEL_EXPLORE_ARTIFACT": ""}
    assert arguments_from_environment(env) == {"model": "random:llama:tiny", "task": "boolq", "seed": 3,
                                               "preset": "smoke"}
    with pytest.raises(ValueError, match="CEL_EXPLORE_SEED='x' is not a whole number"):
        arguments_from_environment({"CEL_EXPLORE_SEED": "x"})


def test_own_greedy_prompt_is_scored_as_the_row_it_reads_as(lm, data_dir):
    from cel_utils.tasks.specs import Item

    session = ExploreSession(RunConfig.from_dict({**SETTINGS, "task": "arithmetic_2da", "data_dir": data_dir}), lm)
    own = session.view_prompt("Question: What is 12 plus 30?\nAnswer:", ["L2.H1"], target=" 42")
    row = Item("row", {"context": "Question: What is 12 plus 30?\nAnswer:", "completion": " 42"})
    full, ablated = direct(session, [row], ["L2.H1"])
    assert (own.full.margin[0], own.ablated.margin[0]) == (full.margin[0], ablated.margin[0])
    with pytest.raises(ValueError, match="needs the expected answer"):
        session.view_prompt("Question: What is 1 plus 1?\nAnswer:", target="")


def test_an_artifact_of_other_items_is_refused(lm, data_dir, tmp_path):
    from cel_utils.pipeline.artifacts import write_json

    config = {**SETTINGS, "task": "boolq", "data_dir": data_dir}
    session = ExploreSession(RunConfig.from_dict(config), lm)
    ids = {split: [item.id for item in session.items(split)] for split in ("discovery", "holdout")}
    run = _run_artifact(config, frozen=["L0.H0"], pool=["L0.H0"], stage2=[], discovery_ids=ids["discovery"],
                        holdout_ids=ids["holdout"])
    assert ExploreSession.from_artifact(write_json(tmp_path / "same.json", run), lm).data.holdout == session.data.holdout
    run["holdout"]["item_ids"] = ids["holdout"][::-1]
    with pytest.raises(ValueError, match="the run's holdout items are not the ones these settings draw"):
        ExploreSession.from_artifact(write_json(tmp_path / "other.json", run), lm)
