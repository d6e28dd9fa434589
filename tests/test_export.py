"""The exported checkpoint loads with plain transformers (no cel_utils) and reproduces the hooked model's logits."""
import json

import pytest
import torch

from cel_utils.cli import main
from cel_utils.models.heads import HeadId
from cel_utils.models.loading import LoadedModel
from cel_utils.models.plumbing import head_geometry
from cel_utils.models.random_models import FAMILIES
from cel_utils.pipeline.artifacts import write_json
from cel_utils.pipeline.export import (
    export_ablated,
    hooked_logits,
    logits_in_clean_process,
    projection_has_bias,
    verify_export,
)

HEADS = [HeadId(0, 1), HeadId(2, 3)]


@pytest.fixture(scope="module")
def biased_llama(tokenizer):
    """A tiny Llama whose o_proj has a bias (attention_bias=True): the bias must survive the export."""
    from transformers import AutoModelForCausalLM

    from cel_utils.models.random_models import random_config

    config = random_config("llama", "tiny", vocab_size=len(tokenizer))
    config.attention_bias = True
    torch.manual_seed(1)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa").eval()
    with torch.no_grad():  # random init leaves biases at zero; make them count
        for layer in model.model.layers:
            layer.self_attn.o_proj.bias.normal_(0, 0.5)
    return LoadedModel(model=model, tokenizer=tokenizer, geometry=head_geometry(model), spec="random:llama-bias:tiny",
                       name="random-llama-bias-tiny", source={"kind": "random"})


def test_exports_of_every_family_load_without_project_code_and_match_the_hook(tiny_models, biased_llama, tmp_path):
    models = {**tiny_models, "llama-bias": biased_llama}
    assert projection_has_bias(tiny_models["gpt2"].model) and projection_has_bias(biased_llama.model)
    assert not projection_has_bias(tiny_models["llama"].model)
    ids = torch.randint(0, 1000, (2, 12), generator=torch.Generator().manual_seed(0))
    folders = {name: export_ablated(lm, HEADS, tmp_path / name) for name, lm in models.items()}
    loaded = logits_in_clean_process(list(folders.values()), ids)  # one fresh interpreter for all of them
    for (name, lm), exported in zip(models.items(), loaded):
        reference = hooked_logits(lm, HEADS, ids)
        torch.testing.assert_close(exported, reference, rtol=0, atol=1e-5, msg=name)
        with torch.no_grad():
            assert (exported - lm.model(ids).logits).abs().max() > 1e-4, f"{name}: the ablation must change the logits"
    assert set(models) - {"llama-bias"} == set(FAMILIES)


def test_folder_contents_and_model_card(tiny_models, tmp_path):
    lm = tiny_models["gpt2"]
    out = export_ablated(lm, HEADS, tmp_path / "gpt2")
    assert {"config.json", "model.safetensors", "README.md", "cel_ablation.json", "tokenizer.json"} <= {p.name for p in out.iterdir()}
    record = json.loads((out / "cel_ablation.json").read_text())
    assert record["ablated_heads"] == ["L0.H1", "L2.H3"] and record["projection"] == "transformer.h.attn.c_proj"
    assert record["projection_has_bias"] is True and record["source_fingerprint"] == lm.fingerprint
    card = (out / "README.md").read_text()
    assert "L0.H1+L2.H3" in card and "transformer.h.2.attn.c_proj" in card and "48..63" in card  # head 3, head_dim 16
    assert "have a bias" in card and "AutoModelForCausalLM.from_pretrained" in card
    with pytest.raises(FileExistsError, match="not empty"):
        export_ablated(lm, HEADS, out)
    with pytest.raises(ValueError, match="no heads"):
        export_ablated(lm, [], tmp_path / "empty")
    with pytest.raises(ValueError, match="outside the model"):
        export_ablated(lm, [HeadId(3, 0)], tmp_path / "bad")


def _artifact_for(lm, heads) -> dict:
    """A run's artifact (the schema's, from tests/test_report.py) naming ``lm`` and freezing ``heads``."""
    from test_report import make_artifact, reliability

    art = make_artifact(model=lm.name, task="arithmetic_2da", full=0.5, ablated=0.625, n_items=8)
    art["config"].update(model=lm.spec, p=3, k=2)
    art["model"].update(name=lm.name, fingerprint=lm.fingerprint, dtype="float32")
    art["data"]["n_discovery"] = 6
    art["frozen"]["heads"] = [str(h) for h in heads]
    art["reliability"] = reliability(significance={
        "n_items": 8, "help": 2, "harm": 1, "gain_points": 12.5, "ci_low": -12.5, "ci_high": 37.5, "confidence": 0.95,
        "n_resamples": 0, "p_value": 1.0, "test": "exact McNemar", "interval": "exact (few changed answers)"})
    return art


def test_cli_exports_the_frozen_set_of_an_artifact(tiny_models, tmp_path, capsys):
    lm = tiny_models["llama"]  # random:llama:tiny, seed 0: the CLI loads the same weights again
    write_json(tmp_path / "run.json", _artifact_for(lm, HEADS))
    assert main(["export", "--artifact", str(tmp_path / "run.json"), "--out", str(tmp_path / "out")]) == 0
    printed = capsys.readouterr().out
    assert "L0.H1+L2.H3" in printed and "largest |logit difference|" in printed
    assert json.loads((tmp_path / "out" / "cel_ablation.json").read_text())["check"]["max_abs_logit_difference"] < 1e-5
    card = (tmp_path / "out" / "README.md").read_text()
    assert "arithmetic_2da" in card and "50.00% -> 62.50% (+12.50 points)" in card and "[-12.50, +37.50]" in card

    changed = _artifact_for(lm, HEADS)
    changed["model"]["fingerprint"] = "different"
    write_json(tmp_path / "changed.json", changed)
    assert main(["export", "--artifact", str(tmp_path / "changed.json"), "--out", str(tmp_path / "out2")]) == 2
    assert "not those the run used" in capsys.readouterr().err


@pytest.mark.slow
def test_export_of_the_default_model_matches_the_hook(default_model, tmp_path):
    heads = [HeadId(3, 2), HeadId(14, 0), HeadId(27, 8)]
    out = export_ablated(default_model, heads, tmp_path / "smollm2")
    assert verify_export(default_model, heads, out) < 1e-4
