"""The code versions in the evaluation store's key (``ENGINE_VERSION``, the naive path's ``store_kind``) are kept by
hand, so that an edit that changes no number (a comment, a rename) keeps every stored evaluation of a resumable run.
What each version stands for is declared beside it (``store_sources``); this test records a hash of those modules
per version and fails when they change while the version stays the same.

The hash is of what can change a number: the code without its comments and docstrings (:func:`code_text`), so that
editing those needs neither a new version nor a new recorded hash. It is taken from the source text itself, not from
an AST or token stream that another Python release would print or split otherwise, so it is the same on every Python
that runs the tests.
"""
import ast
import hashlib
import importlib.util
import io
import sys
import tokenize
from pathlib import Path
from typing import Iterable

import pytest

from cel_utils.evaluation.engine import EngineEvaluator
from cel_utils.evaluation.evaluator import NaiveEvaluator

# store_kind -> code_sha256 of its store_sources. Recorded under this scheme from the code whose raw-source sha256 had
# been recorded before (naive-1 129e6fd2..., engine-2 385613ad...), with MBPP's execution limits passed on to the
# sandbox (issue 43: score_generations and the evaluator's arguments; completions and statistics unchanged).
RECORDED = {
    # naive-1, with issue 27's top-2 gaps that generate reports when asked (the default path computes the same), and
    # the prefix's clean pass once per generate call (completions and gaps bit-identical to before)
    # issue 42: mean-ablation (the hook adds offsets only inside replaced_by_means, with store fields of its own;
    # zero-ablation computes the same bits: the reference artifacts are unchanged)
    # issue 43, refactors that change no number (the reference artifacts are unchanged): prefix_states is given the
    # prefix's clean pass always; every keyword setting is recorded for sibling() (one evaluator interface)
    # issue 46: continuation_stats can leave the greedy statistics out (the engine's choice kind); the naive path
    # asks for them as before (what it computes and stores is unchanged)
    # issue 46: one constructor per form of ContinuationStats (of, log_likelihoods_only) and the log-likelihood as a
    # function of its own (continuation_loglikelihood), which continuation_stats calls; the same operations in the
    # same order (the reference artifacts are unchanged)
    "naive-1": "5b17bf3d3feb41c8518e6b6c2da29ea3beb5f08b6644b20c9f4804d8788f91ab",
    # engine-2 (issue 28: packed answers see a sliding window), with issue 27's pair recheck and fast pass (fp32
    # unchanged), the few-shot prefix's clean pass once per call (fp32, fast pass and rechecks bit-identical to
    # before), issue 42's mean-ablation as for naive-1, and pair_stats taking Gemma 3's per-layer-type masks (the
    # guarded recheck raised there before, so nothing was ever stored from it)
    # issue 43: the model above the intervention as one seam (``above``, was ``fast_lm``), the guarded pair recheck
    # moved to cel_utils.evaluation.guarded (it stores nothing); settings recorded as for naive-1 (fp32, the fast pass
    # and the rechecks bit-identical to before)
    # issue 46: continuation_stats hands each batch's clean pass to an ``after_batch`` callback (the guarded precision's
    # rechecks), which stores nothing; what it computes and stores is unchanged (the fingerprints and reference
    # artifacts are)
    # issue 46: clean passes kept across calls (cel_utils.evaluation.clean_passes, now among the sources): a later
    # call starts from the states its own clean pass would have computed from the same inputs (the reference artifacts
    # and the default model's BoolQ, HellaSwag and arithmetic_1dc artifacts are byte-identical)
    # issue 46: the engine's clean_pass made public (was _clean_pass) for the guarded rechecks after the fast pass,
    # which read the kept clean passes through it; a rename (what the engine computes and stores is unchanged)
    # engine-3 (issue 46): a kind whose decision does not read the greedy statistics (multiple choice) stores them
    # empty (False, NaN), skipping a copy of every scored position's logits and a maximum over them; the
    # log-likelihoods are the same bits (bench_scoring.py checks it; the reference artifacts are unchanged), but
    # engine-2's records of such kinds held them, so a new version keeps the two apart
    # issue 46: the empty greedy statistics made in one place (ContinuationStats.log_likelihoods_only, for BoolQ's
    # one-token shortcut and for multiple choice alike) and the log-likelihood alone from continuation_loglikelihood
    # (the same bits: test_engine compares them against the statistics forced on)
    "engine-3": "12a7d44778696a72dc94bdf5dfd09aa5a6ebd64e813d725a0f3ea97ee8aaa331",
}
WHERE = {NaiveEvaluator: "store_kind in cel_utils/evaluation/evaluator.py",
         EngineEvaluator: "ENGINE_VERSION in cel_utils/evaluation/engine.py"}


def code_text(source: str) -> str:
    """``source`` without its comments and docstrings (a module's, class's or function's first statement when it is a
    string), without blank lines and trailing spaces: what is left can change a number."""
    source = source.replace("\r\n", "\n")
    lines = source.split("\n")

    def column(line: int, byte_offset: int) -> int:  # ast counts a line's UTF-8 bytes, tokenize its characters
        return len(lines[line - 1].encode()[:byte_offset].decode())

    cuts = [(token.start, token.end) for token in tokenize.generate_tokens(io.StringIO(source).readline)
            if token.type == tokenize.COMMENT]
    for node in ast.walk(ast.parse(source)):
        body = getattr(node, "body", None) if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef,
                                                                ast.AsyncFunctionDef)) else None
        if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant) \
                and isinstance(body[0].value.value, str):
            doc = body[0]
            cuts.append(((doc.lineno, column(doc.lineno, doc.col_offset)),
                         (doc.end_lineno, column(doc.end_lineno, doc.end_col_offset))))
    for (first, start), (last, end) in sorted(cuts, reverse=True):  # from the end: earlier positions stay valid
        lines[first - 1:last] = [lines[first - 1][:start] + lines[last - 1][end:]]
    return "\n".join(line.rstrip() for line in lines if line.strip())


def code_sha256(modules: Iterable[str]) -> str:
    """sha256 of :func:`code_text` of ``modules`` (dotted names), each with its name: the code an evaluator's
    ``store_kind`` stands for."""
    digest = hashlib.sha256()
    for name in modules:
        spec = importlib.util.find_spec(name)
        if spec is None or not spec.origin:
            raise ModuleNotFoundError(f"store_sources names {name!r}, which is not an importable module: fix the name")
        digest.update(f"{name}\0{code_text(Path(spec.origin).read_text(encoding='utf-8'))}\0".encode())
    return digest.hexdigest()


@pytest.mark.parametrize("evaluator", [NaiveEvaluator, EngineEvaluator], ids=lambda cls: cls.__name__)
def test_the_code_behind_each_store_version_is_the_code_recorded(evaluator):
    kind, now = evaluator.store_kind, code_sha256(evaluator.store_sources)
    assert RECORDED.get(kind) == now, (
        f"the code behind store version {kind!r} ({', '.join(evaluator.store_sources)}) is not the code recorded for "
        f"it (comments and docstrings aside). If the change can alter any number the evaluator stores (a value, its "
        f"rounding, its order), bump {WHERE[evaluator]} so that stores filled by the old code are not read; either "
        f"way, record the new hash in tests/test_store_versions.py: RECORDED[{kind!r} or the new kind] = {now!r}")


CODE = '''"""A module of numbers."""
import math

SCALE = 1.0  # the unit


class Ruler:
    """Measures."""

    def length(self, x):
        """In units."""
        return math.fabs(x) * SCALE  # never negative
'''


@pytest.fixture
def module(tmp_path, monkeypatch):
    """A module ``versioned_pkg.numbers`` holding CODE, to be rewritten."""
    monkeypatch.delitem(sys.modules, "versioned_pkg", raising=False)  # find_spec imports the package: another test's
    package = tmp_path / "versioned_pkg"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "numbers.py").write_text(CODE)
    monkeypatch.syspath_prepend(str(tmp_path))
    return package / "numbers.py"


def test_comments_docstrings_and_blank_lines_keep_the_hash(module):
    first = code_sha256(["versioned_pkg.numbers"])
    assert code_sha256(["versioned_pkg.numbers"]) == first
    assert "SCALE = 1.0\n" in code_text(CODE) and "unit" not in code_text(CODE) and "Measures" not in code_text(CODE)
    module.write_bytes(CODE.replace("\n", "\r\n").encode())  # the same code checked out with CRLF line endings
    assert code_sha256(["versioned_pkg.numbers"]) == first
    edits = [CODE.replace("# the unit", "# the unit, in metres (see the paper)"),
             CODE.replace("    def length", "    # a comment line of its own\n\n    def length"),
             CODE.replace('"""Measures."""', '"""Measures lengths:\n    more lines, é and all."""'),
             CODE.replace('"""In units."""', "'''Ünits.'''  # and a comment after it"),
             CODE.replace('"""A module of numbers."""\n', ""),
             CODE.replace("  # never negative", "")]
    for edited in edits:
        module.write_text(edited, encoding="utf-8")
        assert code_sha256(["versioned_pkg.numbers"]) == first, edited


def test_a_code_change_alters_the_hash(module):
    first = code_sha256(["versioned_pkg.numbers"])
    edits = [CODE.replace("SCALE = 1.0", "SCALE = 1.0 + 1e-12"),
             CODE.replace("math.fabs(x)", "abs(x)"),
             CODE.replace("return math", "x = 2 * x\n        return math"),
             CODE.replace("* SCALE  #", "/ SCALE  #"),
             CODE.replace('"""In units."""', '"""In units."""\n        "not a docstring"'),  # a statement after it
             CODE.replace("    def length(self, x):", "    @staticmethod\n    def length(self, x):")]
    seen = {first}
    for edited in edits:
        module.write_text(edited)
        seen.add(code_sha256(["versioned_pkg.numbers"]))
    assert len(seen) == len(edits) + 1


def test_a_missing_module_is_named(module):
    with pytest.raises(ModuleNotFoundError, match="not an importable module: fix the name"):
        code_sha256(["versioned_pkg.missing"])
