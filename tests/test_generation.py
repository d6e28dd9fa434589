"""Greedy generation: the shared few-shot prefix cache changes nothing but the cost."""
import pytest
import torch

from cel_utils.evaluation import generation
from cel_utils.evaluation.batching import length_batches
from cel_utils.evaluation.generation import cut_completion, generate, shared_prefix_length
from cel_utils.models.ablation import ablated, head_mask
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


@pytest.mark.parametrize("family", ["llama", "gemma3_text", "gpt2"])
def test_batched_decoding_matches_model_generate_row_by_row(tiny_models, data_dir, monkeypatch, family):
    """Rows that stop at different steps leave the batch (the cache is compacted) without changing any row's answer:
    each one equals ``model.generate`` on its prompt alone, under its own head set."""
    lm = tiny_models[family]
    data = load_task_data("mbpp", 1, 6, seed=0, data_dir=data_dir)
    requests = build_gen_requests(data.task, data.holdout, data.fewshot, lm.tokenizer, "plain")
    sets = [[], [HeadId(0, 1)], [HeadId(1, 0), HeadId(2, 3)]] * 2
    pad = lm.tokenizer.pad_token_id

    def alone(request, heads, stop_ids) -> list[int]:
        ids = torch.tensor([request.context])
        with ablated(lm.model, heads, lm.geometry):
            out = lm.model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=8,
                                    do_sample=False, eos_token_id=stop_ids, pad_token_id=pad)
        return out[0, ids.shape[1]:].tolist()

    # a stop token that some rows produce early and others late or never, from a run that never stops
    free = [alone(r, s, [lm.model.config.vocab_size - 1]) for r, s in zip(requests, sets)]
    stop = free[0][2]
    steps = [row.index(stop) if stop in row else None for row in free]
    assert len(set(steps)) > 1, steps
    reference = [lm.tokenizer.decode(alone(r, s, [stop]), skip_special_tokens=True) for r, s in zip(requests, sets)]
    monkeypatch.setattr(generation, "_stop_ids", lambda lm: [stop])
    masks = torch.stack([head_mask(s, lm.geometry) for s in sets])
    for batch_size in (6, 4):
        assert generate(lm, requests, row_masks=masks, batch_size=batch_size, max_new_tokens=8) == reference


def test_batches_keep_short_prompts_apart_from_a_long_one():
    own, padding = [863, 271, 200, 150, 140, 100, 97, 60], generation.MAX_PROMPT_PADDING
    assert length_batches(own, 64, None, padding, 96) == [(0, 1), (1, 5), (5, 8)]
    assert length_batches(own, 2, None, padding, 96) == [(0, 1), (1, 3), (3, 5), (5, 7), (7, 8)]
    # the token budget counts every row as wide as the batch's first, with its answer
    assert length_batches(own[1:], 64, 3 * (271 + 96), padding, 96) == [(0, 3), (3, 6), (6, 7)]
    assert length_batches([5], 8, 1, padding, 96) == [(0, 1)]  # a row too long for the budget still gets a batch
