"""Search strategies on synthetic evaluators, and attribution patching on tiny random models."""
from pathlib import Path

import numpy as np
import pytest
import torch
from fakes import GEOMETRY, XorEvaluator

from cel_utils.evaluation.outcomes import OutcomeTable
from cel_utils.models.heads import HeadId, head_set
from cel_utils.search.ranking import rank, score
from cel_utils.search.strategies import (
    Ledger,
    attribution_pool,
    beam,
    exhaustive,
    forward_equivalents,
    screening_agreement,
    top_heads,
)

REPO = Path(__file__).resolve().parents[1]


def _mask(n, *items):
    m = np.zeros(n, bool)
    m[list(items)] = True
    return m


def planted(n=12):
    """L3.H0 gains 1 with no harm, L1.H2 gains 1 (2 helped, 1 harmed), L0.H1 loses 1; together L1.H2 and L3.H0
    gain 2, the best pair."""
    base = np.zeros(n, bool)
    base[:4] = True
    flips = {HeadId(3, 0): _mask(n, 4),
             HeadId(0, 1): _mask(n, 0),  # harms item 0 ...
             HeadId(1, 2): _mask(n, 5, 6, 0)}  # +2 -1
    return base, flips


def pair_aware(n=12, second_helper=True):
    """The pair {L0.H1, L2.H2} gains 5 though neither head helps alone (an interaction); L1.H1 gains 2 alone and
    L3.H2 one more (if ``second_helper``)."""
    base = np.zeros(n, bool)

    class Interacting(XorEvaluator):
        def evaluate(self, interventions, desc=None):
            outs = super().evaluate(interventions, desc)
            for heads, out in zip([head_set(i) for i in interventions], outs):
                if {HeadId(0, 1), HeadId(2, 2)} <= set(heads):
                    out.correct[6:11] = True
            return outs

    flips = {HeadId(1, 1): _mask(n, 1, 2)}
    if second_helper:
        flips[HeadId(3, 2)] = _mask(n, 0)
    return Interacting(base, flips)


def test_ledger_counts_what_each_strategy_asks_for_while_the_table_evaluates_once():
    table = OutcomeTable(XorEvaluator(*planted()))
    first, second = Ledger(table), Ledger(table)
    first.evaluate([(), (HeadId(0, 0),)])
    second.evaluate([(HeadId(0, 0),), (HeadId(0, 0),)])
    assert list(first.requested) == [(), (HeadId(0, 0),)] and list(second.requested) == [(HeadId(0, 0),)]
    assert table.evaluated == [(), (HeadId(0, 0),)]


def test_greedy_beam_and_exhaustive_use_the_papers_ranking():
    table = OutcomeTable(XorEvaluator(*planted()))
    paper = exhaustive(table, p=3, k=2)
    assert paper.selected == (HeadId(1, 2), HeadId(3, 0))  # +1 and +1, and the pair +2
    assert len(paper.requested) == 1 + 12 + 3  # full, every head, the 3 pairs of the pool
    greedy = beam(table, k=2, width=1)
    assert greedy.selected == paper.selected and greedy.name == "greedy"
    # greedy: full, 12 singles, then the best single with each of the 11 other heads
    assert len(greedy.requested) == 1 + 12 + 11
    wide = beam(table, k=3, width=3)
    assert wide.discovery.gain_count >= greedy.discovery.gain_count


def test_greedy_misses_an_interaction_that_a_full_pool_finds():
    table = OutcomeTable(pair_aware())
    greedy = beam(table, k=3, width=1)
    assert greedy.selected == (HeadId(1, 1), HeadId(3, 2)) and greedy.discovery.gain_count == 3
    assert len(greedy.requested) == 1 + 12 + 11 + 10  # no triple beat the pair: stopped at size 3
    exhaustive_all = exhaustive(table, p=12, k=2)  # a pool of every head sees the interaction
    assert exhaustive_all.selected == (HeadId(0, 1), HeadId(2, 2)) and exhaustive_all.discovery.gain_count == 5
    with pytest.raises(ValueError, match="beam width"):
        beam(table, k=2, width=0)


def test_greedy_stops_when_adding_a_head_stops_helping():
    greedy = beam(OutcomeTable(pair_aware(second_helper=False)), k=3, width=1)
    assert greedy.selected == (HeadId(1, 1),)  # every pair with it only ties its gain, with more heads
    assert len(greedy.requested) == 1 + 12 + 11  # no triple evaluated


def test_attribution_pool_runs_algorithm_1_on_the_top_candidates():
    table = OutcomeTable(XorEvaluator(*planted()))
    estimate = np.zeros((4, 3))
    estimate[3, 0], estimate[1, 2], estimate[0, 0] = 3.0, 2.0, 1.0
    assert top_heads(estimate, 3) == [HeadId(3, 0), HeadId(1, 2), HeadId(0, 0)]
    result = attribution_pool(table, estimate, p=3, k=2, candidates=3, cost=36.0)
    assert result.selected == (HeadId(1, 2), HeadId(3, 0))
    assert len(result.requested) == 1 + 3 + 3 and result.extra_forward_equivalents == 36.0


def test_forward_equivalents_counts_layers_run():
    sets = [(), (HeadId(0, 0),), (HeadId(2, 1), HeadId(3, 0))]
    assert forward_equivalents(sets, n_items=10, n_layers=4) == 10 + 10 + 10 * 2 / 4
    assert forward_equivalents(sets, n_items=10, n_layers=4, generate=True) == 30


def test_screening_agreement_against_exact_single_head_effects():
    base, flips = planted()
    shifts = {h: 0.1 * (i - 6) for i, h in enumerate(GEOMETRY.all_heads())}
    table = OutcomeTable(XorEvaluator(base, flips, shifts))
    reference = XorEvaluator(base, flips, shifts)  # computed independently of the table
    full_margin = reference.evaluate([()])[0].margin
    exact = np.array([np.mean(reference.evaluate([(h,)])[0].margin - full_margin)
                      for h in GEOMETRY.all_heads()]).reshape(4, 3)
    agreement = screening_agreement(exact, table, p=3)  # an estimate equal to the exact margin effect
    assert agreement["spearman_margin"] == pytest.approx(1.0) and agreement["kendall_margin"] == pytest.approx(1.0)
    assert np.allclose(agreement["exact_margin_effect"], exact)
    full = table.evaluate_one(())
    ranked = rank([score((h,), table.evaluate_one((h,)), full) for h in GEOMETRY.all_heads()])
    assert agreement["recall_at_p"] == len({s.heads[0] for s in ranked[:3]} & set(top_heads(exact, 3))) / 3


# --- attribution patching on real (tiny, random) models ----------------------------------------------------------------

@pytest.fixture(scope="module", params=["arithmetic_2da", "boolq", "hellaswag"])
def evaluator(request, tiny_models, data_dir):
    from cel_utils.evaluation.evaluator import NaiveEvaluator
    from cel_utils.tasks.splits import load_task_data

    data = load_task_data(request.param, 4, 5, seed=0, num_fewshot=0, data_dir=data_dir)
    return NaiveEvaluator(tiny_models["llama"], data.task, data.holdout, data.fewshot, progress=False)


@pytest.mark.usefixtures("attention_backend")  # numerics-sensitive: both attention kernels
def test_attribution_margins_are_the_tasks_decision_margins(evaluator):
    from cel_utils.search.attribution import head_attributions

    result = head_attributions(evaluator, token_budget=256)  # small batches: exercises the batching
    full = evaluator.evaluate([()])[0]
    np.testing.assert_allclose(result.full_margins, full.margin, atol=1e-4)
    assert result.estimate.shape == (3, 4) and np.abs(result.estimate).max() > 0
    assert result.forward_equivalents == 3 * len(evaluator.items)


@pytest.mark.usefixtures("attention_backend")  # numerics-sensitive: both attention kernels
def test_a_gate_at_zero_is_the_ablation_and_the_gradient_is_the_slope(evaluator):
    from cel_utils.search.attribution import gated_margins, head_attributions

    head = HeadId(1, 2)
    gates = torch.ones(3, 4)
    gates[head.layer, head.head] = 0.0
    ablated = evaluator.evaluate([(head,)])[0]
    np.testing.assert_allclose(gated_margins(evaluator, gates), ablated.margin, atol=1e-4)

    estimate = head_attributions(evaluator).estimate[head.layer, head.head]
    eps = 1e-3
    gates = torch.ones(3, 4, dtype=torch.float64)
    lm = evaluator.lm
    lm.model.double()
    try:
        gates[head.layer, head.head] = 1 - eps
        lower = gated_margins(evaluator, gates).mean()
        gates[head.layer, head.head] = 1.0
        upper = gated_margins(evaluator, gates).mean()
    finally:
        lm.model.float()
    # a finite difference towards ablation, scaled to a full gate step, matches the first-order estimate
    assert (lower - upper) / eps == pytest.approx(estimate, rel=1e-2, abs=1e-4)


def test_cli_executes_the_strategies_notebook_and_the_results_page_shows_it(tmp_path, data_dir):
    import nbformat

    from cel_utils.book import results_page
    from cel_utils.cli import main
    from cel_utils.pipeline.artifacts import read_artifact

    args = ["strategies", "--root", str(tmp_path), "--models", "random:llama:tiny", "--tasks", "arithmetic_2da",
            "--preset", "smoke", "--engine", "naive", "--data-dir", data_dir, "--beam-width", "2"]
    assert main(args) == 0
    stem = "random-llama-tiny__arithmetic_2da__seed0"
    payload = read_artifact(tmp_path / "results" / "strategies" / f"{stem}.json")
    names = [row["strategy"] for row in payload["strategies"]]
    assert names == ["exhaustive (paper)", "greedy", "beam (width 2)", "attribution pool", "attribution top-k"]
    exhaustive_row = payload["strategies"][0]
    assert exhaustive_row["evaluations"] == 1 + 12 + 3  # full, 12 heads, the pairs of a pool of 3
    assert payload["screening"]["full_margin_max_abs_difference"] < 1e-3
    assert payload["data"]["source"] == "mirror"  # where the items came from, as in a run's artifact
    nb = nbformat.read(tmp_path / "book" / "strategies" / f"{stem}.ipynb", as_version=4)
    assert nb.cells[0].source.startswith("# Search strategies compared")  # not given a run's title
    by_id = {c.get("id"): c for c in nb.cells}
    assert any("image/png" in o.get("data", {}) for o in by_id["screening"].outputs)
    assert any("text/html" in o.get("data", {}) for o in by_id["run"].outputs)
    assert any("(data: mirror)" in o.get("data", {}).get("text/markdown", "") for o in by_id["run"].outputs)
    page = results_page.write_results_page(tmp_path / "results", tmp_path / "book" / "results.md").read_text()
    assert "## Search strategies" in page and "| exhaustive (paper) |" in page and "Spearman" in page


def test_a_failed_strategies_notebook_stays_out_of_the_book(tmp_path, data_dir):
    import nbformat

    from cel_utils.cli import main

    template = nbformat.read(REPO / "notebooks" / "cel_strategies.ipynb", as_version=4)
    template.cells.append(nbformat.v4.new_code_cell('raise RuntimeError("the last cell broke")'))
    broken = tmp_path / "broken.ipynb"
    nbformat.write(template, broken)
    args = ["strategies", "--root", str(tmp_path), "--models", "random:llama:tiny", "--tasks", "arithmetic_2da",
            "--preset", "smoke", "--engine", "naive", "--data-dir", data_dir, "--beam-width", "2"]
    stem = "random-llama-tiny__arithmetic_2da__seed0"
    page = tmp_path / "book" / "strategies" / f"{stem}.ipynb"
    summary = tmp_path / "results" / "strategies" / f"{stem}.json"
    assert main(args) == 0 and page.exists() and summary.exists()
    assert main(args + ["--notebook", str(broken)]) == 1
    # The rerun wrote a new summary before it broke, so the earlier page no longer matches it: both leave the book.
    assert not page.exists() and not summary.exists()
    failed = tmp_path / "results" / "strategies" / "failed"
    assert (failed / f"{stem}.ipynb").exists() and (failed / f"{stem}.json").exists()
    assert main(args) == 0 and page.exists() and not (failed / f"{stem}.ipynb").exists()  # a success clears them
    # The strategies' own parameters are checked before any notebook runs.
    assert main(args + ["--beam-width", "0"]) == 2 and main(args + ["--attribution-candidates", "1"]) == 2


def test_strategies_notebook_template_and_its_parameters():
    import json

    import nbformat
    import papermill as pm

    from cel_utils.config import NOTEBOOK_PARAMETERS

    path = REPO / "notebooks" / "cel_strategies.ipynb"
    nb = nbformat.read(path, as_version=4)
    nbformat.validate(nb)
    assert all(not c.outputs and c.execution_count is None for c in nb.cells if c.cell_type == "code")
    inferred = pm.inspect_notebook(str(path))  # what the CLI passes: the run notebook's input
    assert {name: json.loads(p["default"]) for name, p in inferred.items()} == NOTEBOOK_PARAMETERS
