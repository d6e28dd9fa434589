"""The real default model end to end: a small search, MBPP generation (batch-size and engine invariance on it:
test_determinism.py)."""
import json

import numpy as np
import pytest

from cel_utils.config import RunConfig
from cel_utils.evaluation.engine import EngineEvaluator
from cel_utils.pipeline.protocol import run_cel
from cel_utils.tasks.splits import load_task_data

pytestmark = pytest.mark.slow


def test_small_search_writes_a_complete_artifact(default_model, data_dir, tmp_path):
    # stage 1 screened as the cpu preset's is (attribution over all 270 heads, 6 evaluated exactly): exact stage 1 took
    # three quarters of this test's time, and the engine's exactness on the real model is test_determinism's
    config = RunConfig(task="arithmetic_1dc", n_discovery=6, n_holdout=10, p=2, k=2, num_fewshot=2,
                       stage1="screened", screen="attribution", screen_keep=6,
                       n_random_sets=4, n_resamples=3, data_dir=data_dir, results_dir=str(tmp_path))
    run = run_cel(config, lm=default_model, progress=False)
    artifact = json.loads(run.artifact.read_text())
    assert artifact["model"]["geometry"]["n_layers"] == 30
    method = artifact["stage1_method"]
    assert method["method"] == "screened" and method["n_heads"] == 270 and len(method["order"]) == 270
    assert len(artifact["stage1"]) == 6 and len(artifact["stage2"]) == 2 + 1
    assert {s["heads"][0] for s in artifact["stage1"]} == set(method["order"][:6])  # the screen's top m, exactly
    assert artifact["frozen"]["heads"] == artifact["stage2"][0]["heads"]
    assert len(artifact["holdout"]["full_correct"]) == 10
    assert artifact["data"]["source"] == "mirror"
    reliability = artifact["reliability"]
    assert len(reliability["null"]["gains_points"]) == 4 and reliability["stability"]["n_resamples"] == 3
    # the stored scores agree with the stored vectors
    full = np.array(artifact["holdout"]["full_correct"], bool)
    ablated = np.array(artifact["holdout"]["ablated_correct"], bool)
    assert artifact["holdout"]["harm"] == int((full & ~ablated).sum())
    assert artifact["holdout"]["ablated_accuracy"] == pytest.approx(ablated.mean())


def test_mbpp_generation_runs_code_in_the_sandbox(default_model, data_dir):
    data = load_task_data("mbpp", 2, 2, seed=0, data_dir=data_dir)
    evaluator = EngineEvaluator(default_model, data.task, data.holdout, data.fewshot, max_new_tokens=96, progress=False)
    (outcome,) = evaluator.evaluate([()])
    assert len(outcome.predictions) == 2
    for prediction in outcome.predictions:
        assert "[DONE]" not in prediction["completion"]
        assert prediction["status"] in {"passed", "failed", "exception", "syntax_error", "timeout", "early_exit", "killed"}
    assert outcome.correct.dtype == bool
