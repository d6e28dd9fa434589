"""Export a frozen ablation as a standard Hugging Face checkpoint that needs no project code.

The ablation zeroes head h of layer l at the input of that layer's attention output projection (o_proj;
GPT-2's c_proj). The projection computes ``y = W z + b`` with ``z`` the concatenated head outputs, so
``W z = sum_h W[:, slice_h] z_h``: zeroing the columns ``W[:, slice_h]`` removes exactly the term that
zeroing ``z_h`` removes, for every input. This is :func:`cel_utils.models.ablation.zero_heads_in_weights`.

**Biases.** A bias ``b`` (GPT-2's c_proj; Llama-family models built with ``attention_bias=True``) is added
once, after the heads are summed; it belongs to no head, and the hook keeps it too (it zeroes ``z_h``,
not ``y``). So zeroing the columns is exactly equivalent with or without a bias: in both forms the
output is ``sum over kept heads of W_h z_h + b``. (Zeroing a head's input is not "removing everything the
head's layer adds": the bias stays, as it does under the hook the search used.)

The exported folder holds the model (safetensors), its tokenizer, ``cel_ablation.json`` (the heads and
where they came from) and a model card (``README.md``). :func:`logits_in_clean_process` loads any
checkpoint with ``AutoModelForCausalLM.from_pretrained`` in a fresh interpreter in which importing
``cel_utils`` fails, which is how the tests show the export stands alone.
"""
from __future__ import annotations

import copy
import json
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Iterable, Sequence

import torch

from cel_utils.models.ablation import ablated, zero_heads_in_weights
from cel_utils.models.heads import HeadId, format_heads, head_set
from cel_utils.models.loading import LoadedModel
from cel_utils.models.plumbing import architecture, attention_output_projections
from cel_utils.pipeline.schema import RunArtifact

CHECK_TEXT = "Question: What is 17 plus 25?\nAnswer: 42. The passage says the river is long."


def projection_has_bias(model: torch.nn.Module) -> bool:
    return any(getattr(p, "bias", None) is not None for p in attention_output_projections(model))


def ablated_copy(lm: LoadedModel, heads: Iterable[HeadId]) -> torch.nn.Module:
    """A copy of the model with the heads' output-projection weights zeroed (the original is untouched)."""
    model = copy.deepcopy(lm.model)
    zero_heads_in_weights(model, heads, lm.geometry)
    return model


def model_card(lm: LoadedModel, heads: Sequence[HeadId], artifact: RunArtifact | None = None) -> str:
    """README.md of an exported checkpoint: what was changed, why it is exact, where the heads came from."""
    heads = head_set(heads)
    layers_path, proj_path = architecture(lm.model)
    d = lm.geometry.head_dim
    changed = "\n".join(f"| `{h}` | `{layers_path}.{h.layer}.{proj_path}` | {h.head * d}..{(h.head + 1) * d - 1} |"
                        for h in heads)
    bias = ("This model's output projections have a bias. It is added once, after the heads are summed, and "
            "belongs to no head; it is kept, exactly as under the ablation hook (which zeroes the heads' inputs, not "
            "the projection's output), so the two are still exactly equivalent."
            if projection_has_bias(lm.model) else "This model's output projections have no bias.")
    lines = ["---", "library_name: transformers", "tags: [attention-head-ablation, cel]", "---", "",
             f"# {lm.name} with {len(heads)} attention head(s) zero-ablated: {format_heads(heads)}", "",
             f"This is `{lm.spec}` with the attention heads **{format_heads(heads)}** (layer `L`, query head `H`, "
             "counted from 0) switched off for every input. Nothing else differs from the original weights.", "",
             "## What was changed", "",
             "Zero-ablating a head multiplies its slice of the attention output projection's *input* by zero at every "
             "position. The projection computes `W z + b`, so the same effect is obtained by zeroing the weight columns "
             f"that read the head's slice (head_dim = {d}); those columns are zero in this checkpoint:", "",
             "| head | projection | input features zeroed |", "|---|---|---|", changed, "",
             bias + " So the logits of this checkpoint equal those of the original model run with the heads ablated "
             "by a hook.", "",
             "## Loading", "", "```python", "from transformers import AutoModelForCausalLM, AutoTokenizer", "",
             'model = AutoModelForCausalLM.from_pretrained("path/to/this/folder")',
             'tokenizer = AutoTokenizer.from_pretrained("path/to/this/folder")', "```", "",
             "No custom code is needed. Fine-tuning can make the zeroed columns non-zero again.", "",
             "## Provenance", "", f"* source model: `{lm.spec}` ({json.dumps(lm.source)})",
             f"* weight fingerprint of the source (cel-book's `model_fingerprint`): `{lm.fingerprint}`"]
    if artifact is not None:
        h, cfg = artifact["holdout"], artifact["config"]
        lines += [f"* heads found by capability enhancement localization (cel-book) on task **{artifact['task']['name']}** "
                  f"(seed {cfg['seed']}, {artifact['data'].get('n_discovery')} discovery items, pool p = {cfg['p']}, "
                  f"budget k = {cfg['k']})",
                  f"* holdout ({h['n_items']} items, {artifact['task']['metric']}): {100 * h['full_accuracy']:.2f}% -> "
                  f"{100 * h['ablated_accuracy']:.2f}% ({h['gain_points']:+.2f} points)"]
        sig = (artifact.get("reliability") or {}).get("significance")
        if sig:
            lines.append(f"* 95% paired bootstrap interval of the gain [{sig['ci_low']:+.2f}, {sig['ci_high']:+.2f}] "
                         f"points, exact McNemar p = {sig['p_value']:.3g}")
        lines.append("* a gain on one task can come with losses on others: evaluate before use.")
    return "\n".join(lines) + "\n"


def export_ablated(lm: LoadedModel, heads: Iterable[HeadId], out_dir: str | Path, *, artifact: RunArtifact | None = None,
                   overwrite: bool = False) -> Path:
    """Write the model with ``heads`` zeroed in its weights, its tokenizer, ``cel_ablation.json`` and a model card."""
    heads = head_set(heads)
    if not heads:
        raise ValueError("no heads to ablate: the export would be the original model")
    for head in heads:
        lm.geometry.check(head)
    out = Path(out_dir)
    if out.exists() and any(out.iterdir()) and not overwrite:
        raise FileExistsError(f"{out} exists and is not empty: choose another folder or pass overwrite=True")
    out.mkdir(parents=True, exist_ok=True)
    ablated_copy(lm, heads).save_pretrained(out)
    lm.tokenizer.save_pretrained(out)
    record = {"ablated_heads": [str(h) for h in heads], "head_dim": lm.geometry.head_dim,
              "projection": ".".join(architecture(lm.model)), "projection_has_bias": projection_has_bias(lm.model),
              "source_model": lm.spec, "source": lm.source, "source_fingerprint": lm.fingerprint,
              "artifact": None if artifact is None else {"task": artifact["task"]["name"], "seed": artifact["config"]["seed"],
                                                         "frozen": artifact["frozen"]["heads"]}}
    (out / "cel_ablation.json").write_text(json.dumps(record, indent=1) + "\n")
    (out / "README.md").write_text(model_card(lm, heads, artifact))
    return out


_CLEAN_LOADER = """
import sys, json
sys.modules["cel_utils"] = None  # importing the project from here fails: the checkpoint must stand alone
import torch
from transformers import AutoModelForCausalLM
request = json.load(open(sys.argv[1]))
ids = torch.tensor(request["ids"])
out = {}
for folder in request["folders"]:
    model = AutoModelForCausalLM.from_pretrained(folder).eval()
    with torch.no_grad():
        out[folder] = model(ids).logits
torch.save(out, sys.argv[2])
"""


def logits_in_clean_process(folders: Sequence[str | Path], ids: torch.Tensor, timeout_s: float = 600) -> list[torch.Tensor]:
    """Logits of ``ids`` from each checkpoint, loaded by plain ``AutoModelForCausalLM`` in a fresh interpreter."""
    folders = [str(Path(f).resolve()) for f in folders]
    with tempfile.TemporaryDirectory() as tmp:
        request, result = Path(tmp) / "request.json", Path(tmp) / "logits.pt"
        request.write_text(json.dumps({"ids": ids.tolist(), "folders": folders}))
        done = subprocess.run([sys.executable, "-I", "-c", _CLEAN_LOADER, str(request), str(result)],
                              capture_output=True, text=True, timeout=timeout_s, cwd=tmp)
        if done.returncode != 0:
            raise RuntimeError(f"loading the export in a clean process failed:\n{done.stderr[-3000:]}")
        loaded = torch.load(result)
    return [loaded[f] for f in folders]


@torch.no_grad()
def hooked_logits(lm: LoadedModel, heads: Iterable[HeadId], ids: torch.Tensor) -> torch.Tensor:
    """The reference: the original model with the heads ablated by the hook the search used."""
    with ablated(lm.model, heads, lm.geometry):
        return lm.model(ids.to(lm.device)).logits.cpu()


def verify_export(lm: LoadedModel, heads: Iterable[HeadId], out_dir: str | Path, text: str = CHECK_TEXT) -> float:
    """Largest |logit difference| between the exported checkpoint (clean process) and the hooked model; the
    result is recorded in the folder's model card and ``cel_ablation.json``."""
    ids = lm.tokenizer(text, return_tensors="pt").input_ids
    (exported,) = logits_in_clean_process([out_dir], ids)
    difference = float((exported.float() - hooked_logits(lm, heads, ids).float()).abs().max())
    out = Path(out_dir)
    record = json.loads((out / "cel_ablation.json").read_text())
    record["check"] = {"text": text, "max_abs_logit_difference": difference}
    (out / "cel_ablation.json").write_text(json.dumps(record, indent=1) + "\n")
    with open(out / "README.md", "a", encoding="utf-8") as card:
        card.write(f"\n## Check\n\nLoaded with plain `transformers` (no cel-book code) on {len(ids[0])} tokens of "
                   f"text, this checkpoint's logits differ from the hooked original's by at most {difference:.1e}.\n")
    return difference
