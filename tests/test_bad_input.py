"""Bad input fails before the model is evaluated, with a message that names the problem and the fix, and
leaves no artifact. Each case also says where it is caught: ``validate`` (RunConfig.validate, before data or
model are loaded), ``data`` (loading and checking the items) or ``model`` (loading the model)."""
import json
from pathlib import Path

import pytest
import torch

import cel_utils.evaluation.engine as engine_module
import cel_utils.evaluation.evaluator as evaluation_module
import cel_utils.pipeline.protocol as protocol
from cel_utils.config import RunConfig
from cel_utils.models.heads import HeadId, parse_head
from cel_utils.pipeline.protocol import run_cel
from cel_utils.search.algorithm import run_search
from cel_utils.tasks.catalog import get_task
from cel_utils.tasks.specs import Item
from cel_utils.tasks.splits import check_disjoint, load_task_data

REPO = Path(__file__).resolve().parents[1]
MIRROR = REPO.parent / "shared" / "data"
BASE = dict(model="random:llama:tiny", task="hellaswag", n_discovery=4, n_holdout=4, p=3, k=2, n_random_sets=0,
            n_resamples=0, cache=False)

# (name, RunConfig overrides, exception, message pattern, where it is caught). "{tmp}" is the test's folder.
CASES = [
    ("unknown model spec (path)", {"model": "./no/such/model"}, FileNotFoundError,
     r"unknown model spec './no/such/model': it is not a file or directory that exists; use 'smollm2-135m-instruct', "
     r"'gemma3-270m', a hub id 'org/name', a checkpoint directory", "validate"),
    ("unknown model spec (random family)", {"model": "random:opt:tiny"}, ValueError,
     r"unknown family 'opt': choose from \['gemma3', 'gemma3_text', 'gpt2', 'llama'", "model"),
    ("empty model spec", {"model": ""}, ValueError, r"model spec must be a non-empty string, got '': use", "validate"),
    ("checkpoint directory without config.json", {"model": "{tmp}"}, FileNotFoundError,
     r"is a directory without config.json, not a checkpoint: point it at the folder that holds config.json", "validate"),
    ("unknown task", {"task": "arithmetic_9dz"}, ValueError,
     r"unknown task 'arithmetic_9dz': choose from arithmetic, arithmetic_1dc", "validate"),
    ("unknown prompt format", {"fmt": "html"}, ValueError, r"unknown fmt 'html': choose from plain, chat \(fmt: prompt "
     r"format", "validate"),
    ("unknown engine", {"engine": "turbo"}, ValueError, r"unknown engine 'turbo': choose from", "validate"),
    ("unknown dtype", {"dtype": "float8"}, ValueError, r"unknown dtype 'float8': use one of 'auto'", "validate"),
    ("unknown device", {"device": "tpu"}, ValueError, r"unknown device 'tpu': use 'auto'", "validate"),
    ("k < 1", {"k": 0}, ValueError, r"k must be a positive integer, got 0", "validate"),
    ("p < k", {"p": 2, "k": 3}, ValueError,
     r"pool size p=2 is smaller than the budget k=3: the subsets of size k come from the pool, so use p >= k", "validate"),
    ("p not an integer (papermill string)", {"p": "3"}, ValueError, r"p must be a positive integer, got '3'", "validate"),
    ("p larger than the number of heads", {"p": 13}, ValueError,
     r"pool size p=13 is larger than the model's 12 heads: use p <= 12", "model"),
    ("discovery size zero", {"n_discovery": 0}, ValueError,
     r"n_discovery must be a positive integer or None, got 0 \(n_discovery: discovery items \(none: the paper's Table 3 "
     r"size", "validate"),
    ("holdout size zero", {"n_holdout": 0}, ValueError,
     r"n_holdout must be a positive integer or None, got 0 \(n_holdout: holdout items \(none: the paper's", "validate"),
    ("discovery larger than the data", {"task": "mbpp", "n_discovery": 400}, ValueError,
     r"mbpp: discovery size 400 is larger than the 374 items available in train; use at most 374", "data"),
    ("holdout larger than the data", {"task": "mbpp", "n_holdout": 501}, ValueError,
     r"mbpp: holdout size 501 is larger than the 500 items available in test; use at most 500", "data"),
    ("discovery leaves no holdout", {"task": "arithmetic_2da", "n_discovery": 2000, "n_holdout": None}, ValueError,
     r"arithmetic_2da: discovery size 2000 leaves no holdout items in the validation pool \(2000 items\); "
     r"use at most 1999 discovery items", "data"),
    ("too many few-shot exemplars", {"task": "mbpp", "num_fewshot": 5}, ValueError,
     r"mbpp: only 3 fixed exemplars exist, asked for num_fewshot=5; use num_fewshot <= 3", "data"),
    ("negative num_fewshot", {"num_fewshot": -1}, ValueError,
     r"num_fewshot must be a non-negative integer or None, got -1 \(num_fewshot: few-shot exemplars \(none: the task's "
     r"default", "validate"),
    ("negative seed", {"seed": -1}, ValueError, r"seed must be a non-negative integer, got -1", "validate"),
    ("data dir that does not exist", {"data_dir": "/no/such/mirror"}, FileNotFoundError,
     r"data_dir '/no/such/mirror' does not exist or is not a directory: point it at a local mirror laid out like "
     r"shared/data \(one folder per dataset\), or leave it empty to load from the Hugging Face hub", "validate"),
    ("mirror without the task's folder", {"data_dir": "{tmp}"}, FileNotFoundError,
     r"has no folder 'hellaswag' for Rowan/hellaswag: add it \(laid out like shared/data\), point data_dir at a mirror "
     r"that has it, or leave data_dir empty", "data"),
    ("unwritable results directory", {"results_dir": "{tmp}/a file/results"}, PermissionError,
     r"results directory '.*/a file/results' is not writable \(Not a directory\): choose another results_dir", "validate"),
    ("cache not a bool", {"cache": "yes"}, ValueError,
     r"cache must be bool, got 'yes' \(cache: keep every finished evaluation in the store under \$CEL_CACHE_DIR",
     "validate"),
]
if not torch.cuda.is_available():
    CASES.append(("CUDA device without CUDA", {"device": "cuda"}, ValueError,
                  r"device 'cuda' is not available here \(0 CUDA device\(s\)\): use device='auto' \(CUDA if present, "
                  r"else CPU\) or 'cpu'", "validate"))


@pytest.fixture
def spied(monkeypatch):
    """Records how far a run got; any evaluation is a failure of the test."""
    reached = []
    for name in ("load_task_data", "load_model"):
        real = getattr(protocol, name)

        def spy(*args, _real=real, _name=name, **kwargs):
            reached.append(_name)
            return _real(*args, **kwargs)

        monkeypatch.setattr(protocol, name, spy)

    def no_evaluation(*args, **kwargs):
        raise AssertionError("the model was evaluated before the bad input was caught")

    monkeypatch.setattr(evaluation_module.Evaluator, "evaluate", no_evaluation)
    monkeypatch.setattr(engine_module.EngineEvaluator, "_evaluate", no_evaluation)
    return reached


def _stage(reached: list[str]) -> str:
    return "model" if "load_model" in reached else "data" if "load_task_data" in reached else "validate"


def _fill(value, tmp: Path):
    return value.replace("{tmp}", str(tmp)) if isinstance(value, str) else value


def _assert_nothing_written(results: Path) -> None:
    assert not (results.exists() and (list(results.glob("*.json")) or (results / "run-info").exists()))


@pytest.mark.parametrize("name, overrides, error, message, stage", CASES, ids=[c[0] for c in CASES])
def test_bad_run_parameters(tmp_path, spied, name, overrides, error, message, stage):
    (tmp_path / "a file").write_text("")
    overrides = {key: _fill(value, tmp_path) for key, value in overrides.items()}
    results = tmp_path / "results"
    config = RunConfig(**{**BASE, "data_dir": str(MIRROR), "results_dir": str(results), **overrides})
    with pytest.raises(error, match=message):
        run_cel(config, progress=False)
    assert _stage(spied) == stage
    _assert_nothing_written(results)


def test_unwritable_store_is_caught_in_validate(tmp_path, spied, monkeypatch):
    (tmp_path / "a file").write_text("")
    monkeypatch.setenv("CEL_CACHE_DIR", str(tmp_path / "a file"))
    config = RunConfig(**{**BASE, "cache": True, "data_dir": str(MIRROR), "results_dir": str(tmp_path / "results")})
    with pytest.raises(PermissionError, match=r"the evaluation store '.*/a file/evals' is not writable \(Not a "
                                              r"directory\): set \$CEL_CACHE_DIR to a writable directory, or turn the "
                                              r"store off \(cache=False, --no-cache\)"):
        run_cel(config, progress=False)
    assert _stage(spied) == "validate"
    _assert_nothing_written(tmp_path / "results")


def test_unsupported_architecture(tmp_path, spied):
    from transformers import OPTConfig

    checkpoint = tmp_path / "tiny-opt"
    OPTConfig(vocab_size=64, hidden_size=16, num_hidden_layers=1, ffn_dim=32, num_attention_heads=2,
              word_embed_proj_dim=16).save_pretrained(checkpoint)  # the config alone: no weights are read
    config = RunConfig(**{**BASE, "model": str(checkpoint), "data_dir": str(MIRROR), "results_dir": str(tmp_path / "r")})
    with pytest.raises(ValueError, match=r"unsupported architecture 'opt': cel_utils knows where the attention output "
                                         r"projection is for \[.*\]; add one line to cel_utils.models.plumbing.ARCHITECTURES"):
        run_cel(config, progress=False)
    assert _stage(spied) == "model"
    _assert_nothing_written(tmp_path / "r")


# --- malformed data rows, in a small local mirror ------------------------------------------------------------

def _bad_hellaswag(row: dict) -> None:
    row["label"] = "7"


def _no_ctx_b(row: dict) -> None:
    del row["ctx_b"]


def _three_endings(row: dict) -> None:
    row["endings"] = row["endings"][:3]


def _int_label(row: dict) -> None:
    row["label"] = int(row["label"])


def _broken_json(row: dict) -> str:
    return json.dumps(row)[:50]  # a line cut short, as by a crashed download


ROW_CASES = [
    ("HellaSwag label out of range", _bad_hellaswag, False,
     r"hellaswag row validation/5: label '7' is out of range: HellaSwag labels are the strings '0'..'3'; fix or remove "
     r"that row in .*/hellaswag \(validation split\)"),
    ("missing field", _no_ctx_b, False,
     r"hellaswag row validation/5: missing field 'ctx_b' \(rows need activity_label \(str\), ctx_a \(str\), ctx_b "
     r"\(str\), endings \(list\), label \(str\)\); fix or remove that row in .*/hellaswag \(validation split\)"),
    ("wrong number of endings", _three_endings, False, r"hellaswag row validation/5: has 3 endings, HellaSwag needs 4; fix"),
    ("wrong type in every row", _int_label, True,
     r"hellaswag row validation/0: field 'label' should be str, got int 3; fix or remove that row in"),
    # datasets falls back to pandas for a column of mixed types, which turns every '3' into 3: still caught.
    ("wrong type in one row", _int_label, False, r"hellaswag row validation/0: field 'label' should be str, got int"),
    ("a line that is not JSON", _broken_json, False,
     r"cannot read the 'validation' split of Rowan/hellaswag in the local mirror .*/hellaswag \(JSON parse error: .* "
     r"in row 5\): fix the malformed rows \(every row needs the same fields with the same types as the Hugging Face "
     r"dataset\)"),
]


@pytest.mark.parametrize("name, damage, every_row, message", ROW_CASES, ids=[c[0] for c in ROW_CASES])
def test_malformed_rows(tmp_path, spied, name, damage, every_row, message):
    folder = tmp_path / "mirror" / "hellaswag"
    folder.mkdir(parents=True)
    lines = (MIRROR / "hellaswag" / "validation.jsonl").read_text().splitlines()[:40]
    rows = [json.loads(line) for line in lines]
    lines = [json.dumps(row) for row in rows]
    for index, row in enumerate(rows):
        if every_row or index == 5:
            lines[index] = damage(row) or json.dumps(row)
    (folder / "validation.jsonl").write_text("".join(line + "\n" for line in lines))
    results = tmp_path / "results"
    config = RunConfig(**{**BASE, "data_dir": str(tmp_path / "mirror"), "results_dir": str(results)})
    with pytest.raises(ValueError, match=message):
        run_cel(config, progress=False)
    assert _stage(spied) == "data"
    _assert_nothing_written(results)


# --- head ids, overlapping sets -------------------------------------------------------------------------------

def test_a_head_outside_the_model_fails_before_any_forward(tiny_models, data_dir, monkeypatch):
    from cel_utils.evaluation.engine import EngineEvaluator

    monkeypatch.setattr(engine_module, "capture_layer_outputs", lambda *a, **k: pytest.fail("a forward ran"))
    lm = tiny_models["llama"]
    data = load_task_data("hellaswag", 3, 3, data_dir=data_dir)
    evaluator = EngineEvaluator(lm, data.task, data.discovery, progress=False)
    message = r"head L3.H0 is outside the model: it has layers 0..2 and query heads 0..3 per layer: use ids from L0.H0 to L2.H3"
    with pytest.raises(ValueError, match=message):
        evaluator.evaluate([(HeadId(0, 0),), (HeadId(3, 0),)])
    with pytest.raises(ValueError, match=r"head L0.H4 is outside the model"):
        run_search(evaluator, p=1, k=1, candidates=[HeadId(0, 1), HeadId(0, 4)])
    with pytest.raises(ValueError, match=r"cannot read head id 'L1H2': expected the form 'L<layer>.H<head>', e.g. 'L12.H3'"):
        parse_head("L1H2")


def test_overlapping_discovery_and_holdout():
    task = get_task("arithmetic_2da")
    doc = {"context": "Question: What is 1 plus 1?\nAnswer:", "completion": " 2"}
    with pytest.raises(ValueError, match=r"arithmetic_2da: 1 discovery item\(s\) also occur in the holdout by content "
                                         r"\(e.g. \['a'\]\); discovery, few-shot and holdout must be disjoint: draw them "
                                         r"with load_task_data, which drops such duplicates"):
        check_disjoint(task, [Item("a", dict(doc))], [Item("b", dict(doc))])


# --- papermill: the notebook's first cell after the parameters validates them ----------------------------------

def test_bad_papermill_parameter_fails_in_the_validate_cell(tmp_path):
    import nbformat
    import papermill as pm

    notebook, output, results = REPO / "notebooks" / "cel_run.ipynb", tmp_path / "bad.ipynb", tmp_path / "results"
    settings = {k: v for k, v in BASE.items() if k not in ("model", "task", "cache")}
    parameters = {"model": BASE["model"], "task": BASE["task"], "preset": "none",
                  "config": {**settings, "data_dir": "/no/such/mirror", "results_dir": str(results)}}
    with pytest.raises(pm.PapermillExecutionError) as caught:
        pm.execute_notebook(str(notebook), str(output), parameters=parameters, kernel_name="python3",
                            progress_bar=False, cwd=str(tmp_path))
    assert caught.value.ename == "FileNotFoundError" and "data_dir '/no/such/mirror' does not exist" in caught.value.evalue
    failed = [c.get("id") for c in nbformat.read(output, as_version=4).cells
              if any(o.output_type == "error" for o in c.get("outputs", []))]
    assert failed == ["validate"]
    _assert_nothing_written(results)
