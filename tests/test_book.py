"""The book end to end, in a temporary copy: `python -m cel_utils main` on a tiny grid, then the built HTML,
checked as files and (marked `browser`) in headless Chromium."""
import html
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from cel_utils.cli import main

REPO = Path(__file__).resolve().parents[1]
MIRROR = Path(os.environ.get("CEL_DATA_DIR") or REPO.parent / "shared" / "data")
DATA_DIR = str(MIRROR) if MIRROR.is_dir() else None
RUN = "random-llama-tiny__arithmetic_2da__seed0"
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser") or shutil.which("google-chrome")


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """A small book: the committed pages, one tiny run, no theory notebooks (they have their own tests)."""
    root = tmp_path_factory.mktemp("book")
    for name in ("_config.yml", "_toc.template.yml"):
        shutil.copy(REPO / name, root / name)
    (root / "book").mkdir()
    for page in ("intro.md", "method.md", "theory.md", "beyond.md"):
        shutil.copy(REPO / "book" / page, root / "book" / page)
    shutil.copytree(REPO / "data", root / "data")
    args = ["main", "--root", str(root), "--models", "random:llama:tiny", "--tasks", "arithmetic_2da",
            "--preset", "smoke", "--engine", "naive", "--theory", "skip"] + (["--data-dir", DATA_DIR] if DATA_DIR else [])
    assert main(args) == 0
    return root / "_build" / "html"


def test_book_builds_with_warnings_as_errors(built):
    assert (built / "index.html").exists()
    assert not (built.parent / ".jupyter_cache").exists()  # the book executed nothing: runs are rendered as they are
    results = (built / "book" / "results.html").read_text()
    assert f'href="runs/{RUN}.html"' in results
    run_page = (built / "book" / "runs" / f"{RUN}.html").read_text()
    assert "<title>CEL run: random-llama-tiny on arithmetic_2da (seed 0)" in run_page
    sidebar = (built / "book" / "intro.html").read_text()
    assert "random-llama-tiny on arithmetic_2da (seed 0)" in sidebar  # the toc's explicit title


def text_of(fragment: str) -> str:
    """The visible text of an HTML fragment, whitespace collapsed."""
    return " ".join(html.unescape(re.sub(r"<[^>]+>", "", fragment)).split())


def dump_dom(page: Path, profile: Path) -> str:
    command = [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
               "--disable-background-networking", "--disable-component-update", "--disable-sync",
               f"--user-data-dir={profile}", "--dump-dom", page.as_uri()]
    done = subprocess.run(command, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout


@pytest.mark.browser
@pytest.mark.skipif(CHROMIUM is None, reason="needs headless Chromium (apt-get install -y chromium)")
def test_results_table_and_heatmap_in_chromium(built, tmp_path):
    dom = dump_dom(built / "book" / "results.html", tmp_path / "profile")
    tables = re.findall(r"<table.*?</table>", dom, flags=re.S)
    assert len(tables) == 4  # our Table 1, every run, is the gain real, the paper's reference
    text = text_of(tables[0])
    assert "random-llama-tiny" in text and "arithmetic_2da (acc)" in text
    assert re.search(r"\d+\.\d -> \d+\.\d \([+-]\d+\.\d\), (-?\d+\.\d%|n/a)", text)
    assert "70.40 -> 83.50 (+13.10), 44.26%" in text_of(tables[3])

    dom = dump_dom(built / "book" / "runs" / f"{RUN}.html", tmp_path / "profile")
    assert "CEL run: random-llama-tiny on arithmetic_2da (seed 0)" in text_of(dom)
    sources = re.findall(r'<img[^>]*\bsrc="([^"]+)"', dom)
    images = [s for s in sources if s.startswith("data:image/") or s.endswith(".png")]
    assert images, f"no heat map image among {sources}"
    if not images[0].startswith("data:"):
        png = (built / "book" / "runs" / images[0]).resolve()
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
