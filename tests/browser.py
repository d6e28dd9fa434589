"""Headless Chromium driven over the DevTools protocol (CDP), for the book's browser tests; no dependency beyond
tornado (already installed with Jupyter).

The browser runs with the network cut off (every host name but localhost fails to resolve), as a reader offline
would see the site. :func:`visit` loads one page and reports what a reader's browser saw: console errors, uncaught
exceptions, failed or 4xx/5xx requests, any request that left the site, and the result of a JavaScript probe.

A browser that is missing or does not start fails the tests in CI (``CI`` set, as every CI service sets it: there the
browser is part of the machine, and a skip would hide that the pages were never checked) and skips them elsewhere
(:func:`unavailable`).
"""
from __future__ import annotations

import asyncio
import base64
import json
import os
import re
import shutil
import subprocess
import threading
from collections.abc import Iterator, Mapping
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import NoReturn

import pytest

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser") or shutil.which("google-chrome")
FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync",
         "--hide-scrollbars", "--window-size=1280,900",
         # Offline: no name resolves except localhost, so a page that reaches for a CDN fails visibly.
         "--host-resolver-rules=MAP * ~NOTFOUND, EXCLUDE localhost, EXCLUDE 127.0.0.1"]

# What a page shows once it is ready: MathJax finished typesetting, plotly finished drawing.
READY = """(async () => {
  if (window.MathJax && MathJax.startup && MathJax.startup.promise) { await MathJax.startup.promise; }
  for (let i = 0; i < 100 && document.querySelectorAll('.plotly-graph-div').length >
       document.querySelectorAll('.plotly-graph-div .main-svg').length; i++) {
    await new Promise(r => setTimeout(r, 100));
  }
  return true;
})()"""
PROBE = """JSON.stringify({
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
    url: str
    probe: dict = field(default_factory=dict)
    console_errors: list[str] = field(default_factory=list)
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


class _Session:
    """One page target in the browser, over one websocket."""

    def __init__(self, ws):
        self.ws, self.next_id, self.pending, self.events = ws, 0, {}, []
        self.session_id = None

    async def read_forever(self):
        while True:
            message = await self.ws.read_message()
            if message is None:
                return
            data = json.loads(message)
            if "id" in data and data["id"] in self.pending:
                self.pending.pop(data["id"]).set_result(data)
            else:
                self.events.append(data)

    async def call(self, method: str, params: dict | None = None, session: bool = True, timeout: float = 60) -> dict:
        self.next_id += 1
        message = {"id": self.next_id, "method": method, "params": params or {}}
        if session and self.session_id:
            message["sessionId"] = self.session_id
        future = asyncio.get_running_loop().create_future()
        self.pending[self.next_id] = future
        await self.ws.write_message(json.dumps(message))
        reply = await asyncio.wait_for(future, timeout)
        if "error" in reply:
            raise RuntimeError(f"{method}: {reply['error']}")
        return reply.get("result", {})

    async def wait_event(self, method: str, timeout: float = 60) -> dict:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while loop.time() < deadline:
            found = next((event for event in self.events if event.get("method") == method), None)
            if found is not None:
                return found
            await asyncio.sleep(0.05)
        raise TimeoutError(f"no {method} within {timeout} s")

    async def evaluate(self, expression: str, timeout: float = 60):
        result = await self.call("Runtime.evaluate", {"expression": expression, "awaitPromise": True,
                                                      "returnByValue": True}, timeout=timeout)
        if "exceptionDetails" in result:
            raise RuntimeError(f"page script failed: {result['exceptionDetails']}")
        return result["result"].get("value")


def _report(url: str, events: list[dict]) -> PageReport:
    report = PageReport(url)
    statuses = {}
    for event in events:
        method, params = event.get("method"), event.get("params", {})
        if method == "Network.requestWillBeSent":
            report.requests.append(params["request"]["url"])
        elif method == "Network.responseReceived":
            statuses[params["requestId"]] = params["response"]
            if params["response"]["status"] >= 400:
                report.failed_requests.append(f"{params['response']['status']} {params['response']['url']}")
        elif method == "Network.loadingFailed" and not params.get("canceled"):
            report.failed_requests.append(f"{params.get('errorText')} (request {params['requestId']})")
        elif method == "Runtime.consoleAPICalled" and params["type"] in ("error", "assert"):
            report.console_errors.append(" ".join(str(a.get("value", a.get("description", ""))) for a in params["args"]))
        elif method == "Runtime.exceptionThrown":
            details = params["exceptionDetails"]
            report.console_errors.append(details.get("exception", {}).get("description") or details.get("text", ""))
        elif method == "Log.entryAdded" and params["entry"]["level"] == "error":
            report.console_errors.append(f"{params['entry']['text']} {params['entry'].get('url', '')}".strip())
    return report


async def _visit(ws_url: str, url: str, screenshot: Path | None, hover_heatmap: bool) -> PageReport:
    from tornado.websocket import websocket_connect

    ws = await websocket_connect(ws_url, max_message_size=256 * 1024 * 1024)
    s = _Session(ws)
    reader = asyncio.ensure_future(s.read_forever())
    try:
        target = (await s.call("Target.createTarget", {"url": "about:blank"}, session=False))["targetId"]
        s.session_id = (await s.call("Target.attachToTarget", {"targetId": target, "flatten": True},
                                     session=False))["sessionId"]
        for domain in ("Page", "Runtime", "Log", "Network"):
            await s.call(f"{domain}.enable")
        await s.call("Network.setCacheDisabled", {"cacheDisabled": True})
        await s.call("Page.navigate", {"url": url})
        await s.wait_event("Page.loadEventFired")
        await s.evaluate(READY)
        report_probe = json.loads(await s.evaluate(PROBE))
        extra = {}
        if hover_heatmap:
            extra["hover"] = await _hover_heatmap(s)
        if screenshot is not None:
            shot = await s.call("Page.captureScreenshot", {"format": "png", "captureBeyondViewport": False})
            screenshot.write_bytes(base64.b64decode(shot["data"]))
        await asyncio.sleep(0.3)  # late console messages
        report = _report(url, [e for e in s.events if e.get("sessionId") == s.session_id])
        report.probe, report.extra = report_probe, extra
        await s.call("Target.closeTarget", {"targetId": target}, session=False)
        return report
    finally:
        reader.cancel()
        ws.close()


async def _hover_heatmap(s: _Session) -> str:
    """Scroll the first heat map into view, move the mouse over its best cell, and return the hover label's text."""
    box = await s.evaluate("""(() => {
      const div = document.querySelector('.plotly-graph-div');
      div.scrollIntoView({block: 'center'});
      const z = div._fullData[0].z;  // decoded (plotly may ship the data base64-encoded)
      let best = null;  // the best head the run scored (a screened stage 1 leaves the others empty: null or NaN)
      for (let i = 0; i < z.length; i++) for (let j = 0; j < z[i].length; j++)
        if (Number.isFinite(z[i][j]) && (best === null || z[i][j] > z[best[0]][best[1]])) best = [i, j];
      const layout = div._fullLayout, xa = layout.xaxis, ya = layout.yaxis;
      const rect = div.getBoundingClientRect();
      return {x: rect.left + xa._offset + xa.l2p(best[1]), y: rect.top + ya._offset + ya.l2p(best[0])};
    })()""")
    for _ in range(3):
        await s.call("Input.dispatchMouseEvent", {"type": "mouseMoved", "x": box["x"], "y": box["y"]})
        await asyncio.sleep(0.4)
    return await s.evaluate("Array.from(document.querySelectorAll('.hoverlayer .hovertext')).map(t => t.textContent)"
                            ".join(' | ')")


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
def browser_or_unavailable(profile: Path, executable: str | None = CHROMIUM,
                           env: Mapping[str, str] | None = None) -> Iterator[str]:
    """:func:`chromium`, or :func:`unavailable` when there is none or it does not start."""
    if executable is None:
        unavailable("needs headless Chromium (apt-get install -y chromium; `make test` installs it when run as root)",
                    env)
    with ExitStack() as stack:
        try:
            ws = stack.enter_context(chromium(profile, executable))
        except (OSError, RuntimeError) as error:  # not found, not executable, exited before its DevTools port opened
            unavailable(f"headless Chromium ({executable}) did not start: {error}", env)
        yield ws  # outside the try: a failure in the test itself is the test's, never "did not start"


@contextmanager
def chromium(profile: Path, executable: str | None = CHROMIUM):
    """A headless Chromium with remote debugging on a free port; yields its browser websocket URL."""
    process = subprocess.Popen([executable, *FLAGS, f"--user-data-dir={profile}", "--remote-debugging-port=0",
                                "about:blank"], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        said = []  # what it logged before exiting, for the error
        for line in process.stderr:
            match = re.search(r"DevTools listening on (ws://\S+)", line)
            if match:
                break
            said = [*said[-4:], line.strip()]
        else:
            raise RuntimeError(f"chromium exited ({process.wait()}) before opening its DevTools port: "
                               + (" | ".join(said) or "it logged nothing"))
        # Keep reading its log, or a full pipe would stall the browser.
        threading.Thread(target=lambda: [None for _ in process.stderr], daemon=True).start()
        yield match.group(1)
    finally:
        process.terminate()
        try:
            process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            process.kill()


def visit(ws_url: str, url: str, screenshot: Path | None = None, hover_heatmap: bool = False) -> PageReport:
    """Load ``url`` in a new tab and report what happened (see :class:`PageReport`)."""
    return asyncio.run(_visit(ws_url, url, screenshot, hover_heatmap))
