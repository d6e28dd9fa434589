"""The README's screenshot of the built book (docs/book.png), taken with Playwright driving the system Chromium.

    python scripts/screenshot.py                              # the landing page, into docs/book.png
    python scripts/screenshot.py --page book/results.html     # another page of the built book

Build the book first (`make book`, or `python -m cel_utils book` from whatever runs exist). The page is opened from
the files with every request off the site refused (the book needs no network), once MathJax has typeset and plotly
has drawn, at 1280 x 800 CSS pixels. The PNG is reduced to a 256-colour palette: a page of text and a few figures
loses nothing visible and the committed file stays small (tests/test_docs.py keeps it under MAX_BYTES).
No browser is downloaded: the script uses Chromium as installed on the machine (the Debian package, as the book's
browser tests do) or the one given with --chromium.
"""
from __future__ import annotations

import argparse
import io
import shutil
import sys
from pathlib import Path

from cel_utils.paths import atomic_write

REPO = Path(__file__).resolve().parents[1]
MAX_BYTES = 150_000  # the README's image, committed: kept small enough for a fast first screen and a lean history
# What a page shows once it is ready: MathJax finished typesetting, plotly finished drawing its figures.
READY = """async () => {
  if (window.MathJax && MathJax.startup && MathJax.startup.promise) { await MathJax.startup.promise; }
  const figures = document.querySelectorAll('.plotly-graph-div');
  return Array.from(figures).every(f => f.querySelector('.main-svg'));
}"""


def screenshot(page_file: Path, chromium: str, width: int = 1280, height: int = 800) -> bytes:
    """``page_file`` as it renders in ``chromium``, as a palette PNG."""
    from PIL import Image  # matplotlib's own dependency, so always installed with the book
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=chromium, args=["--no-sandbox", "--hide-scrollbars"])
        try:
            context = browser.new_context(viewport={"width": width, "height": height}, device_scale_factor=1)
            context.route("**/*", lambda route: route.continue_() if route.request.url.startswith("file:")
                          else route.abort())
            page = context.new_page()
            page.goto(page_file.as_uri(), wait_until="load")
            page.wait_for_function(READY, timeout=30_000)
            png = page.screenshot(full_page=False)
        finally:
            browser.close()
    image = Image.open(io.BytesIO(png)).convert("RGB")
    palette = image.quantize(colors=256, method=Image.Quantize.MEDIANCUT, dither=Image.Dither.NONE)
    out = io.BytesIO()
    palette.save(out, format="PNG", optimize=True)
    return out.getvalue()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--site", type=Path, default=REPO / "_build" / "html", help="the built book (default: %(default)s)")
    parser.add_argument("--page", default="book/intro.html", help="the page, relative to --site (default: %(default)s)")
    parser.add_argument("--out", type=Path, default=REPO / "docs" / "book.png", help="default: %(default)s")
    parser.add_argument("--width", type=int, default=1280)
    parser.add_argument("--height", type=int, default=800)
    parser.add_argument("--chromium", default=shutil.which("chromium") or shutil.which("chromium-browser"),
                        help="the browser's executable (default: chromium on the PATH)")
    args = parser.parse_args(argv)
    page_file = (args.site / args.page).resolve()
    if not page_file.is_file():
        parser.error(f"{page_file} does not exist: build the book first (`make book`, or "
                     f"`python -m cel_utils book --theory skip`), or name a built page with --page")
    if not args.chromium or not Path(shutil.which(args.chromium) or args.chromium).is_file():
        parser.error(f"no Chromium found ({args.chromium or 'none on the PATH'}): install the Debian package "
                     f"`chromium`, or give its executable with --chromium")
    png = screenshot(page_file, shutil.which(args.chromium) or args.chromium, args.width, args.height)
    if len(png) > MAX_BYTES:  # refused before writing: the committed screenshot stays as it was
        print(f"error: the screenshot of {args.page} is {len(png) / 1000:.0f} KB, over {MAX_BYTES / 1000:.0f} KB; "
              f"nothing written: try a smaller --height or a page with fewer figures", file=sys.stderr)
        return 1
    atomic_write(args.out, png)
    print(f"{args.out}: {args.page} at {args.width}x{args.height}, {len(png) / 1000:.0f} KB")
    return 0

if __name__ == "__main__":
    sys.exit(main())
