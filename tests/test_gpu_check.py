"""scripts/gpu_check.py, the check a lent GPU runs, run here on the CPU with tiny models so that it cannot rot: in a
process that cannot import what the GPU machine lacks, every check recorded with its fields and holding, and its
comparisons shown to catch a difference."""
from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "scripts" / "gpu_check.py"
ABSENT = ("datasets", "gguf", "papermill")  # installed here, not on the GPU machine

# Runs a script (argv[1], its arguments after it) with ABSENT hidden from every import finder: neither their modules nor
# their distributions are found, as where they are not installed (transformers then takes them for absent too).
RUNNER = textwrap.dedent("""
    import importlib.abc, runpy, sys

    ABSENT = {absent!r}

    class WithoutAbsent(importlib.abc.MetaPathFinder):
        def __init__(self, inner):
            self.inner = inner

        def __getattr__(self, name):
            return getattr(self.inner, name)

        def find_spec(self, name, path=None, target=None):
            return None if name.partition(".")[0] in ABSENT else self.inner.find_spec(name, path, target)

        def find_distributions(self, *args, **kwargs):
            found = getattr(self.inner, "find_distributions", None)
            return [d for d in (found(*args, **kwargs) if found else ())
                    if (d.metadata["Name"] or "").lower() not in ABSENT]

    sys.meta_path[:] = [WithoutAbsent(finder) for finder in sys.meta_path]
    script, sys.argv = sys.argv[1], sys.argv[1:]
    runpy.run_path(script, run_name="__main__")
""").format(absent=set(ABSENT))

CHECKS = ("engine == naive", "hook == surgery")
FP32_ONLY = ("guarded == fp32",)
DECODING_ONLY = ("naive == transformers",)
@pytest.fixture(scope="module")
def gpu_check():
    """The script as a module, for its functions."""
    spec = importlib.util.spec_from_file_location("gpu_check", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    yield module
    del sys.modules[spec.name]


def run_without_absent(*args: str, timeout: float = 600) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", RUNNER, *args], capture_output=True, text=True, timeout=timeout,
                          cwd=REPO)


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory) -> tuple[subprocess.CompletedProcess, dict]:
    out = tmp_path_factory.mktemp("gpu_check") / "gpu_check.json"
    done = run_without_absent(str(SCRIPT), "--device", "cpu", "--tiny", "--out", str(out))
    assert out.is_file(), f"no results written:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    return done, json.loads(out.read_text())


def test_the_runner_hides_what_the_gpu_machine_lacks(tmp_path):
    probe = tmp_path / "probe.py"
    probe.write_text("from importlib.util import find_spec\n"
                     "print(find_spec('datasets'), find_spec('json') is not None)\n"
                     "import datasets\n")
    done = run_without_absent(str(probe), timeout=60)
    assert done.stdout.split() == ["None", "True"] and "No module named 'datasets'" in done.stderr


def test_the_tiny_run_finishes_and_says_where_it_ran(tiny_run):
    done, record = tiny_run
    assert record["finished"] and record["environment"]["tiny"]
    assert done.returncode == (0 if record["holds"] else 1), done.stderr[-3000:]
    env = record["environment"]
    assert env["device"] == "cpu" and env["device_name"] and env["torch"] and env["transformers"] and env["date"]
    assert record["tokenizer"]["vocab"] == max(m["config"]["vocab_size"] for m in record["models"].values())
    assert "engine == naive" in done.stdout and "fp32/guarded" in done.stdout  # the two tables


def test_every_check_is_recorded_with_its_fields(gpu_check, tiny_run):
    _, record = tiny_run
    expected = {(model, attention, dtype, task, check)
                for model in gpu_check.MODELS for attention in gpu_check.ATTENTIONS
                for dtype in ("float32", "bfloat16") for task, kind in gpu_check.TASKS.items()
                for check in CHECKS + (FP32_ONLY if dtype == "float32" else ())
                + (DECODING_ONLY if kind == "decoding" else ())}
    rows = {(r["model"], r["attention"], r["dtype"], r["task"], r["check"]): r for r in record["checks"]}
    assert len(rows) == len(record["checks"]) and set(rows) == expected
    for key, row in rows.items():
        if "error" in row:
            continue
        assert row["pairs"] > 0 and row["decisions_differ_outside_ties"] <= row["decisions_differ"], key
        assert row["tie"] >= gpu_check.FP32.tie, key
        if key[-1] == "guarded == fp32":
            assert row["margin_tolerance"] is None and row["rechecked"] + row["audited"] > 0, key
        else:
            assert row["margin_tolerance"] >= gpu_check.FP32.margin and row["max_margin_diff"] >= 0, key
            assert row["holds"] == (row["decisions_differ_outside_ties"] == 0
                                    and row["max_margin_diff"] <= row["margin_tolerance"]), key


def test_every_check_holds(tiny_run):
    """Every check on every model, kernel, dtype and task (Gemma 3's guarded rechecks included: pair_stats once
    indexed its per-layer-type attention masks as one tensor and raised a KeyError there)."""
    _, record = tiny_run
    failing = [r for r in record["checks"] if not r["holds"]]
    assert not failing, failing


def test_the_stage1_timings(gpu_check, tiny_run):
    _, record = tiny_run
    timings = {(t["model"], t["task"]): t for t in record["timings"]}
    assert set(timings) == {(model, task) for model in gpu_check.BOOK_MODELS for task in gpu_check.TIMED_TASKS}
    for key, t in timings.items():
        assert t["holds"] and t["guarded_flips_outside_ties"] == 0, t
        assert t["items"] == record["scale"]["timing_items"]
        assert t["interventions"] == record["models"][key[0]]["heads"] + 1
        assert t["pairs"] == t["items"] * t["interventions"]
        assert min(t["fp32_s"], t["bf16_s"], t["guarded_s"]) > 0 and 0 <= t["share_rechecked"] <= 1
        assert t["mean_context_tokens"] > {"boolq": 50, "hellaswag": 20}[key[1]]  # prompts of the tasks' lengths


def _outcome(predictions, correct, margins, scores=None):
    from cel_utils.tasks.scoring import Outcome

    return Outcome(item_ids=["a", "b"], correct=np.asarray(correct, bool), margin=np.asarray(margins, float),
                   predictions=list(predictions), scores=scores)


def _choice(predictions, scores, gold=(1, 0)):
    """Two items of two answers, decided as cel_utils.tasks.scoring.decide_choice decides them."""
    scores = np.array(scores, float)
    margins = [s[g] - np.delete(s, g).max() for s, g in zip(scores, gold)]
    return _outcome(predictions, np.array(predictions) == np.array(gold), margins, scores)


def test_the_comparisons_catch_what_differs(gpu_check):
    tol = gpu_check.FP32
    reference = [_choice([1, 0], [[0.0, 1.0], [2.0, 0.5]])]
    assert gpu_check.compare_outcomes(reference, reference, tol)["holds"]
    flipped = [_choice([1, 1], [[0.0, 1.0], [0.5, 2.0]])]  # item b's answer changes; its reference gap was 1.5
    result = gpu_check.compare_outcomes(reference, flipped, tol)
    assert not result["holds"] and result["decisions_differ_outside_ties"] == 1
    assert not gpu_check.compare_outcomes(reference, flipped, tol, margins=False)["holds"]
    tied = [_choice([1, 0], [[0.0, 1.0], [2.0, 2.0 - 5e-5]])]
    tied_flip = [_choice([1, 1], [[0.0, 1.0], [2.0 - 5e-5, 2.0]])]  # a flip at a float tie may go either way
    assert gpu_check.compare_outcomes(tied, tied_flip, tol)["holds"]
    shifted = [_choice([1, 0], [[0.0, 1.01], [2.0, 0.5]])]  # the same decisions, a margin 1e-2 away
    assert not gpu_check.compare_outcomes(reference, shifted, tol)["holds"]
    assert gpu_check.compare_outcomes(reference, shifted, tol, margins=False)["holds"]
    greedy = [_outcome([None, None], [True, False], [0.3, -0.2])]
    wrong = [_outcome([None, None], [True, True], [0.3, 0.2])]
    assert gpu_check.compare(greedy, greedy, tol)["holds"] and not gpu_check.compare(greedy, wrong, tol)["holds"]


def test_the_decoding_comparisons_catch_what_differs(gpu_check):
    from cel_utils.evaluation.generation import Decoded

    tol = gpu_check.FP32
    reference = [[("x", Decoded([5, 6, 7], [0.5, 0.4, 0.3]))]]
    assert gpu_check.compare(reference, reference, tol)["holds"]
    parted = [[("y", Decoded([5, 9, 7], [0.5, 0.4, 0.3]))]]  # another token where the reference's gap was 0.4
    assert gpu_check.compare_decodings(reference, parted, tol)["decisions_differ_outside_ties"] == 1
    at_tie = [[("x", Decoded([5, 6, 7], [0.5, 5e-5, 0.3]))]]
    assert gpu_check.compare_decodings(at_tie, [[("y", Decoded([5, 9, 7], [0.5, 5e-5, 0.3]))]], tol)["holds"]
    drifted = [[("x", Decoded([5, 6, 7], [0.5, 0.41, 0.3]))]]
    assert not gpu_check.compare_decodings(reference, drifted, tol)["holds"]
    assert not gpu_check.compare_completions(reference, [["y"]], tol)["holds"]
    assert gpu_check.compare_completions(reference, [["x"]], tol)["holds"]
    assert gpu_check.bf16_tolerance(reference, drifted).margin == pytest.approx(0.02)


def test_bad_input_fails_before_anything_is_written(gpu_check, tmp_path, monkeypatch, capsys):
    out = tmp_path / "gpu_check.json"
    with pytest.raises(SystemExit):
        gpu_check.main(["--models", "smollm2-135m", "--timing-models", "gemma3-270m", "--out", str(out)])
    assert "not among --models" in capsys.readouterr().err
    monkeypatch.delenv("OUT", raising=False)
    with pytest.raises(SystemExit, match="pass --out PATH"):
        gpu_check.main(["--device", "cpu", "--tiny"])
    with pytest.raises(ValueError, match="not available here"):
        gpu_check.main(["--device", "cuda:7", "--tiny", "--out", str(out)])
    assert not out.exists()


def test_a_transformers_that_drops_the_cache_argument_is_refused(gpu_check):
    from transformers import LlamaModel

    def older_forward(self, input_ids=None, past_key_values=None, use_cache=None):
        """transformers 5.17's spelling."""

    assert gpu_check.cache_keyword_missing(older_forward)
    assert not gpu_check.cache_keyword_missing(LlamaModel.forward)
