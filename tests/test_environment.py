"""environment.yml (conda) and pyproject.toml (pip) describe the same environment."""
import re
from pathlib import Path

import tomllib
import yaml

REPO = Path(__file__).resolve().parents[1]


def _normalise(requirement: str) -> str:
    return re.sub(r"\s+", "", requirement).lower().replace("_", "-")


def test_conda_pip_section_matches_pyproject():
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    env = yaml.safe_load((REPO / "environment.yml").read_text())
    pip_section = next(item["pip"] for item in env["dependencies"] if isinstance(item, dict))
    assert "-e ." in pip_section, "the conda environment must install the package itself"
    listed = {_normalise(r) for r in pip_section if r != "-e ."}
    assert listed == {_normalise(r) for r in project["dependencies"]}


def test_python_version_agrees():
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    env = yaml.safe_load((REPO / "environment.yml").read_text())
    python = next(d for d in env["dependencies"] if isinstance(d, str) and d.startswith("python="))
    major, minor = map(int, python.removeprefix("python=").split(".")[:2])
    low = tuple(map(int, project["requires-python"].removeprefix(">=").split(".")))
    assert (major, minor) >= low


def test_torch_is_a_range_and_the_makefile_installs_one_exact_build_first():
    # a pin in the package would replace a cluster's own torch; the Makefile's default is this machine's CPU wheel
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    assert "torch>=2.5" in project["dependencies"]
    makefile = (REPO / "Makefile").read_text()
    assert "TORCH ?= torch==2.13.0" in makefile
    assert makefile.index('pip install --quiet "$(TORCH)"') < makefile.index("pip install --quiet -e .")
    assert "jupyter-book>=1.0,<2" in project["dependencies"]  # 2.x downloads its theme at build time

