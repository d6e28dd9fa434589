"""The artifact's schema (cel_utils/pipeline/schema.py, its statistical sections in stats_schema.py) is the one contract
between runs and what reads them: every key read from an artifact is one it declares (mypy over the readers), every
file read goes through it, and version 1 is read in one migration."""
import ast
import json
import shutil
import subprocess
import sys
from dataclasses import fields
from pathlib import Path

import pytest

from cel_utils.config import RunConfig
from cel_utils.pipeline import schema, stats_schema
from cel_utils.pipeline.artifacts import from_json, missing_keys, read_artifact, write_json

REPO = Path(__file__).resolve().parents[1]
REFERENCE = REPO / "tests" / "fixtures" / "reference"  # version-1 artifacts, from before most sections existed
# The code that reads artifacts: the pages, the explorer, the transfer matrix, the grid's skip-existing, the CLI.
READERS = ["cel_utils/book", "cel_utils/explore", "cel_utils/pipeline", "cel_utils/grid", "cel_utils/cli.py"]


def _mypy(paths: list[str], cache: Path) -> list[str]:
    """mypy's reads of undeclared keys on ``paths`` (a TypedDict "has no key", or a key that is not a literal); the
    code's other type errors are not this test's. What a run writes is checked against the schema when it is read
    (:func:`cel_utils.pipeline.artifacts.from_json`: every test that reads a fresh run's artifact)."""
    if shutil.which("mypy") is None and subprocess.run([sys.executable, "-m", "mypy", "--version"],
                                                       capture_output=True).returncode != 0:
        pytest.fail("mypy is not installed: `make test` installs it (pyproject.toml's dependencies)")
    done = subprocess.run([sys.executable, "-m", "mypy", "--cache-dir", str(cache), "--no-error-summary", *paths],
                          cwd=REPO, capture_output=True, text=True, timeout=600)
    return [line for line in done.stdout.splitlines()
            if ("has no key" in line and line.endswith("[typeddict-item]")) or line.endswith("[literal-required]")]


def test_every_read_of_an_artifact_is_a_key_its_schema_declares(tmp_path):
    assert _mypy(READERS, tmp_path / "cache") == []
    # The check can fail: a reader that misspells a key, or reads one the schema lacks, is reported.
    probe = REPO / "cel_utils" / "book" / "_schema_probe.py"
    probe.write_text("from cel_utils.pipeline.schema import RunArtifact\n\n\n"
                     "def gain(artifact: RunArtifact) -> object:\n"
                     "    control = artifact['contrl']\n"
                     "    return artifact['holdout']['gain_point'], control\n")
    try:
        errors = _mypy([str(probe.relative_to(REPO))], tmp_path / "cache")
    finally:
        probe.unlink()
    assert len(errors) == 2 and '"contrl"' in errors[0] and '"gain_point"' in errors[1], errors


# Keys read with a literal .get() from dicts that are not artifacts: a notebook's and the table of contents' metadata,
# Sphinx's page context, the environment, the run info beside an artifact (its timings), and the model source (whose
# keys differ by the kind of weights, so the schema keeps it a plain dict).
NOT_ARTIFACT_KEYS = {
    "cel_utils/book/build.py": {"papermill", "kernelspec", "chapters", "parts", "tags", "sections", "language"},
    "cel_utils/book/key_results.py": {"tags"},
    "cel_utils/book/offline.py": {"script_files", "body"},
    "cel_utils/grid/executors.py": {"CUDA_VISIBLE_DEVICES"},
    "cel_utils/cli.py": {"cuda"},
    "cel_utils/book/run_page.py": {"gguf", "search_s", "holdout_s", "reliability_s"},
}


def test_every_key_read_with_get_is_declared():
    """mypy checks ``artifact["key"]`` but lets ``.get("key")`` through: here every literal key a reader gets is one
    the schema declares (or a setting, or a key of a dict that is not an artifact, listed above)."""
    import typing

    declared = {f.name for f in fields(RunConfig)}
    for module in (schema, stats_schema):
        for name in dir(module):
            if typing.is_typeddict(getattr(module, name)):
                declared |= set(typing.get_type_hints(getattr(module, name)))
    unknown = []
    for path in _reader_files():
        allowed = declared | NOT_ARTIFACT_KEYS.get(str(path.relative_to(REPO)), set())
        for node in ast.walk(ast.parse(path.read_text())):
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "get"
                    and node.args and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str)
                    and node.args[0].value not in allowed):
                unknown.append(f"{path.relative_to(REPO)}:{node.lineno}: .get({node.args[0].value!r})")
    assert unknown == []


def _reader_files() -> list[Path]:
    return [p for reader in READERS for p in ((REPO / reader).rglob("*.py") if (REPO / reader).is_dir()
                                              else [REPO / reader])]


def test_settings_read_from_an_artifact_are_run_settings():
    """``artifact["config"]`` is dataclasses.asdict(RunConfig): a literal key read from it must be a RunConfig field
    (mypy cannot see this one: the section is a plain dict, declared once, in cel_utils/config.py)."""
    known = {f.name for f in fields(RunConfig)}
    unknown = []
    for path in _reader_files():
        for node in ast.walk(ast.parse(path.read_text())):
            if (isinstance(node, ast.Subscript) and isinstance(node.value, ast.Subscript)
                    and isinstance(node.value.slice, ast.Constant) and node.value.slice.value == "config"
                    and isinstance(node.slice, ast.Constant) and node.slice.value not in known):
                unknown.append(f"{path.relative_to(REPO)}:{node.lineno}: config[{node.slice.value!r}]")
    assert unknown == []


@pytest.mark.parametrize("fixture", sorted(REFERENCE.glob("*.json")), ids=lambda p: p.stem)
def test_a_version_1_artifact_is_read_in_todays_form(fixture, tmp_path):
    raw = json.loads(fixture.read_text())
    assert raw["schema_version"] == 1 and "control" not in raw  # from before the control existed
    artifact = read_artifact(fixture)
    assert artifact["schema_version"] == schema.SCHEMA_VERSION
    assert missing_keys(artifact, schema.RunArtifact) == []
    assert artifact["control"] is None and artifact["floors"] is None and artifact["config"]["ablation"] == "zero"
    assert artifact["reliability"]["verdict"] is None  # a part it never had: absent, not invented
    # what it had is unchanged, in its order; only absent parts were added
    for section, value in raw.items():
        if isinstance(value, dict) and section in ("config", "data", "holdout", "reliability"):
            assert {k: artifact[section][k] for k in value} == value and list(artifact[section])[:len(value)] == list(value)
        elif section != "schema_version":
            assert artifact[section] == value, section
    # read again after writing, it is the same: the migration is applied once
    assert read_artifact(write_json(tmp_path / fixture.name, artifact)) == artifact


def test_an_artifact_of_today_passes_through_unchanged_and_a_broken_one_names_what_it_lacks(tmp_path):
    from test_report import make_artifact

    artifact = make_artifact()
    assert from_json(json.loads(json.dumps(artifact))) == artifact  # version 2: no migration
    assert from_json(dict(artifact, schema_version=1)) == artifact  # a complete version 1: only its number
    broken = {k: v for k, v in artifact.items() if k != "frozen"}
    broken["holdout"] = {k: v for k, v in artifact["holdout"].items() if k != "heads_label"}
    with pytest.raises(ValueError, match=r"lacks frozen, holdout\.heads_label"):
        from_json(broken, "x.json")
    with pytest.raises(ValueError, match="schema_version 99, this cel_utils reads 2"):
        from_json(dict(artifact, schema_version=99), "x.json")


def test_the_results_page_reads_version_1_artifacts():
    from cel_utils.book import baselines, key_results, results_page
    from cel_utils.pipeline.artifacts import load_artifacts

    artifacts = load_artifacts(REFERENCE)
    page = results_page.results_markdown(artifacts, [], None)
    verdicts = page[page.index("## Verdicts"):page.index("## Beyond the task")]
    rows = [line for line in verdicts.splitlines() if line.startswith("| random-llama-tiny")]
    assert len(rows) == len(artifacts) == 4
    for artifact in artifacts:
        assert key_results.key_result(artifact).startswith("```{admonition} Key result")
        assert baselines.control_sentence(artifact) == "" and baselines.floor_rows(artifact) == []


def test_the_stored_paired_test_is_the_one_the_statistics_write():
    """stats_schema.PairedTest is the JSON type of stats.significance.PairedTest.to_json(): the same keys, so a field
    added to one and not the other fails here rather than in a reader."""
    import numpy as np

    from cel_utils.stats.significance import paired_test

    rng = np.random.default_rng(0)
    written = paired_test(rng.random(40) < 0.5, rng.random(40) < 0.6, n_resamples=50).to_json()
    assert set(written) == set(stats_schema.PairedTest.__annotations__)
    assert stats_schema.PairedTest.__required_keys__ == frozenset(written)
