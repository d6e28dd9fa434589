"""The README and the book's pages say what the code does: the cpu preset's table matches the preset, every command
they give in a code block is one the code accepts, every file and heading they link to exists, the README stays short
and its screenshot small, every glossary term a page links to is defined, and the reading group's exercises use the
book's seed and compute what they say from artifacts in the format runs write."""
import ast
import importlib.util
import json
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
README = REPO / "README.md"
SPEED = REPO / "book" / "speed.md"
READING_GROUP = REPO / "book" / "reading_group.md"
GLOSSARY = REPO / "book" / "glossary.md"
DOCS = (README, SPEED)
REFERENCE = REPO / "tests" / "fixtures" / "reference"  # artifacts of tiny random models, in the format runs write
README_MAX_WORDS = 1800  # a newcomer's first two minutes


def test_speed_page_cpu_tables_match_the_cpu_preset_for_each_book_model():
    from cel_utils.book.facts import random_sets_text
    from cel_utils.config import BOOK_MODELS, RunConfig
    from cel_utils.presets import default_tasks
    from cel_utils.tasks.catalog import get_task

    page = SPEED.read_text()
    rows = [line.strip("|").split("|") for line in page.splitlines()
            if line.startswith("| ") and line.split("|")[1].strip() in default_tasks("cpu")]
    tasks = list(default_tasks("cpu"))
    # one table per book model, in BOOK_MODELS' order, each listing the default tasks
    assert [row[0].strip() for row in rows] == tasks * len(BOOK_MODELS)
    for i, (task, *cells) in enumerate(rows):
        c = RunConfig.from_dict({"task": task.strip(), "preset": "cpu", "model": BOOK_MODELS[i // len(tasks)]})
        fewshot = c.num_fewshot if c.num_fewshot is not None else get_task(c.task).default_fewshot
        expected = [fewshot, c.n_discovery, c.n_holdout, c.screen if c.stage1 == "screened" else "exact",
                    c.screen_keep if c.stage1 == "screened" else "all", c.p, c.k,
                    random_sets_text(c),
                    c.n_resamples,
                    c.max_new_tokens if c.task == "mbpp" else "-"]
        assert [cell.strip() for cell in cells] == [str(value) for value in expected], (c.model, task)


def code_block_commands(path: Path) -> list[list[str]]:
    """Each command of the page's ```bash blocks as argv: continuation lines joined, comments and leading
    environment assignments (``OMP_WAIT_POLICY=PASSIVE ...``) dropped."""
    commands = []
    for block in re.findall(r"^```bash\n(.*?)^```", path.read_text(), flags=re.S | re.M):
        for line in re.sub(r"\\\n\s*", " ", block).splitlines():
            argv = shlex.split(line, comments=True)
            while argv and re.fullmatch(r"[A-Z_]+=\S*", argv[0]):
                argv.pop(0)
            if argv:
                commands.append(argv)
    return commands


def declared_flags(script: Path) -> set[str]:
    """The ``--flags`` a benchmark script's argparse declares, read from its source (running it would load a model)."""
    calls = [node for node in ast.walk(ast.parse(script.read_text())) if isinstance(node, ast.Call)
             and isinstance(node.func, ast.Attribute) and node.func.attr == "add_argument"]
    return {arg.value for call in calls for arg in call.args
            if isinstance(arg, ast.Constant) and isinstance(arg.value, str) and arg.value.startswith("--")}


def check_command(argv: list[str]) -> None:
    """Fails unless the command names something that exists and only options it accepts."""
    from cel_utils.cli import parser

    program, *args = argv
    if program.endswith("python") and args[:2] == ["-m", "cel_utils"]:
        try:
            parser().parse_args(args[2:])
        except SystemExit as exit_:  # argparse has printed what it refused
            pytest.fail(f"`cel` refuses {shlex.join(argv)} (exit {exit_.code})")
    elif program.endswith("python") and args and args[0].startswith("benchmarks/"):
        script = REPO / args[0]
        assert script.is_file(), f"no such benchmark: {args[0]}"
        flags = {arg.split("=")[0] for arg in args[1:] if arg.startswith("--")}
        assert flags <= declared_flags(script), f"{args[0]} declares no {sorted(flags - declared_flags(script))}"
    elif program.endswith("python") and args and args[0] == "-c":
        for node in ast.walk(ast.parse(args[1])):  # a one-liner: what it imports must exist
            if isinstance(node, ast.ImportFrom):
                module = importlib.import_module(node.module)
                missing = [alias.name for alias in node.names if not hasattr(module, alias.name)]
                assert not missing, f"{node.module} has no {missing}"
    elif program.endswith("papermill"):
        import papermill

        notebook = REPO / args[0]
        assert notebook.is_file(), f"no such notebook: {args[0]}"
        given = {args[i + 1] for i, arg in enumerate(args) if arg == "-p"}
        assert given <= set(papermill.inspect_notebook(str(notebook))), f"{args[0]}: parameters {sorted(given)}"
    elif program == "make":
        targets = re.findall(r"^([\w-]+):", (REPO / "Makefile").read_text(), flags=re.M)
        assert set(args) <= set(targets), f"the Makefile has no target {sorted(set(args) - set(targets))}"
    else:
        pytest.fail(f"a command this test does not know how to check: {shlex.join(argv)}")


@pytest.mark.parametrize("page, at_least", [pytest.param(page, n, id=page.name)
                                             for page, n in ((README, 4), (SPEED, 4), (READING_GROUP, 2))])
def test_every_command_in_a_code_block_is_accepted(page, at_least):
    commands = code_block_commands(page)
    assert len(commands) >= at_least, f"{page.name}: expected its commands in ```bash blocks"
    for argv in commands:
        check_command(argv)


def github_anchor(heading: str) -> str:
    """The id GitHub gives a Markdown heading: lower case, punctuation dropped, spaces as hyphens."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().replace("`", "").lower())
    return text.replace(" ", "-")


def link_targets(page: Path) -> list[str]:
    """The targets of the page's Markdown links and images, outside code."""
    text = re.sub(r"^```.*?^```", "", page.read_text(), flags=re.S | re.M)
    text = re.sub(r"`[^`\n]*`", "", text)
    return re.findall(r"\]\(([^)\s]+)\)", text)


@pytest.mark.parametrize("page", DOCS, ids=lambda p: p.name)
def test_every_link_leads_to_a_file_and_heading_that_exist(page):
    local = [t for t in link_targets(page) if not re.match(r"[a-z]+:", t)]
    assert local, f"{page.name}: no relative links found"
    for target in local:
        name, _, anchor = target.partition("#")
        file = (page.parent / name).resolve() if name else page
        assert file.is_file(), f"{page.name} links to {name}, which does not exist"
        if anchor:
            headings = re.findall(r"^#+ (.+)$", file.read_text(), flags=re.M)
            assert anchor in {github_anchor(h) for h in headings}, f"{page.name}: no heading {target}"


def test_readme_screenshot_is_a_small_png():
    spec = importlib.util.spec_from_file_location("screenshot", REPO / "scripts" / "screenshot.py")
    screenshot = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(screenshot)
    images = re.findall(r"!\[[^\]]*\]\(([^)\s]+)\)", README.read_text())
    assert images, "the README shows the built book"
    for image in images:
        data = (REPO / image).read_bytes()
        assert data.startswith(b"\x89PNG\r\n\x1a\n"), image
        assert len(data) <= screenshot.MAX_BYTES, f"{image}: {len(data)} bytes; retake it with scripts/screenshot.py"


def test_readme_is_short():
    words = len(README.read_text().split())  # as `wc -w` counts
    assert words < README_MAX_WORDS, f"README.md has {words} words; keep it under {README_MAX_WORDS} and link the rest"


def glossary_terms() -> set[str]:
    """The terms the glossary defines (lower case, as Sphinx looks a term up): the unindented lines of its
    ``{glossary}`` block, several of which may share one definition."""
    block = re.search(r"^```\{glossary\}\n(.*?)^```", GLOSSARY.read_text(), flags=re.S | re.M)
    assert block, "book/glossary.md holds no {glossary} block"
    return {" ".join(line.split()).lower() for line in block.group(1).splitlines()
            if line.strip() and not line[0].isspace() and not line.startswith(":")}


def term_references() -> dict[str, list[str]]:
    """Every {term} role the book's pages use, from their sources: the committed pages, the code that writes the
    generated ones (where an f-string doubles the braces) and the notebooks. Maps each term looked up (the text, or
    the target in ``text <target>``, lower case) to where it is used; a term computed at build time is skipped."""
    sources = {path: path.read_text() for path in [*sorted((REPO / "book").glob("*.md")),
                                                   *sorted((REPO / "cel_utils" / "book").glob("*.py"))]}
    for notebook in sorted((REPO / "notebooks").glob("*.ipynb")):
        sources[notebook] = "\n".join("".join(cell["source"]) for cell in json.loads(notebook.read_text())["cells"])
    found: dict[str, list[str]] = {}
    for path, text in sources.items():
        for reference in re.findall(r"\{\{?term\}\}?`([^`]+)`", text):
            target = re.fullmatch(r"(?s).*<([^<>]+)>\s*", reference)
            term = " ".join((target.group(1) if target else reference).split()).lower()
            if "{" not in term:
                found.setdefault(term, []).append(path.relative_to(REPO).as_posix())
    return found


def test_every_term_a_page_links_to_has_a_glossary_entry():
    terms, references = glossary_terms(), term_references()
    assert len(references) >= 10, "expected the pages to link their terms to the glossary with {term}"
    missing = {term: sorted(set(where)) for term, where in references.items() if term not in terms}
    assert not missing, f"{{term}} links with no entry in book/glossary.md: {missing}"


def test_reading_group_uses_the_books_seed():
    from cel_utils.presets import BOOK_SEED

    page = READING_GROUP.read_text()
    seeds = [int(s) for s in re.findall(r"__seed(\d+)\.json", page) + re.findall(r"--seeds (\d+)", page)
             + re.findall(r"BOOK_SEED`, (\d+)", page)]
    assert seeds and set(seeds) == {BOOK_SEED}, (f"the reading group names seeds {sorted(set(seeds))}; the book's is "
                                                 f"{BOOK_SEED}")


def python_blocks(page: Path) -> list[str]:
    return re.findall(r"^```python\n(.*?)^```", page.read_text(), flags=re.S | re.M)


@pytest.fixture
def book_results(tmp_path):
    """A folder laid out as after `make book` (results/<model>__<task>__seed<BOOK_SEED>.json for each book model and
    task), filled with the reference artifacts renamed, each with its own p-value so that Holm's order matters; the
    exercise-3 run's artifact under scratch/."""
    from cel_utils.config import BOOK_MODELS, BOOK_SEED

    (tmp_path / "results").mkdir()
    p_values = iter([0.001, 0.004, 0.03, 0.012, 0.2, 0.04, 0.9, 0.5])
    for model in BOOK_MODELS:
        for fixture in sorted(REFERENCE.glob("*.json")):
            artifact = json.loads(fixture.read_text())
            task = artifact["task"]["name"]
            artifact["model"]["name"], artifact["config"]["seed"] = model, BOOK_SEED
            artifact["reliability"]["significance"]["p_value"] = next(p_values)
            (tmp_path / "results" / f"{model}__{task}__seed{BOOK_SEED}.json").write_text(json.dumps(artifact))
    scratch = tmp_path / "scratch" / "k-default"
    scratch.mkdir(parents=True)
    (scratch / f"{BOOK_MODELS[0]}__boolq__seed{BOOK_SEED}.json").write_text(
        (tmp_path / "results" / f"{BOOK_MODELS[0]}__boolq__seed{BOOK_SEED}.json").read_text())
    return tmp_path


def run_block(code: str, cwd: Path) -> str:
    done = subprocess.run([sys.executable, "-c", code], cwd=cwd, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, f"the exercise's code failed:\n{code}\n{done.stderr}"
    return done.stdout


def test_reading_group_solutions_compute_what_they_say_from_the_artifacts(book_results):
    from cel_utils.config import BOOK_MODELS, BOOK_SEED
    from cel_utils.stats.multiplicity import holm

    blocks = python_blocks(READING_GROUP)
    k_choice, = [b for b in blocks if "scratch/" in b]
    adjust, = [b for b in blocks if "Holm" in b]
    shares, = [b for b in blocks if "full_predictions" in b]
    boolq = json.loads((book_results / "results" / f"{BOOK_MODELS[0]}__boolq__seed{BOOK_SEED}.json").read_text())

    assert run_block(k_choice, book_results).split() == [boolq["pool"][0], *boolq["frozen"]["label"].split()]

    rows = re.findall(r"^(.+?)\s+p = (\S+)\s+Holm-adjusted p = (\S+)$", run_block(adjust, book_results), flags=re.M)
    assert len(rows) == len(BOOK_MODELS) * len(list(REFERENCE.glob("*.json")))
    expected = holm([float(raw) for _, raw, _ in rows])  # the book's own adjustment of the printed raw p-values
    assert [float(adjusted) for _, _, adjusted in rows] == [float(f"{p:.2g}") for p in expected]
    assert len({adjusted for _, _, adjusted in rows}) > 2  # the p-values were adjusted, not all capped at 1

    out = run_block(shares, book_results)
    held = boolq["holdout"]
    full, ablated, right = held["full_predictions"], held["ablated_predictions"], held["full_correct"]
    n, to_yes = len(full), sum(f == 0 and a == 1 for f, a in zip(full, ablated))
    changed = held["help"] + held["harm"]  # two answers: a changed answer is a changed outcome
    gold_yes = sum((f == 1) == bool(r) for f, r in zip(full, right))  # said yes and right, or said no and wrong
    assert re.search(rf"{changed} answers changed: {to_yes} no -> yes, {changed - to_yes} yes -> no", out), out
    assert f"gold     'yes' on {gold_yes / n:.1%} of {n} items" in out, out
    assert f"ablated  'yes' on {sum(ablated) / n:.1%}" in out, out
    assert f"always 'yes' scores {gold_yes / n:.1%}, always 'no' {1 - gold_yes / n:.1%}" in out, out
