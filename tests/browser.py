"""Headless Chromium driven by Playwright for Python, for the book's browser tests: the system Chromium (the Debian
package, as in CI) through ``executable_path``; Playwright never downloads a browser here.

The browser runs with the network cut off (every host name but localhost fails to resolve), as a reader offline
would see the site. :func:`visit` loads one page and reports what a reader's browser saw: console errors, uncaught
exceptions, failed or 4xx/5xx requests, any request that left the site, and the result of a JavaScript probe.
:func:`opened` gives the loaded page itself, for tests that click.

A browser that is missing or does not start fails the tests in CI (``CI`` set, as every CI service sets it: there the
browser is part of the machine, and a skip would hide that the pages were never checked) and skips them elsewhere
(:func:`unavailable`).
"""
from __future__ import annotations

import os
import re
import shutil
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import NoReturn

import pytest

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser") or shutil.which("google-chrome")
ARGS = ["--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run", "--hide-scrollbars",
        # Offline: no name resolves except localhost, so a page that reaches for a CDN fails visibly.
        "--host-resolver-rules=MAP * ~NOTFOUND, EXCLUDE localhost, EXCLUDE 127.0.0.1"]
VIEWPORT = {"width": 1280, "height": 900}
TIMEOUT_MS = 60_000

# A page that only redirects (the site's root index.html, written by sphinx-external-toc): a reader lands on its target.
REDIRECTS = "() => !!document.querySelector('meta[http-equiv=\"refresh\" i]')"
# What a page shows once it is ready: MathJax finished typesetting, plotly finished drawing.
READY = """async () => {
  if (window.MathJax && MathJax.startup && MathJax.startup.promise) { await MathJax.startup.promise; }
  for (let i = 0; i < 100 && document.querySelectorAll('.plotly-graph-div').length >
       document.querySelectorAll('.plotly-graph-div .main-svg').length; i++) {
    await new Promise(r => setTimeout(r, 100));
  }
  return true;
}"""
PROBE = """() => ({
  title: document.title,
  math_source: document.querySelectorAll('.math').length,
  math_rendered: document.querySelectorAll('mjx-container').length,
  math_errors: document.querySelectorAll('mjx-merror').length,
  figures: document.querySelectorAll('.plotly-graph-div').length,
  figures_drawn: document.querySelectorAll('.plotly-graph-div .main-svg').length,
  heatmap_cells: document.querySelectorAll('.plotly-graph-div .hm image, .plotly-graph-div .heatmaplayer image').length,
  images: Array.from(document.images).map(i => [i.currentSrc, i.complete && i.naturalWidth > 0]),
  links: Array.from(document.querySelectorAll('a[href]')).map(a => a.href),
  // What MathJax typeset: each formula's TeX, and those it could not (an error node, or an undefined macro, which
  // MathJax draws in red instead of failing).
  tex: window.MathJax && MathJax.startup && MathJax.startup.document
       ? Array.from(MathJax.startup.document.math, item => item.math) : [],
  tex_failed: window.MathJax && MathJax.startup && MathJax.startup.document
       ? Array.from(MathJax.startup.document.math).filter(item => item.root && /<merror|mathcolor="red"/.test(
           MathJax.startup.toMML(item.root))).map(item => item.math) : [],
  // The page's prose as text nodes (code, notebook outputs and typeset math left out), for TeX left untypeset.
  prose: (() => {
    const skip = 'script, style, pre, code, textarea, mjx-container, .cell_output, .output, .highlight';
    const walker = document.createTreeWalker(document.body || document.documentElement, NodeFilter.SHOW_TEXT);
    const nodes = [];
    for (let n = walker.nextNode(); n; n = walker.nextNode()) {
      if (n.nodeValue.trim() && !n.parentElement.closest(skip)) nodes.push(n.nodeValue);
    }
    return nodes;
  })(),
})"""
# Where the first heat map's best scored cell is on screen (other figures, as the results page's overview, skipped) (a screened stage 1 leaves the others empty: null or NaN).
BEST_CELL = """() => {
  const div = Array.from(document.querySelectorAll('.plotly-graph-div'))
    .find(d => d._fullData && d._fullData[0].type === 'heatmap');  // the page's first heat map
  div.scrollIntoView({block: 'center'});
  const z = div._fullData[0].z;  // decoded (plotly may ship the data base64-encoded)
  let best = null;
  for (let i = 0; i < z.length; i++) for (let j = 0; j < z[i].length; j++)
    if (Number.isFinite(z[i][j]) && (best === null || z[i][j] > z[best[0]][best[1]])) best = [i, j];
  const layout = div._fullLayout, xa = layout.xaxis, ya = layout.yaxis, rect = div.getBoundingClientRect();
  return {x: rect.left + xa._offset + xa.l2p(best[1]), y: rect.top + ya._offset + ya.l2p(best[0])};
}"""
# A cell of the first heat map on screen, by (layer, head) (its y and x); scrolled into view first.
CELL = """([layer, head]) => {
  const div = Array.from(document.querySelectorAll('.plotly-graph-div'))
    .find(d => d._fullData && d._fullData[0].type === 'heatmap');  // the page's first heat map
  div.scrollIntoView({block: 'center'});
  const layout = div._fullLayout, xa = layout.xaxis, ya = layout.yaxis, rect = div.getBoundingClientRect();
  return {x: rect.left + xa._offset + xa.l2p(head), y: rect.top + ya._offset + ya.l2p(layer)};
}"""
# A backslash lost on the way into a formula: "\t" (\text, \times), "\f" (\frac), "\b" (\beta), "\r" (\rho), "\a"
# (\alpha), "\v" (\varepsilon) read as an escape, leaving a control character and the command's tail.
LOST_BACKSLASH = re.compile(r"[\t\x07\x08\x0b\x0c\r]|(?<!\\t)ext\{|(?<!\\f)rac\{")
# TeX in the prose that no formula took up: $...$ that MyST did not parse, \( \[ delimiters, bare commands.
RAW_TEX = re.compile(r"\$[^$\s](?:[^$]*[^$\s])?\$|\\[()\[\]]|\\(?:begin|end|text|frac|mathrm|mathbf|sum|mid|sim|le|ge|"
                     r"cdot|times|alpha|beta)\b|(?<!\\t)\bext\{|\S\t|\t\S")


CONTROL_NAMES = {"\t": "<TAB>", "\x07": "<BEL>", "\x08": "<BS>", "\x0b": "<VT>", "\x0c": "<FF>", "\r": "<CR>"}


def _shown(text: str) -> str:
    """``text`` with its control characters named: what a lost backslash left is visible in a failure message."""
    return "".join(CONTROL_NAMES.get(c, c) for c in text)


@dataclass
class PageReport:
    url: str  # as asked for; a redirecting page is reported for where it led (``landed``)
    landed: str = ""
    probe: dict = field(default_factory=dict)
    console_errors: list[str] = field(default_factory=list)  # console.error, uncaught exceptions, the browser's errors
    failed_requests: list[str] = field(default_factory=list)  # 4xx/5xx responses and requests that failed to load
    requests: list[str] = field(default_factory=list)
    extra: dict = field(default_factory=dict)

    def math_problems(self) -> list[str]:
        """Formulas that did not render as written, and TeX left as text; empty when every formula is typeset."""
        p = self.probe
        problems = [f"{p['math_rendered']} of {p['math_source']} formulas typeset"] if (
            p["math_rendered"] != p["math_source"]) else []
        problems += [f"{p['math_errors']} MathJax error node(s) (mjx-merror)"] if p["math_errors"] else []
        problems += [f"MathJax could not typeset {tex!r}" for tex in p["tex_failed"]]
        problems += [f"a lost backslash in the formula {_shown(tex)}" for tex in p["tex"] if LOST_BACKSLASH.search(tex)]
        problems += [f"TeX left as text: {_shown(text.strip()[:160])}" for text in p["prose"] if RAW_TEX.search(text)]
        return problems

    def offsite(self, *allowed_prefixes: str) -> list[str]:
        """Requests for anything outside the site (data: URLs are inline, not requests for anything)."""
        return [u for u in self.requests if not u.startswith(("data:", "blob:") + tuple(allowed_prefixes))]


def in_ci(env: Mapping[str, str] | None = None) -> bool:
    """Whether this is a CI run: ``CI`` set to anything but empty, 0, false or no."""
    value = (os.environ if env is None else env).get("CI", "")
    return value.strip().lower() not in ("", "0", "false", "no")


def unavailable(reason: str, env: Mapping[str, str] | None = None) -> NoReturn:
    """End a browser test that cannot run: a failure in CI, a skip with the reason elsewhere."""
    if in_ci(env):
        pytest.fail(f"{reason}; CI is set, where the browser tests must run, not skip", pytrace=False)
    pytest.skip(reason)


@contextmanager
def browser_or_unavailable(executable: str | None = CHROMIUM, env: Mapping[str, str] | None = None) -> Iterator:
    """A headless Chromium (a Playwright ``Browser``), or :func:`unavailable` when there is none or it does not
    start."""
    if executable is None:
        unavailable("needs headless Chromium (apt-get install -y chromium; `make test` installs it when run as root)",
                    env)
    try:
        from playwright.sync_api import Error, sync_playwright
    except ImportError as error:
        unavailable(f"needs Playwright for Python ({error}): pip install -e . installs it", env)
    with sync_playwright() as playwright:
        try:
            browser = playwright.chromium.launch(executable_path=executable, args=ARGS, timeout=TIMEOUT_MS)
        except Error as error:  # not found, not executable, exited before Playwright could connect
            unavailable(f"headless Chromium ({executable}) did not start: {str(error).splitlines()[0]}", env)
        try:
            yield browser  # outside the try above: a failure in the test itself is the test's, never "did not start"
        finally:
            browser.close()


@contextmanager
def opened(browser, url: str, report: PageReport | None = None) -> Iterator:
    """``url`` loaded in a fresh context (no cache, no cookies) and ready: past any redirect, MathJax done, figures
    drawn. Yields the Playwright ``Page``; what the browser saw is recorded into ``report`` as it happens."""
    from playwright.sync_api import Error

    report = PageReport(url) if report is None else report
    context = browser.new_context(viewport=VIEWPORT)
    context.set_default_timeout(TIMEOUT_MS)
    try:
        page = context.new_page()
        page.on("request", lambda request: report.requests.append(request.url))
        # A request the page cancelled by leaving (a redirect page's icon) did not fail: the browser dropped it.
        page.on("requestfailed", lambda request: request.failure != "net::ERR_ABORTED" and report.failed_requests.append(
            f"{request.failure} {request.url}"))
        page.on("response", lambda response: response.status >= 400 and report.failed_requests.append(
            f"{response.status} {response.url}"))
        page.on("console", lambda message: message.type in ("error", "assert") and report.console_errors.append(
            f"{message.text} {message.location.get('url', '')}".strip()))
        page.on("pageerror", lambda error: report.console_errors.append(f"uncaught {error.name}: {error.message}"))
        page.goto(url, wait_until="load")
        start = page.url
        try:
            redirects = page.evaluate(REDIRECTS)
        except Error:  # the document went away while being read: the page is already leaving for its target
            redirects = True
        if redirects:  # probed before it left, the probe would read a document being replaced
            page.wait_for_url(lambda now: now != start, wait_until="load")
        report.landed = page.url
        page.evaluate(READY)
        yield page
        page.wait_for_timeout(300)  # late console messages
    finally:
        context.close()


def visit(browser, url: str, screenshot: Path | None = None, hover_heatmap: bool = False) -> PageReport:
    """Load ``url`` in a new context and report what happened (see :class:`PageReport`)."""
    report = PageReport(url)
    with opened(browser, url, report) as page:
        report.probe = page.evaluate(PROBE)
        if hover_heatmap:
            report.extra["hover"] = hover_best_cell(page)
        if screenshot is not None:
            page.screenshot(path=str(screenshot))
    return report


def hover_best_cell(page) -> str:
    """Move the mouse over the first heat map's best cell and return the hover label's text."""
    box = page.evaluate(BEST_CELL)
    page.mouse.move(box["x"], box["y"])
    page.locator(".hoverlayer .hovertext").first.wait_for(state="attached")
    return " | ".join(page.locator(".hoverlayer .hovertext").all_text_contents())


def click_heatmap_cell(page, layer: int, head: int) -> None:
    """Click the first heat map's cell of ``layer``, ``head``."""
    box = page.evaluate(CELL, [layer, head])
    page.mouse.click(box["x"], box["y"])
