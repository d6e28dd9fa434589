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


def test_readme_cpu_table_matches_the_cpu_preset():
    from cel_utils.book.facts import random_sets_text
    from cel_utils.config import RunConfig, default_tasks
    from cel_utils.tasks.specs import get_task

    readme = (REPO / "README.md").read_text()
    rows = [line.strip("|").split("|") for line in readme.splitlines()
            if line.startswith("| ") and line.split("|")[1].strip() in default_tasks("cpu")]
    assert [row[0].strip() for row in rows] == list(default_tasks("cpu"))
    for task, *cells in rows:
        c = RunConfig.from_dict({"task": task.strip(), "preset": "cpu"})
        fewshot = c.num_fewshot if c.num_fewshot is not None else get_task(c.task).default_fewshot
        expected = [fewshot, c.n_discovery, c.n_holdout, c.screen if c.stage1 == "screened" else "exact",
                    c.screen_keep if c.stage1 == "screened" else "all", c.p, c.k,
                    random_sets_text(c),
                    c.n_resamples,
                    c.max_new_tokens if c.task == "mbpp" else "-"]
        assert [cell.strip() for cell in cells] == [str(value) for value in expected], task
