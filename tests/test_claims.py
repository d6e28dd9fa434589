"""Claims a referee would sign (issue 42): mean-ablation exact as zero-ablation is, families of tests, floors, exact
intervals at the edges, non-inferiority, and pages whose words follow the code."""
import copy
import csv
import json
from pathlib import Path

import numpy as np
import pytest
import torch

from cel_utils.book import claims, key_results, results_page, run_page, transfer_page
from cel_utils.evaluation.engine import EngineEvaluator
from cel_utils.evaluation.evaluator import NaiveEvaluator
from cel_utils.evaluation.means import compute_means
from cel_utils.models.ablation import ablated, mean_heads_in_weights, replaced_by_means, zero_heads_in_weights
from cel_utils.models.heads import HeadId
from cel_utils.models.random_models import FAMILIES
from cel_utils.stats import multiplicity
from cel_utils.stats.power import power_json, verdict
from cel_utils.stats.significance import exact_gain_interval, paired_test
from cel_utils.tasks.floors import choice_floors, greedy_floors
from cel_utils.tasks.splits import load_task_data

REPO = Path(__file__).resolve().parents[1]
TIE = 1e-4


# --- mean-ablation: exact as zero-ablation is ----------------------------------------------------------------------

@torch.no_grad()
def _logits(model, ids):
    return model(ids).logits


def _random_means(geometry, seed=0):
    return torch.randn(geometry.n_layers, geometry.n_heads * geometry.head_dim,
                       generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("family", sorted(f for f in FAMILIES if f != "gpt2"))  # gpt2's Conv1D has no Linear bias
def test_mean_ablation_hook_equals_weight_surgery(tiny_models, family):
    lm = tiny_models[family]
    means = _random_means(lm.geometry)
    ids = torch.randint(0, 1000, (2, 11), generator=torch.Generator().manual_seed(1))
    heads = [HeadId(0, 1), HeadId(lm.geometry.n_layers - 1, 0)]
    with replaced_by_means(lm.model, means), ablated(lm.model, heads):
        hooked = _logits(lm.model, ids)
    surgered = copy.deepcopy(lm.model)
    mean_heads_in_weights(surgered, heads, means)
    torch.testing.assert_close(hooked, _logits(surgered, ids), rtol=0, atol=1e-4)
    with ablated(lm.model, heads):  # outside the block: zero-ablation, which must differ
        zeroed = _logits(lm.model, ids)
    zero_surgery = copy.deepcopy(lm.model)
    zero_heads_in_weights(zero_surgery, heads)
    torch.testing.assert_close(zeroed, _logits(zero_surgery, ids), rtol=0, atol=1e-5)
    assert (hooked - zeroed).abs().max() > 1e-3


def test_means_outside_their_block_change_nothing(tiny_models):
    """Zero-ablation computes the same bits whether or not mean-ablation was used before (the block leaves nothing)."""
    lm = tiny_models["llama"]
    ids = torch.randint(0, 1000, (1, 9), generator=torch.Generator().manual_seed(2))
    with ablated(lm.model, [HeadId(1, 1)]):
        before = _logits(lm.model, ids)
    with replaced_by_means(lm.model, _random_means(lm.geometry)), ablated(lm.model, [HeadId(1, 1)]):
        _logits(lm.model, ids)
    with ablated(lm.model, [HeadId(1, 1)]):
        torch.testing.assert_close(_logits(lm.model, ids), before, rtol=0, atol=0)


def test_the_means_are_the_mean_o_proj_input_over_every_prompt_token(tiny_models):
    from cel_utils.models.plumbing import attention_output_projections

    lm = tiny_models["qwen2"]
    contexts = [[5, 17, 300, 4, 9], [40, 41], [7, 8, 9, 10, 11, 12, 13]]
    means = compute_means(lm, contexts, batch_size=2)  # padded batches
    seen = []
    hook = attention_output_projections(lm.model)[1].register_forward_pre_hook(lambda m, a: seen.append(a[0][0]))
    try:
        for tokens in contexts:  # one unpadded sequence at a time
            _logits(lm.model, torch.tensor([tokens]))
    finally:
        hook.remove()
    expected = torch.cat(seen).double().mean(dim=0).float()
    torch.testing.assert_close(means.values[1], expected, rtol=0, atol=1e-5)
    assert means.n_tokens == 14 and means.n_items == 3


@pytest.fixture(scope="module")
def task_data(data_dir):
    return {task: load_task_data(task, 3, 3, seed=0, num_fewshot=nf, data_dir=data_dir)
            for task, nf in [("arithmetic", 1), ("boolq", 0), ("hellaswag", 0)]}


@pytest.mark.parametrize("family", ["llama", "gemma3"])
@pytest.mark.parametrize("task", ["arithmetic", "boolq", "hellaswag"])
def test_engine_matches_naive_under_mean_ablation(tiny_models, task_data, family, task):
    lm, data = tiny_models[family], task_data[task]
    last = lm.geometry.n_layers - 1
    interventions = [(), (HeadId(0, 0),), (HeadId(1, 2),), (HeadId(0, 1), HeadId(last, 0))]
    means = compute_means(lm, [r.context for r in NaiveEvaluator(lm, data.task, data.discovery, data.fewshot,
                                                                  progress=False).requests])
    naive = NaiveEvaluator(lm, data.task, data.discovery, data.fewshot, progress=False, means=means)
    reference = naive.evaluate(interventions)
    engine = EngineEvaluator(lm, data.task, data.discovery, data.fewshot, batch_size=2, token_budget=64,
                             progress=False, means=means).evaluate(interventions)
    zero = NaiveEvaluator(lm, data.task, data.discovery, data.fewshot, progress=False).evaluate(interventions)
    for ref, out in zip(reference, engine):
        clear = np.abs(ref.margin) > TIE
        assert np.array_equal(ref.correct[clear], out.correct[clear])
        np.testing.assert_allclose(out.margin, ref.margin, atol=1e-3)
    np.testing.assert_array_equal(reference[0].margin, zero[0].margin)  # the full model: no heads, nothing to replace
    assert any(np.abs(r.margin - z.margin).max() > 1e-3 for r, z in zip(reference[1:], zero[1:]))


def test_mean_and_zero_evaluations_are_stored_apart(tiny_models, task_data, tmp_path):
    from cel_utils.evaluation.store import EvalStore

    lm, data = tiny_models["llama"], task_data["boolq"]
    store = EvalStore(tmp_path)
    zero = EngineEvaluator(lm, data.task, data.discovery, progress=False, store=store)
    means = compute_means(lm, [r.context for r in zero.requests])
    mean = EngineEvaluator(lm, data.task, data.discovery, progress=False, store=store, means=means)
    assert "ablation" not in zero.store_fields()  # zero-ablation's records keep the names they always had
    assert mean.store_fields() == {**zero.store_fields(), "ablation": "mean", "means": means.sha256}
    heads = [(HeadId(0, 1),)]
    first = mean.evaluate(heads)[0].margin
    assert not np.array_equal(zero.evaluate(heads)[0].margin, first)  # not served the mean's numbers
    again = EngineEvaluator(lm, data.task, data.discovery, progress=False, store=store, means=means)
    np.testing.assert_array_equal(again.evaluate(heads)[0].margin, first)


# --- families, exact intervals, non-inferiority ---------------------------------------------------------------------

def test_holm_by_hand():
    assert multiplicity.holm([0.01, 0.04, 0.03, 0.005]) == pytest.approx([0.03, 0.06, 0.06, 0.02])
    assert multiplicity.holm([0.5]) == [0.5]
    assert np.isnan(multiplicity.holm([0.2, float("nan")])[1])


def test_holm_controls_the_familywise_error_by_simulation():
    rng = np.random.default_rng(0)
    p = rng.uniform(size=(4000, 8))  # eight true nulls
    raw = (p <= 0.05).any(axis=1).mean()
    adjusted = np.mean([min(multiplicity.holm(row)) <= 0.05 for row in p])
    assert raw > 0.3 and adjusted <= 0.055


def test_an_interval_never_collapses_where_few_answers_changed():
    none = paired_test(np.zeros(40, bool), np.zeros(40, bool))
    assert none.ci_low < -5 and none.ci_high > 5 and none.interval.startswith("exact")  # 0 of 40: about +-8.8
    assert exact_gain_interval(40, 0, 0) == pytest.approx((-8.81, 8.81), abs=0.01)
    full = np.zeros(300, bool)
    ablated = full.copy()
    ablated[:2] = True
    two = paired_test(full, ablated)
    assert two.ci_low < 0 < two.ci_high  # two helped and none harmed cannot rule out a loss


def test_the_exact_interval_covers_the_true_gain(data_dir):
    rng = np.random.default_rng(1)
    n, d, q = 200, 0.02, 0.7  # about 4 changed answers an item set: the exact regime
    true = 100 * d * (2 * q - 1)
    covered = []
    for _ in range(800):
        changed = rng.uniform(size=n) < d
        helped = changed & (rng.uniform(size=n) < q)
        low, high = exact_gain_interval(n, int(helped.sum()), int((changed & ~helped).sum()))
        covered.append(low <= true <= high)
    assert np.mean(covered) >= 0.95


def test_the_margin_is_the_papers_smallest_gain():
    with open(REPO / "data" / "paper_table1.csv", newline="") as handle:
        gains = [float(r["gain_points"]) for r in csv.DictReader(handle)]
    assert multiplicity.MARGIN_POINTS == min(gains)


def test_noninferiority_rules_out_harm_only_when_the_bound_clears_the_margin():
    full = np.ones(2000, bool)
    safe = multiplicity.noninferiority(full, full, m=12)  # nothing changed on 2,000 items
    assert safe["harm_ruled_out"] and safe["lower_bound_points"] > -multiplicity.MARGIN_POINTS
    hurt = full.copy()
    hurt[:60] = False  # -3 points
    found = multiplicity.noninferiority(full, hurt, m=12)
    assert not found["harm_ruled_out"] and found["harm_not_ruled_out_points"] > 3
    one = multiplicity.noninferiority(full[:300], full[:300], m=1)
    twelve = multiplicity.noninferiority(full[:300], full[:300], m=12)
    assert twelve["lower_bound_points"] < one["lower_bound_points"]  # a family's bound is wider


# --- floors and the verdict's first words ---------------------------------------------------------------------------

def test_floors_from_the_items(data_dir):
    boolq = load_task_data("boolq", 4, 40, seed=1, data_dir=data_dir)
    floors = choice_floors(boolq.task, boolq.holdout)
    yes = np.mean([item.doc["answer"] for item in boolq.holdout])
    assert floors["chance"] == 0.5 and floors["labels"] == ["no", "yes"]
    assert floors["best_constant"]["accuracy"] == max(yes, 1 - yes)
    arithmetic = load_task_data("arithmetic_1dc", 4, 60, seed=1, data_dir=data_dir)
    found = greedy_floors(arithmetic.task, arithmetic.holdout)
    answers = [item.doc["completion"].strip() for item in arithmetic.holdout]
    assert found["chance"] is None and found["best_constant"]["accuracy"] == max(map(answers.count, answers)) / 60


def _test_json(full, ablated, seed=0):
    return paired_test(full, ablated, seed=seed).to_json()


def test_a_verdict_at_floor_says_so_first():
    n = 300
    full = np.zeros(n, bool)
    full[:133] = True  # 44.3%
    ablated = full.copy()
    ablated[133:152] = True  # 50.7%
    floors = {"chance": 0.5, "best_constant": {"answer": "yes", "accuracy": 0.577, "what": "majority class"}}
    found = verdict(_test_json(full, ablated), power_json(n, 19), floors=floors,
                    accuracies=(full.mean(), ablated.mean()))
    assert found["at_floor"] and found["text"].startswith('at its floor: the full model\'s 44.3% is below always '
                                                          'answering "yes" (57.7%)')
    assert "still below it" in found["text"]
    above = verdict(_test_json(full, ablated), power_json(n, 19), floors={"chance": 0.25, "best_constant": {
        "answer": "ending 0", "accuracy": 0.26, "what": "majority class"}}, accuracies=(full.mean(), ablated.mean()))
    assert not above["at_floor"] and not above["text"].startswith("at its floor")


def test_significant_alone_is_not_significant_in_a_family():
    n = 500
    full = np.zeros(n, bool)
    ablated = full.copy()
    ablated[:16] = True
    full[16:20] = True  # 16 helped, 4 harmed: p about 0.012 alone
    test = _test_json(full, ablated)
    alone = verdict(test, power_json(n, 20))
    family = {"family": "the primary verdicts, 8 runs", "m": 8, "p_raw": test["p_value"], "p_adjusted": 0.09,
              "method": "Holm", "ci_low": -0.4, "ci_high": 5.2, "confidence": 1 - 0.05 / 8}
    among = verdict(test, power_json(n, 20), family=family)
    assert alone["kind"] == "gain" and among["kind"] == "not significant"
    assert "Holm p = 0.09" in among["text"] and "[-0.4, +5.2]" in among["text"]
    assert "significant gain" not in among["text"]


# --- pages from artifacts built to contradict the old sentences ---------------------------------------------------

def _artifact(tmp_path, name="m", task="boolq", full=None, ablated=None, seed=1, null_indices=None):
    from tests.test_report import make_artifact

    art = make_artifact(model=name, task=task, seed=seed)
    n = 60
    full = np.zeros(n, bool) if full is None else full
    ablated = full if ablated is None else ablated
    art["holdout"].update(n_items=n, full_accuracy=float(full.mean()), ablated_accuracy=float(ablated.mean()),
                          gain_points=100 * float(ablated.mean() - full.mean()), full_correct=[int(x) for x in full],
                          ablated_correct=[int(x) for x in ablated])
    if null_indices is not None:
        art["reliability"] = {"null": {"size": 2, "n_sets": 3, "sets": [], "gains_points": [0.0, 1.0, -1.0],
                                       "selected_gain_points": 0.0, "percentile": 50.0, "p_value": 0.5, "n": 3,
                                       "quantiles": {"min": -1.0, "q25": -0.5, "median": 0.0, "q75": 0.5, "max": 1.0},
                                       "n_items": len(null_indices), "item_indices": null_indices}}
    return art


def test_pages_never_call_a_random_subset_the_first_items(tmp_path):
    art = _artifact(tmp_path, null_indices=[3, 17, 40, 52, 59])
    texts = [run_page.reliability_sentence(art), run_page.reliability_table(art).to_string()]
    from cel_utils.book import plots

    figure = plots.null_histogram(art)
    texts.append(figure.axes[0].get_xlabel())
    for text in texts:
        assert "first" not in text, text
    assert "random" in texts[0] and "random" in texts[1]


def test_the_smallest_detectable_change_is_never_read_as_a_bound():
    notebook = json.loads((REPO / "notebooks" / "cel_run.ipynb").read_text())
    prose = " ".join("".join(c["source"]) for c in notebook["cells"] if c["cell_type"] == "markdown")
    assert "says how large an effect a \"no effect\" verdict rules out" not in prose
    assert "not a bound on the effect" in prose
    n = 300
    full = np.zeros(n, bool)
    full[:20] = True
    ablated = full.copy()
    ablated[20:30] = True
    ablated[:6] = False
    text = verdict(_test_json(full, ablated), power_json(n, 16))["text"]
    assert "the design" in text and "rules out" not in text.split("the design")[1]


def test_no_change_never_reads_as_an_interval_of_zero(tmp_path):
    art = _artifact(tmp_path)  # nothing changed on 60 items
    sig = run_page.significance(art)
    assert sig["ci_low"] < -4 and sig["ci_high"] > 4
    paper = results_page.read_paper_table(REPO / "data" / "paper_table1.csv")
    placed = results_page.paper_gains_against("boolq", sig["ci_low"], sig["ci_high"], paper)
    assert "above" not in placed and placed.count("inside") == 3


def test_first_looks_are_read_from_their_record(tmp_path, monkeypatch):
    record = tmp_path / "first_looks.json"
    record.write_text(json.dumps({"first_looks": [{"model": "m", "task": "boolq", "seed": 1, "n_holdout": 77,
                                                   "gain_points": 3.3, "ci_low": -1.1, "ci_high": 7.7,
                                                   "heads": "L9.H9", "note": "", "why": "a test"}]}))
    monkeypatch.setattr(claims, "FIRST_LOOKS", record)
    monkeypatch.setattr(claims.first_looks, "__defaults__", (record,))
    art = _artifact(tmp_path)
    page = results_page.results_markdown([art], [], None)
    assert "77 holdout items, +3.3 points (95% CI [-1.1, +7.7]" in page and results_page.SECOND_LOOK_MARK in page
    assert "+12.0" not in page  # nothing typed into the page's code


def test_the_paper_comparison_neither_agrees_nor_disagrees(tmp_path):
    rng = np.random.default_rng(3)
    arts = []
    for i, (model, task) in enumerate([("a", "boolq"), ("b", "hellaswag"), ("c", "arithmetic_1dc")]):
        full = rng.uniform(size=60) < 0.3
        ablated = full ^ (rng.uniform(size=60) < 0.3)
        art = _artifact(tmp_path, name=model, task=task, full=full, ablated=ablated)
        art["floors"] = {"chance": 0.5 if task == "boolq" else None,
                         "best_constant": {"answer": "yes", "accuracy": 0.6, "what": "majority class"}}
        arts.append(art)
    paper = results_page.read_paper_table(REPO / "data" / "paper_table1.csv")
    page = results_page.results_markdown(arts, paper, None)
    section = page[page.index("## The paper's Table 1 beside ours"):]
    claims_made = section.replace("agrees or disagrees", "")  # the section's own statement that it makes neither
    assert "disagree" not in claims_made and " agrees" not in claims_made
    assert "cannot be set beside them" in section  # every run here is at its floor (0.3 against 0.6)


def test_a_run_page_key_result_names_the_floor_and_the_family(tmp_path):
    full = np.zeros(60, bool)
    full[:20] = True
    ablated = full.copy()
    ablated[20:26] = True
    art = _artifact(tmp_path, full=full, ablated=ablated)
    art["floors"] = {"chance": 0.5, "best_constant": {"answer": "yes", "accuracy": 0.6, "what": "majority class"}}
    family = claims.primary_family([art, _artifact(tmp_path, name="other")])
    box = key_results.key_result(art, family[claims.run_key(art)].to_json())
    assert box.startswith("```{admonition} Key result") and "at its floor" in box.replace("full model is at its floor",
                                                                                          "at its floor")
    assert "among the book's 2 primary tests: Holm p" in box


def test_transfer_words_follow_the_adjusted_tests_and_the_margin():
    from cel_utils.pipeline.transfer import cell_json

    n = 2000
    full = np.ones(n, bool)
    hurt = full.copy()
    hurt[:100] = False  # -5 points: significant, and harm not ruled out
    cells = []
    for source in ("a", "b"):
        for target in ("a", "b"):
            ablated = hurt if (source, target) == ("a", "b") else full
            cells.append(cell_json(source, target, ["L0.H0"], "L0.H0", full, ablated, 1, n))
    transfer = {"model": {"name": "m"}, "seed": 1, "tasks": ["a", "b"], "metrics": {"a": "acc", "b": "acc"},
                "cells": cells}
    text = " ".join(transfer_page.transfer_sentences(transfer))
    assert "significantly hurts b" in text and "Holm" in text
    assert f"On a harm larger than {multiplicity.MARGIN_POINTS:g} points is ruled out" in text
    assert "of the 2 off-diagonal cells, 1 is significant" in text and "1 rules out harm" in text
