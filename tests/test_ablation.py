"""The hook zeroes exactly the o_proj input slices of the chosen query heads, nothing else."""
import copy
import random

import pytest
import torch

from cel_utils.models.ablation import ablated, ablated_rows, head_mask, zero_heads_in_weights
from cel_utils.models.heads import HeadId
from cel_utils.models.plumbing import attention_output_projections
from cel_utils.models.random_models import FAMILIES


def _random_sets(geometry, n_sets, seed):
    rng = random.Random(seed)
    heads = geometry.all_heads()
    return [rng.sample(heads, rng.randint(1, 4)) for _ in range(n_sets)]


@torch.no_grad()
def _logits(model, ids):
    return model(ids).logits


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_hook_equals_weight_surgery(tiny_models, family):
    lm = tiny_models[family]
    ids = torch.randint(0, 1000, (2, 11), generator=torch.Generator().manual_seed(1))
    base = _logits(lm.model, ids)
    for heads in _random_sets(lm.geometry, 4, seed=hash(family) % 1000):
        with ablated(lm.model, heads):
            hooked = _logits(lm.model, ids)
        surgered = copy.deepcopy(lm.model)
        zero_heads_in_weights(surgered, heads)
        torch.testing.assert_close(hooked, _logits(surgered, ids), rtol=0, atol=1e-5)
        assert (hooked - base).abs().max() > 1e-4, "ablating heads of a random model must change its logits"
    torch.testing.assert_close(_logits(lm.model, ids), base, rtol=0, atol=0)  # hooks gone


def test_per_row_masks_match_one_set_per_forward(tiny_models):
    lm = tiny_models["llama"]
    ids = torch.randint(0, 1000, (1, 9), generator=torch.Generator().manual_seed(2))
    sets = [[], [HeadId(0, 1)], [HeadId(1, 0), HeadId(2, 3)]]
    masks = torch.stack([head_mask(s, lm.geometry) for s in sets])
    with ablated_rows(lm.model, masks):
        stacked = _logits(lm.model, ids.repeat(3, 1))
    for row, heads in enumerate(sets):
        with ablated(lm.model, heads):
            torch.testing.assert_close(stacked[row], _logits(lm.model, ids)[0], rtol=0, atol=1e-5)


def test_query_heads_not_kv_groups(tiny_models):
    """Heads 0 and 1 share a KV head in the tiny llama (4 query heads, 2 KV heads); ablating one of them
    must differ from ablating both."""
    lm = tiny_models["llama"]
    assert lm.geometry.n_heads // lm.geometry.n_kv_heads == 2
    ids = torch.randint(0, 1000, (1, 8), generator=torch.Generator().manual_seed(3))
    with ablated(lm.model, [HeadId(1, 0)]):
        one = _logits(lm.model, ids)
    with ablated(lm.model, [HeadId(1, 0), HeadId(1, 1)]):
        both = _logits(lm.model, ids)
    assert (one - both).abs().max() > 1e-4


def test_only_the_chosen_slice_is_zeroed(tiny_models):
    lm = tiny_models["qwen2"]
    proj = attention_output_projections(lm.model)[1]
    seen = []

    def spy(module, args):
        seen.append(args[0].clone())

    early = proj.register_forward_pre_hook(spy)  # runs before the ablation hook: the original input
    try:
        with ablated(lm.model, [HeadId(1, 2)]):
            late = proj.register_forward_pre_hook(spy)  # runs after it: the ablated input
            try:
                _logits(lm.model, torch.randint(0, 1000, (2, 6)))
            finally:
                late.remove()
    finally:
        early.remove()
    original, after = seen
    hd = lm.geometry.head_dim
    assert original[..., 2 * hd:3 * hd].abs().max() > 0
    assert torch.all(after[..., 2 * hd:3 * hd] == 0)
    keep = torch.ones(after.shape[-1], dtype=torch.bool)
    keep[2 * hd:3 * hd] = False
    assert torch.equal(after[..., keep], original[..., keep])


def test_hooks_are_removed_on_exceptions(tiny_models):
    lm = tiny_models["gpt2"]
    projections = attention_output_projections(lm.model)
    with pytest.raises(RuntimeError, match="boom"):
        with ablated(lm.model, [HeadId(0, 0)]):
            assert len(projections[0]._forward_pre_hooks) == 1
            raise RuntimeError("boom")
    assert all(len(p._forward_pre_hooks) == 0 for p in projections)


def test_bad_masks_and_heads_are_rejected(tiny_models):
    lm = tiny_models["llama"]
    with pytest.raises(ValueError, match="outside the model"):
        with ablated(lm.model, [HeadId(3, 0)]):
            pass
    with pytest.raises(ValueError, match="shape"):
        with ablated_rows(lm.model, torch.zeros(2, 2, 4, dtype=torch.bool)):
            pass


@pytest.mark.slow
def test_hook_equals_weight_surgery_on_the_default_model(default_model):
    lm = default_model
    ids = lm.tokenizer("Question: What is 98 plus 45?\nAnswer: 143", return_tensors="pt").input_ids
    for heads in _random_sets(lm.geometry, 3, seed=7):
        with ablated(lm.model, heads):
            hooked = _logits(lm.model, ids)
        surgered = copy.deepcopy(lm.model)
        zero_heads_in_weights(surgered, heads)
        torch.testing.assert_close(hooked, _logits(surgered, ids), rtol=0, atol=1e-4)
