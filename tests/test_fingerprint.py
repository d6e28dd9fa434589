"""The model fingerprint keys the evaluation store, so two different sets of weights must never share one: a
checkpoint folder rewritten in place (an export with --overwrite, a training script saving to the same folder)
gets a new key even when the changed weight falls between the samples the old, strided fingerprint read."""
from __future__ import annotations

import os

import pytest
import torch

from cel_utils.evaluation.evaluator import NaiveEvaluator
from cel_utils.evaluation.store import EvalStore
from cel_utils.models.loading import load_model, model_fingerprint, random_model
from cel_utils.tasks.splits import load_task_data


def strided_sample(model: torch.nn.Module) -> list[torch.Tensor]:
    """What the fingerprint used to read: every (numel // 4096)-th value of each tensor."""
    return [t.reshape(-1)[:: max(1, t.numel() // 4096)].clone() for t in model.state_dict().values()]


def change_between_samples(model: torch.nn.Module) -> str:
    """Change one weight of the largest tensor that no strided sample reads; returns the tensor's name."""
    name, tensor = max(model.state_dict().items(), key=lambda item: item[1].numel())
    assert tensor.numel() // 4096 >= 2, "flat index 1 must fall between two samples"
    with torch.no_grad():
        tensor.reshape(-1)[1] += 1.0
    return name


@pytest.fixture
def checkpoint(tokenizer, tmp_path):
    """A tiny random Llama saved as a standard checkpoint folder, and the model object it was saved from."""
    model = random_model("llama", tokenizer=tokenizer, device="cpu").model
    folder = tmp_path / "checkpoint"
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder, model


def test_a_folder_rewritten_in_place_is_not_served_the_old_evaluations(checkpoint, data_dir, tmp_path):
    folder, model = checkpoint
    data = load_task_data("hellaswag", 2, 1, seed=0, data_dir=data_dir)
    store = EvalStore(tmp_path / "store")

    def evaluate(lm):
        NaiveEvaluator(lm, data.task, data.discovery, progress=False, store=store).evaluate([()])
        return store.counts()["read"]

    before = load_model(str(folder), device="cpu")
    assert evaluate(before) == 0
    assert evaluate(load_model(str(folder), device="cpu")) == 1  # unchanged folder: served (the store works)

    change_between_samples(model)
    model.save_pretrained(folder)  # the same folder, overwritten
    after = load_model(str(folder), device="cpu")
    # the case the strided fingerprint missed: every value it read is the same, the config too
    assert all(torch.equal(a, b) for a, b in zip(strided_sample(before.model), strided_sample(after.model)))
    assert after.source["weights_sha256"] != before.source["weights_sha256"]
    assert after.fingerprint != before.fingerprint
    assert evaluate(after) == 1  # computed anew, not served the old model's numbers


def test_loading_fails_when_the_weights_change_while_they_are_read(checkpoint, monkeypatch):
    folder, _ = checkpoint
    from transformers import AutoModelForCausalLM

    real = AutoModelForCausalLM.from_pretrained

    def load_then_rewrite(*args, **kwargs):
        loaded = real(*args, **kwargs)
        weights = folder / "model.safetensors"
        os.utime(weights, ns=(weights.stat().st_atime_ns, weights.stat().st_mtime_ns + 10**9))  # another writer
        return loaded

    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained", load_then_rewrite)
    with pytest.raises(RuntimeError, match="changed while the model was being loaded"):
        load_model(str(folder), device="cpu")


def test_models_without_files_are_keyed_by_every_tensor(tiny_models):
    import copy

    model = copy.deepcopy(tiny_models["llama"].model)
    source = {"kind": "random"}
    first = model_fingerprint(model, source)
    assert model_fingerprint(model, source) == first  # stable
    change_between_samples(model)
    assert model_fingerprint(model, source) != first


def test_where_the_checkpoint_lies_is_not_part_of_the_key(tiny_models):
    """The default model is dequantized into the cache folder, so its config names a path that differs between
    machines and clones; the key of the same weights must not."""
    import copy

    model = copy.deepcopy(tiny_models["llama"].model)
    source = {"kind": "gguf", "sha256": "1" * 64}
    first = model_fingerprint(model, source)
    model.config._name_or_path = "/another/cache/models/SmolLM2-135M-Instruct.Q4_1-b179c9523d0e6a0f"
    assert model_fingerprint(model, source) == first
    model.config.rms_norm_eps = 2 * model.config.rms_norm_eps  # any other setting is part of the key
    assert model_fingerprint(model, source) != first


def test_the_source_names_the_weights_when_it_can(tiny_models):
    model = tiny_models["llama"].model
    hub = {"kind": "hub", "id": "org/name"}
    at = [model_fingerprint(model, {**hub, "revision": commit}) for commit in ("a" * 40, "b" * 40, "a" * 40)]
    assert at[0] != at[1] and at[0] == at[2]  # a moved hub repository is another model
    # without a resolved commit the tensors themselves are hashed
    assert model_fingerprint(model, hub) == model_fingerprint(model, {"kind": "random"})
    gguf = [model_fingerprint(model, {"kind": "gguf", "sha256": digest}) for digest in ("1" * 64, "2" * 64)]
    assert gguf[0] != gguf[1]


def test_a_gguf_model_is_keyed_by_what_its_dequantization_produced(checkpoint, tmp_path, monkeypatch):
    """The same GGUF file dequantized by another transformers or gguf version may give other weights: the key follows
    the dequantized checkpoint that was loaded, not only the GGUF file's hash."""
    from cel_utils.models import loading

    folder, model = checkpoint
    gguf = tmp_path / "model.gguf"
    gguf.write_bytes(b"GGUF stand-in: its hash stays the same below")
    monkeypatch.setattr(loading, "dequantized_checkpoint", lambda path: folder)  # what dequantizing it produced
    before = load_model(str(gguf), device="cpu")
    assert before.source["sha256"] == loading.file_sha256(gguf)
    change_between_samples(model)
    model.save_pretrained(folder)  # the same file, dequantized to other weights
    after = load_model(str(gguf), device="cpu")
    assert after.source["sha256"] == before.source["sha256"]
    assert after.fingerprint != before.fingerprint
