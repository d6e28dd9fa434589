"""Greedy generation: the shared few-shot prefix cache changes nothing but the cost."""
import pytest
import torch

from cel_utils.evaluation import generation
from cel_utils.evaluation.generation import cut_completion, generate, shared_prefix_length
from cel_utils.models.ablation import head_mask
from cel_utils.models.heads import HeadId
from cel_utils.tasks.prompts import build_gen_requests
from cel_utils.tasks.splits import load_task_data


def test_shared_prefix_length_leaves_each_row_a_token():
    assert shared_prefix_length([[1, 2, 3, 4], [1, 2, 3, 5], [1, 2, 3, 4, 6]]) == 3
    assert shared_prefix_length([[1, 2], [1, 2]]) == 1
    assert shared_prefix_length([[7, 1], [8, 1]]) == 0


def test_cut_completion():
    assert cut_completion("def f():\n  return 1\n[DONE]\nmore", "[DONE]") == "def f():\n  return 1\n"
    assert cut_completion("x = 1", None) == "x = 1"


@pytest.mark.parametrize("family", ["llama", "gemma3_text", "gpt2"])
def test_prefix_cache_gives_the_same_completions(tiny_models, data_dir, monkeypatch, family):
    lm = tiny_models[family]
    data = load_task_data("mbpp", 1, 3, seed=0, data_dir=data_dir)  # 3-shot: a long shared prefix
    requests = build_gen_requests(data.task, data.holdout, data.fewshot, lm.tokenizer, "plain")
    assert shared_prefix_length([r.context for r in requests]) > 500
    sets = [[], [HeadId(0, 1)], [HeadId(1, 0), HeadId(2, 3)]]
    rows = requests * len(sets)
    masks = torch.cat([head_mask(s, lm.geometry).expand(len(requests), -1, -1) for s in sets])
    with_prefix = generate(lm, rows, row_masks=masks, batch_size=9, max_new_tokens=5)
    monkeypatch.setattr(generation, "MIN_SHARED_PREFIX", 10**9)
    without = generate(lm, rows, row_masks=masks, batch_size=9, max_new_tokens=5)
    assert with_prefix == without
    one_set = generate(lm, requests, [HeadId(0, 1)], batch_size=3, max_new_tokens=5)
    assert one_set == without[3:6]
