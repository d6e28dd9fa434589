"""The code versions in the evaluation store's key (``ENGINE_VERSION``, the naive path's ``store_kind``) are kept by
hand, so that an edit that changes no number (a comment, a rename) keeps every stored evaluation of a resumable run.
What each version stands for is declared beside it (``store_sources``); this test records a sha256 of those modules
per version and fails when they change while the version stays the same."""
import pytest

from cel_utils.evaluation.engine import EngineEvaluator
from cel_utils.evaluation.evaluator import NaiveEvaluator
from cel_utils.evaluation.store import source_sha256

# store_kind -> sha256 of its store_sources (cel_utils.evaluation.store.source_sha256).
RECORDED = {
    # naive-1, with issue 27's top-2 gaps that generate reports when asked (the default path computes the same), and
    # the prefix's clean pass once per generate call (completions and gaps bit-identical to before)
    "naive-1": "129e6fd27ccf251aed6cf81176a25f1a46d5803fa117bfcf41c61fc9dac941aa",
    # engine-2 (issue 28: packed answers see a sliding window), with issue 27's pair recheck and fast pass (fp32 unchanged)
    # and the few-shot prefix's clean pass once per call (fp32, fast pass and rechecks bit-identical to before)
    "engine-2": "385613adf25523342437f297837b19374fda8efc16ae324f00540c6549e3a426",
}
WHERE = {NaiveEvaluator: "store_kind in cel_utils/evaluation/evaluator.py",
         EngineEvaluator: "ENGINE_VERSION in cel_utils/evaluation/engine.py"}


@pytest.mark.parametrize("evaluator", [NaiveEvaluator, EngineEvaluator], ids=lambda cls: cls.__name__)
def test_the_code_behind_each_store_version_is_the_code_recorded(evaluator):
    kind, now = evaluator.store_kind, source_sha256(evaluator.store_sources)
    assert RECORDED.get(kind) == now, (
        f"the code behind store version {kind!r} ({', '.join(evaluator.store_sources)}) is not the code recorded for "
        f"it. If the change can alter any number the evaluator stores (a value, its rounding, its order), bump "
        f"{WHERE[evaluator]} so that stores filled by the old code are not read; either way, record the new hash in "
        f"tests/test_store_versions.py: RECORDED[{evaluator.store_kind!r} or the new kind] = {now!r}")


def test_the_hash_follows_any_change_of_the_listed_sources(tmp_path, monkeypatch):
    package = tmp_path / "versioned_pkg"
    package.mkdir()
    (package / "__init__.py").write_text("")
    module = package / "numbers.py"
    module.write_text("SCALE = 1.0\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    first = source_sha256(["versioned_pkg.numbers"])
    assert source_sha256(["versioned_pkg.numbers"]) == first
    module.write_bytes(b"SCALE = 1.0\r\n")  # the same code checked out with CRLF line endings
    assert source_sha256(["versioned_pkg.numbers"]) == first
    module.write_text("SCALE = 1.0 + 1e-12\n")
    assert source_sha256(["versioned_pkg.numbers"]) != first
    with pytest.raises(ModuleNotFoundError, match="not an importable module: fix the name"):
        source_sha256(["versioned_pkg.missing"])
