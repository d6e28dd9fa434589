"""The book end to end, in a temporary copy: the theory notebooks (small parameters) and `python -m cel_utils main` on a
tiny grid, then the built HTML, checked as files and (marked `browser`) in headless Chromium with no network: offline,
and served from a sub-path as GitHub Pages serves a project site. Also: the book with no runs at all, and publishing."""
import functools
import html
import http.server
import os
import re
import shutil
import subprocess
import sys
import threading
from pathlib import Path

import papermill
import pytest
import yaml
import nbformat
from browser import browser_or_unavailable, click_heatmap_cell, opened, unavailable, visit

from cel_utils.book.build import THEORY_NOTEBOOKS, BookPaths, execute_theory, toc_dict
from cel_utils.cli import main, parser
from cel_utils.config import BOOK_MODELS, BOOK_SEED, DEFAULT_MODEL, RunConfig
from cel_utils.models.heads import parse_head
from cel_utils.pipeline.artifacts import read_artifact

REPO = Path(__file__).resolve().parents[1]
MIRROR = Path(os.environ.get("CEL_DATA_DIR") or REPO.parent / "shared" / "data")
DATA_DIR = str(MIRROR) if MIRROR.is_dir() else None
RUN = f"random-llama-tiny__arithmetic_2da__seed{BOOK_SEED}"  # `main` draws with the book's seed
PAGES = {"results": "book/results.html", "run": f"book/runs/{RUN}.html",
         "derivation": "book/theory/theory_derivation.html", "simulation": "book/theory/theory_simulation.html",
         "reading group": "book/reading_group.html"}
TCP_WARNING = "Kernel is running over TCP without encryption"


def book_root(root: Path) -> Path:
    """A book root with the committed pages and configuration, and no runs."""
    for name in ("_config.yml", "_toc.yml"):
        shutil.copy(REPO / name, root / name)
    shutil.copytree(REPO / "_static", root / "_static")
    shutil.copytree(REPO / "book", root / "book", ignore=shutil.ignore_patterns("runs", "theory", "strategies",
                                                                               "results.md"))
    shutil.copytree(REPO / "data", root / "data")
    return root


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """A small book: the committed pages, one tiny run, both theory notebooks executed with small parameters."""
    root = book_root(tmp_path_factory.mktemp("book"))
    theory = root / "book" / "theory"
    theory.mkdir()
    small = {"theory_derivation": {}, "theory_simulation": {"seeds": 300, "steps": 2000}}
    for name, parameters in small.items():
        papermill.execute_notebook(str(REPO / "notebooks" / f"{name}.ipynb"), str(theory / f"{name}.ipynb"),
                                   parameters=parameters, progress_bar=False, cwd=str(root))
    # A second task's artifact, run in this process (no notebook, no page: cheaper than a second cell), so that `main`'s
    # transfer step has a matrix to compute over the model's two tasks and the results page a heat map to show.
    from cel_utils.pipeline.protocol import run_cel

    run_cel(RunConfig.from_dict({"model": "random:llama:tiny", "task": "arithmetic_1dc", "seed": BOOK_SEED,
                                 "preset": "smoke", "engine": "naive", "data_dir": DATA_DIR,
                                 "results_dir": str(root / "results")}), progress=False)
    args = ["main", "--root", str(root), "--models", "random:llama:tiny", "--tasks", "arithmetic_2da",
            "--preset", "smoke", "--engine", "naive", "--theory", "skip"] + (["--data-dir", DATA_DIR] if DATA_DIR else [])
    assert main(args) == 0
    return root / "_build" / "html"


def text_of(fragment: str) -> str:
    """The visible text of an HTML fragment, whitespace collapsed."""
    fragment = re.sub(r"<(script|style)\b.*?</\1>", "", fragment, flags=re.S)
    return " ".join(html.unescape(re.sub(r"<[^>]+>", " ", fragment)).split())


def test_book_builds_with_warnings_as_errors(built):
    assert (built / "index.html").exists()
    assert not (built.parent / ".jupyter_cache").exists()  # the book executed nothing: runs are rendered as they are
    results = (built / "book" / "results.html").read_text()
    assert f'href="runs/{RUN}.html"' in results
    run_page = (built / "book" / "runs" / f"{RUN}.html").read_text()
    assert f"<title>CEL run: random-llama-tiny on arithmetic_2da (seed {BOOK_SEED})" in run_page
    # every run at once, and the transfer matrix's heat map
    assert results.count('class="plotly-graph-div"') == 2 and "Beyond the task: the transfer matrix" in results
    assert "Key result" in run_page and "Holm p" in run_page  # the box build puts on top, with the run's family
    assert 'href="results.html#transfer-matrix"' in (built / "book" / "theory.html").read_text()
    sidebar = (built / "book" / "intro.html").read_text()
    assert f"random-llama-tiny on arithmetic_2da (seed {BOOK_SEED})" in sidebar  # found by the toc's glob, titled by the page
    for page in ("reading_group", "related", "glossary", "theory/theory_derivation", "theory/theory_simulation"):
        assert f'href="{page}.html"' in sidebar, page


def test_results_page_shows_the_papers_twelve_cells(built):
    page = text_of((built / "book" / "results.html").read_text())
    section = page[page.index("The paper’s Table 1"):]
    assert len(re.findall(r"\d+\.\d\d -> \d+\.\d\d \(\+\d+\.\d\d\), \d+\.\d\d%", section)) == 12
    assert "70.40 -> 83.50 (+13.10), 44.26%" in section and "75.75 -> 77.05 (+1.29), 5.32%*" in section


def test_prose_numbers_come_from_the_data_and_the_code(built):
    from cel_utils.book.facts import book_facts

    facts = book_facts(REPO)
    intro = text_of((built / "book" / "intro.html").read_text())
    assert f"from {facts['paper_best_full']}% to {facts['paper_best_ablated']}%" in intro and "{{" not in intro
    for preset in ("paper", "cpu"):  # `main` with no model named, on a GPU and on a CPU: the models the intro names
        assert parser().parse_args(["main", "--preset", preset]).models == list(BOOK_MODELS)
    assert BOOK_MODELS == (DEFAULT_MODEL, "gemma3-270m")
    assert (f"by default on two models small enough for a laptop, from two families: {DEFAULT_MODEL} "
            in intro.lower()) and " and gemma 3 270m (" in intro.lower()
    beyond = text_of((built / "book" / "beyond.html").read_text())
    assert f"the cpu preset {facts['cpu_random_sets']} random sets and {facts['cpu_resamples']} resamples" in beyond
    method = text_of((built / "book" / "method.html").read_text())
    cpu = RunConfig.from_dict({"task": "boolq", "preset": "cpu"})
    assert f"cpu boolq {cpu.n_discovery:,} {cpu.n_holdout:,} {cpu.p} {cpu.k}" in method and "{{" not in method
    simulation = text_of((built / "book" / "theory" / "theory_simulation.html").read_text())
    assert re.search(r"carried by one head in \d+\.\d ?% of the seeds", simulation)  # computed, not typed
    assert "about 95%" not in simulation
    derivation = text_of((built / "book" / "theory" / "theory_derivation.html").read_text())
    assert "Thm 4.3 after deleting the U-only head, R_A -> 0" in derivation


def toc_pages(built: Path) -> list[str]:
    """The HTML file of every page the table of contents lists, as the book's toc expands it (runs included)."""
    def files(entries: list[dict]) -> list[str]:
        return [name for e in entries
                for name in ([e["file"]] if "file" in e else []) + files(e.get("chapters", []) + e.get("sections", []))]

    toc = toc_dict(BookPaths(root=built.parent.parent))
    return [name.removesuffix(".ipynb").removesuffix(".md") + ".html" for name in [toc["root"], *files(toc["parts"])]]


def test_published_pages_carry_no_path_of_the_machine_that_built_them(built):
    """Not the book root the run wrote its artifacts under, the checkout, the data mirror or the home folder: in no
    page, and in no notebook shipped for download (_sources/); the run's own settings are still shown."""
    machine = [str(built.parent.parent), str(REPO), str(Path.home()), *([DATA_DIR] if DATA_DIR else [])]
    found = {}
    for path in built.rglob("*"):
        if path.is_file() and "_static" not in path.relative_to(built).parts:
            text = path.read_text(errors="replace")
            hits = [place for place in machine if place in text]
            if hits:
                found[path.relative_to(built).as_posix()] = hits
    assert not found, found
    run_page = "".join(text_of((built / PAGES["run"]).read_text()).split())  # highlighted code: tokens apart
    assert f'model="random:llama:tiny"task="arithmetic_2da"seed={BOOK_SEED}preset="smoke"config={{"engine":"naive"}}' in run_page
    shipped = nbformat.read(built / "_sources" / "book" / "runs" / f"{RUN}.ipynb", as_version=4)
    assert shipped.metadata.papermill.parameters["config"] == {"engine": "naive"}


def test_publishable_keeps_the_runs_settings_in_order_and_drops_the_machines_paths(tmp_path):
    from papermill.translators import translate_parameters

    from cel_utils.book.build import publishable

    page, checkout = tmp_path / "book" / "runs" / "m__t__seed0.ipynb", tmp_path.parent / "elsewhere" / "checkout"
    parameters = {"model": "m", "task": "t", "seed": 0, "config": {"p": 3, "results_dir": str(tmp_path / "results"),
                                                                   "data_dir": "/mirror/data"}}
    injected = nbformat.v4.new_code_cell(translate_parameters("python3", "python", parameters, "Parameters"),
                                         metadata={"tags": ["injected-parameters"]})
    notebook = nbformat.v4.new_notebook(cells=[injected], metadata={
        "kernelspec": {"name": "python3", "language": "python", "display_name": "Python 3"},
        "papermill": {"input_path": str(checkout / "notebooks" / "cel_run.ipynb"), "output_path": str(page),
                      "parameters": parameters}})
    page.parent.mkdir(parents=True)
    nbformat.write(notebook, page)
    assert publishable(page, tmp_path)
    shown = nbformat.read(page, as_version=4)
    assert shown.cells[0].source.splitlines()[1:] == ['model = "m"', 'task = "t"', "seed = 0", 'config = {"p": 3}']
    assert shown.metadata.papermill.parameters == {"model": "m", "task": "t", "seed": 0, "config": {"p": 3}}
    assert (shown.metadata.papermill.input_path, shown.metadata.papermill.output_path) == (
        "cel_run.ipynb", "book/runs/m__t__seed0.ipynb")  # outside the book: the name only; inside: from its root
    assert not publishable(page, tmp_path)  # already published: unchanged


def test_theory_notebooks_run_without_the_unencrypted_kernel_warning(tmp_path, capfd):
    """`make book` executes the theory notebooks through execute_theory; the kernel it starts must not warn that its
    traffic is unencrypted (the run notebooks' kernels already do not: cel_utils.grid.kernel)."""
    notebooks = tmp_path / "notebooks"
    notebooks.mkdir()
    notebook = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell("1 + 1")],
                                        metadata={"kernelspec": {"name": "python3", "language": "python",
                                                                 "display_name": "Python 3"}})
    for name in THEORY_NOTEBOOKS:
        nbformat.write(notebook, notebooks / f"{name}.ipynb")
    papermill.execute_notebook(str(notebooks / f"{THEORY_NOTEBOOKS[0]}.ipynb"), str(tmp_path / "plain.ipynb"),
                               progress_bar=False)
    if TCP_WARNING not in capfd.readouterr().err:  # papermill's defaults: the warning this test is about
        pytest.skip("this ipykernel does not warn about unencrypted TCP")
    result = execute_theory(BookPaths(root=tmp_path), "run")
    assert result.executed == list(THEORY_NOTEBOOKS) and not result.failed, result
    assert TCP_WARNING not in capfd.readouterr().err


def test_site_references_nothing_outside_itself(built):
    outside = {}
    for page in built.rglob("*.html"):
        found = re.findall(r'<(?:script|link|img|iframe)\b[^>]*\b(?:src|href)="((?:https?:)?//[^"]+)"', page.read_text())
        if found:
            outside[page.relative_to(built).as_posix()] = found
    assert not outside
    assert (built / "_static" / "plotly" / "plotly.min.js").stat().st_size > 1_000_000
    assert (built / "_static" / "mathjax" / "tex-chtml.js").is_file()
    simulation = (built / "book" / "theory" / "theory_simulation.html").read_text()
    assert '_static/plotly/plotly.min.js' in simulation and '_static/mathjax/tex-chtml.js' in simulation
    assert '_static/plotly/plotly.min.js' not in (built / "book" / "method.html").read_text()  # only where needed


def test_a_book_with_no_runs_strategies_or_theory_builds(tmp_path):
    root = book_root(tmp_path)
    assert main(["book", "--root", str(root), "--theory", "skip"]) == 0
    intro = (root / "_build" / "html" / "book" / "intro.html").read_text()
    assert "No runs yet" in (root / "_build" / "html" / "book" / "results.html").read_text()
    assert "runs/" not in re.sub(r'href="(?!book/runs/)[^"]*"', "", intro)


def test_a_page_with_live_widgets_loads_nothing_from_a_cdn(tmp_path):
    """A run notebook executed with progress bars (tqdm draws ipywidgets when they are installed) stores its widgets'
    state; its page must still load nothing from outside the site (myst-nb's default fetches require.js and the widget
    manager from CDNs)."""
    root = book_root(tmp_path)
    bar = {"model_id": "0", "version_major": 2, "version_minor": 0}
    cell = nbformat.v4.new_code_cell("progress_bar", outputs=[nbformat.v4.new_output(
        "display_data", data={"application/vnd.jupyter.widget-view+json": bar, "text/plain": "stage 1: 100%"})])
    state = {"application/vnd.jupyter.widget-state+json": {"version_major": 2, "version_minor": 0, "state": {"0": {
        "model_name": "FloatProgressModel", "model_module": "@jupyter-widgets/controls", "model_module_version": "2.0.0",
        "state": {"value": 1.0, "max": 1.0}}}}}
    notebook = nbformat.v4.new_notebook(cells=[nbformat.v4.new_markdown_cell("# CEL run: widgets"), cell],
                                        metadata={"widgets": state, "kernelspec": {"name": "python3",
                                                  "language": "python", "display_name": "Python 3"}})
    (root / "book" / "runs").mkdir()
    nbformat.write(notebook, root / "book" / "runs" / "m__t__seed0.ipynb")
    assert main(["book", "--root", str(root), "--theory", "skip"]) == 0
    page = (root / "_build" / "html" / "book" / "runs" / "m__t__seed0.html").read_text()
    assert "application/vnd.jupyter.widget-state+json" in page  # the state is on the page: the case this is about
    assert not re.findall(r'<(?:script|link)\b[^>]*\b(?:src|href)="((?:https?:)?//[^"]+)"', page)


def test_publish_pushes_the_site_to_gh_pages_of_a_local_bare_repository(built, tmp_path):
    bare, work = tmp_path / "remote.git", tmp_path / "work"
    git = functools.partial(subprocess.run, check=True, capture_output=True, text=True)
    git(["git", "init", "--bare", "-q", str(bare)])
    git(["git", "init", "-q", str(work)])
    shutil.copytree(built, work / "_build" / "html")
    env = {**os.environ, "GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@example.org", "GIT_COMMITTER_NAME": "t",
           "GIT_COMMITTER_EMAIL": "t@example.org"}
    done = subprocess.run(["make", "-s", "-C", str(work), "-f", str(REPO / "Makefile"), "publish", f"REMOTE={bare}",
                           f"PY={sys.executable}"], capture_output=True, text=True, env=env)
    assert done.returncode == 0, done.stdout + done.stderr
    files = git(["git", "--git-dir", str(bare), "ls-tree", "-r", "--name-only", "gh-pages"]).stdout.split()
    assert {"index.html", ".nojekyll", "_static/plotly/plotly.min.js", f"book/runs/{RUN}.html"} <= set(files)
    again = subprocess.run(["make", "-s", "-C", str(work), "-f", str(REPO / "Makefile"), "publish", f"REMOTE={bare}",
                            f"PY={sys.executable}"], capture_output=True, text=True, env=env)
    assert again.returncode == 0, again.stderr  # publishing again replaces the branch
    assert git(["git", "--git-dir", str(bare), "rev-list", "--count", "gh-pages"]).stdout.strip() == "1"
    missing = subprocess.run(["make", "-s", "-C", str(work), "-f", str(REPO / "Makefile"), "publish",
                              f"PY={sys.executable}"], capture_output=True, text=True, env=env)
    assert missing.returncode != 0 and "REMOTE=" in missing.stderr


def test_pages_workflow_builds_the_book_and_deploys_it():
    workflow = yaml.safe_load((REPO / ".github" / "workflows" / "pages.yml").read_text())
    build, deploy = workflow["jobs"]["build"], workflow["jobs"]["deploy"]
    commands = " ".join(step.get("run", "") for step in build["steps"])
    assert "cel_utils main" in commands
    uses = [step.get("uses", "") for step in build["steps"]] + [step.get("uses", "") for step in deploy["steps"]]
    assert any(u.startswith("actions/upload-pages-artifact") for u in uses)
    assert any(u.startswith("actions/deploy-pages") for u in uses) and deploy["needs"] == "build"
    upload = next(s for s in build["steps"] if s.get("uses", "").startswith("actions/upload-pages-artifact"))
    assert upload["with"]["path"] == "_build/html"
    assert workflow["permissions"]["pages"] == "write" and workflow["permissions"]["id-token"] == "write"


# --- in a browser, with no network -------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def browser():
    """Headless Chromium; missing or failing to start, a failure in CI and a skip elsewhere (browser.unavailable)."""
    with browser_or_unavailable() as chromium:
        yield chromium


def test_a_browser_that_cannot_run_fails_in_ci_and_skips_elsewhere(tmp_path):
    for env in ({"CI": "true"}, {"CI": "1"}):
        with pytest.raises(pytest.fail.Exception, match="no browser here.*CI is set"):
            unavailable("no browser here", env)
    for env in ({}, {"CI": ""}, {"CI": "false"}):
        with pytest.raises(pytest.skip.Exception, match="no browser here"):
            unavailable("no browser here", env)
    with pytest.raises(pytest.fail.Exception, match="needs headless Chromium"):  # not installed
        with browser_or_unavailable(executable=None, env={"CI": "true"}):
            pass
    for broken in (str(tmp_path / "no-such-chromium"), shutil.which("false")):  # not there; exits before its port opens
        with pytest.raises(pytest.fail.Exception, match="did not start"):
            with browser_or_unavailable(executable=broken, env={"CI": "true"}):
                pass
        with pytest.raises(pytest.skip.Exception, match="did not start"):
            with browser_or_unavailable(executable=broken, env={}):
                pass


def report_line(name: str, report) -> str:
    p = report.probe
    return (f"{name:14s} math {p['math_rendered']}/{p['math_source']} typeset, figures {p['figures_drawn'] and p['figures']}"
            f"/{p['figures']} drawn, console errors {len(report.console_errors)}, failed requests "
            f"{len(report.failed_requests)}, requests off the site {len(report.offsite('file://'))}")


@pytest.mark.browser
def test_offline_pages_render_math_and_figures_without_errors(browser, built):  # no browser: no book built
    """Every page of the table of contents (runs included), opened offline: no errors, every formula typeset as
    written and no TeX left as text; the pages in PAGES also show what they are for."""
    pages = toc_pages(built)
    assert set(PAGES.values()) <= set(pages), sorted(set(PAGES.values()) - set(pages))
    names = {page: name for name, page in PAGES.items()}
    lines, broken = [], {}
    for page in pages:
        name = names.get(page, page.removeprefix("book/").removesuffix(".html"))
        report = visit(browser, (built / page).as_uri(), hover_heatmap=(name in ("run", "results")))
        lines.append(report_line(name, report))
        problems = report.math_problems() + report.console_errors + report.failed_requests + report.offsite("file://")
        problems += [f"image not loaded: {src}" for src, ok in report.probe["images"] if not ok]
        if problems:
            broken[page] = problems
            continue
        if name in ("derivation", "simulation"):
            assert report.probe["math_rendered"] > 20, name  # MathJax typeset the page's formulas
        if name in ("run", "simulation"):
            assert report.probe["figures"] == 1 and report.probe["figures_drawn"] >= 1, name  # plotly drew its SVG
        if name == "run":
            hover = report.extra["hover"]
            assert re.search(r"L\d+\.H\d+discovery gain [+-]\d+\.\d\d pointsharm \d+, help \d+", hover), hover
        if name == "results":
            assert "70.40 -> 83.50 (+13.10), 44.26%" in text_of((built / page).read_text())
            # every run at once, then the transfer heat map
            assert report.probe["figures"] == 2 and report.probe["figures_drawn"] >= 2
            hover = report.extra["hover"]  # its best cell: the interval, the p-value and the counts
            assert re.search(r"set from \w+ \(L\d+\.H\d+.*\) on \w+.*95% CI \[[+-]\d+\.\d, [+-]\d+\.\d\], McNemar "
                             r"p [=<] [\d.]+ alone.*helped \d+, harmed \d+ of \d+", hover), hover
    assert not broken, broken
    print("\noffline browser check (headless Chromium, no network):\n" + "\n".join(lines))


class _Quiet(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *args):
        pass


@pytest.mark.browser
def test_site_served_from_a_sub_path_loads_every_page_and_asset(browser, built, tmp_path):
    """GitHub Pages serves a project site under /<repo>/: every page, and everything each page loads, must resolve."""
    served = tmp_path / "www"
    served.mkdir()
    (served / "cel-book").symlink_to(built, target_is_directory=True)
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(_Quiet, directory=str(served)))
    threading.Thread(target=server.serve_forever, daemon=True).start()
    base = f"http://127.0.0.1:{server.server_address[1]}/cel-book/"
    try:
        pages = sorted(p.relative_to(built).as_posix() for p in built.rglob("*.html")
                       if not p.relative_to(built).as_posix().startswith(("_static/", "_sources/")))
        loaded, broken = 0, {}
        for page in pages:
            report = visit(browser, base + page)
            if page == "index.html":  # a redirect: the probe reads where it leads, never the document it replaces
                assert report.landed == base + "book/intro.html", report.landed
            loaded += len(report.requests)
            problems = report.failed_requests + report.console_errors + report.offsite(base)
            problems += [link for link in report.probe["links"] if link.startswith(f"http://127.0.0.1:{server.server_address[1]}/")
                         and not link.startswith(base)]  # a link that escapes the sub-path
            if problems:
                broken[page] = problems
        assert not broken, broken
        assert "book/results.html" in pages and f"book/runs/{RUN}.html" in pages and loaded > 10 * len(pages)
        print(f"\nserved under /cel-book/: {len(pages)} pages, {loaded} requests, none failed")
    finally:
        server.shutdown()


def listed_flips(page, which: int) -> tuple[str, list[list[str]]]:
    """The title line and the rows (each cell's text) of the ``which``-th flip list on the page."""
    shown = page.locator(".cel-flips-list").nth(which)
    shown.locator(".cel-flips-title").wait_for()
    return (shown.locator(".cel-flips-title").text_content(),
            [row.locator("td").all_text_contents() for row in shown.locator("tbody tr").all()])


def expected_flips(artifact: dict, name: str) -> tuple[str, list[list[str]]]:
    """What a click on the set ``name`` must list, read from the artifact."""
    flips, n_items = artifact["discovery_flips"], len(artifact["discovery"]["item_ids"])
    chosen = flips["sets"][name]

    def answer(item, index, right):
        return ("right" if right else "wrong") if item["answers"] is None else item["answers"][index]

    rows = [[label, item["item"], item["prompt_end"], item["gold"], answer(item, item["full"], direction == "harm"),
             answer(item, index, direction == "help")]
            for direction, label in (("help", "wrong -> right"), ("harm", "right -> wrong"))
            for item, index in ((flips["items"][i], index) for i, index in chosen[direction].items())]
    together = "ablated together" if "+" in name else "ablated alone"
    return (f"{name}: helped {len(chosen['help'])}, harmed {len(chosen['harm'])} of the {n_items} discovery items "
            f"({together}).", rows)


def click_through(browser, url: str, artifact: dict) -> dict:
    """Click the head of the stage-1 heat map that flipped most items, then the stage-2 row of the set with two or more
    heads that flipped most; returns what each listed and what the page logged."""
    sets = artifact["discovery_flips"]["sets"]
    flipped = lambda name: len(sets[name]["help"]) + len(sets[name]["harm"])  # noqa: E731
    head = max((s["heads"][0] for s in artifact["stage1"] if len(s["heads"]) == 1), key=flipped)
    pair = max(("+".join(s["heads"]) for s in artifact["stage2"][:10] if len(s["heads"]) > 1), key=flipped)
    with opened(browser, url) as page:
        click_heatmap_cell(page, parse_head(head).layer, parse_head(head).head)
        by_head = listed_flips(page, 0)
        page.locator("table.dataframe tbody tr", has=page.locator(f'td:text-is("{pair}")')).click()
        by_set = listed_flips(page, 1)
    return {head: by_head, pair: by_set}


@pytest.mark.browser
def test_a_click_on_a_head_or_a_set_lists_the_discovery_items_it_flipped(browser, tiny_models, data_dir, tmp_path):
    """A run page's stage-1 heat map and stage-2 table (as the run notebook shows them, with the site's plotly.js): a
    click lists each flipped item with its text, the right answer and both models' answers, as the artifact stores
    them; a helped item is one the ablated model answers right and the full model wrong, a harmed one the reverse."""
    from cel_utils.book.flip_lists import heatmap_with_flips, stage2_with_flips
    from cel_utils.book.offline import plotly_source
    from cel_utils.pipeline.protocol import run_cel

    config = RunConfig(model="random:llama:tiny", task="boolq", n_discovery=6, n_holdout=8, p=3, k=2, batch_size=4,
                       n_random_sets=0, n_resamples=0, cache=False, data_dir=data_dir, results_dir=str(tmp_path))
    artifact = read_artifact(run_cel(config, lm=tiny_models["llama"], progress=False).artifact)
    shutil.copyfile(plotly_source(), tmp_path / "plotly.min.js")
    page = tmp_path / "run.html"
    page.write_text('<html><head><meta charset="utf-8"><script src="plotly.min.js"></script></head><body>'
                    f"{heatmap_with_flips(artifact).to_html()}{stage2_with_flips(artifact).to_html()}</body></html>")
    listed = click_through(browser, page.as_uri(), artifact)
    assert any(rows for _, rows in listed.values())  # something flipped: the comparison below is not of empty lists
    for name, shown in listed.items():
        assert shown == expected_flips(artifact, name), name
        for flip, _, _, gold, full, ablated in shown[1]:
            assert (ablated == gold != full) if flip == "wrong -> right" else (full == gold != ablated), (name, flip)


@pytest.mark.browser
def test_the_published_run_page_lists_a_heads_flips_on_a_click(browser, built):
    """The book's own run page, offline: the click-through works there too, with no console error."""
    artifact = read_artifact(built.parent.parent / "results" / f"{RUN}.json")
    for name, shown in click_through(browser, (built / PAGES["run"]).as_uri(), artifact).items():
        assert shown == expected_flips(artifact, name), name


# The overview figure's marker of one run: where it is on screen, and the address its click opens.
RUN_MARKER = """(label) => {
  const div = document.querySelector('[data-figure="cel-all-runs"]');
  div.scrollIntoView({block: 'center'});
  const index = div._fullData.findIndex(t => t.name && t.name.startsWith('holdout gain'));
  const trace = div._fullData[index];
  const i = Array.from(trace.y).indexOf(label);
  const xa = div._fullLayout.xaxis, ya = div._fullLayout.yaxis, rect = div.getBoundingClientRect();
  return {x: rect.left + xa._offset + xa.l2p(trace.x[i]), y: rect.top + ya._offset + ya.l2p(ya.d2l(label)),
          gain: trace.x[i], url: trace.customdata[i][0], labels: Array.from(trace.y)};
}"""


@pytest.mark.browser
def test_every_run_at_once_shows_each_runs_numbers_and_opens_its_page(browser, built):
    """The results page's overview figure, offline: one row per artifact, the hover gives the run's numbers as the
    artifact has them, and a click on the run with a page opens that page."""
    from cel_utils.book.results_page import summarize
    from cel_utils.pipeline.artifacts import load_artifacts

    table = summarize(load_artifacts(built.parent.parent / "results"))
    row = next(r for r in table.itertuples() if r.stem == RUN)
    label = f"{row.model} · {row.task}" + (" (at floor)" if row.at_floor else "")
    with opened(browser, (built / PAGES["results"]).as_uri()) as page:
        marker = page.evaluate(RUN_MARKER, label)
        assert sorted(marker["labels"]) == sorted(f"{r.model} · {r.task}" + (" (at floor)" if r.at_floor else "")
                                                  for r in table.itertuples())
        assert marker["gain"] == pytest.approx(row.gain_points)
        page.mouse.move(marker["x"], marker["y"])
        page.locator(".hoverlayer .hovertext").first.wait_for(state="attached")
        hover = " | ".join(page.locator(".hoverlayer .hovertext").all_text_contents())
        assert f"full -> ablated {row.holdout}" in hover and f"verdict: {row.word}" in hover, hover
        assert marker["url"] == f"runs/{RUN}.html"
        page.mouse.click(marker["x"], marker["y"])
        page.wait_for_url(f"**/runs/{RUN}.html")
