"""The README and the book's speed page say what the code does: the cpu preset's table matches the preset, every
command they give in a code block is one the code accepts, every file and heading they link to exists, and the
README's screenshot stays small."""
import ast
import importlib.util
import re
import shlex
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
README = REPO / "README.md"
SPEED = REPO / "book" / "speed.md"
DOCS = (README, SPEED)


def test_speed_page_cpu_tables_match_the_cpu_preset_for_each_book_model():
    from cel_utils.book.facts import random_sets_text
    from cel_utils.config import BOOK_MODELS, RunConfig, default_tasks
    from cel_utils.tasks.specs import get_task

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


@pytest.mark.parametrize("page", DOCS, ids=lambda p: p.name)
def test_every_command_in_a_code_block_is_accepted(page):
    commands = code_block_commands(page)
    assert len(commands) >= 4, f"{page.name}: expected its commands in ```bash blocks"
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
