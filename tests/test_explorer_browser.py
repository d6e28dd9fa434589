"""The explorer as its users open it: `make explore`'s Voila app in headless Chromium (Playwright, the system's
Chromium, no browser download), with a tiny random model. Switching a head off on the grid must change the shown
answer and scores to what the runs' evaluator computes for that head set.

Like the book's browser tests, a missing Chromium or Playwright fails under CI and skips elsewhere.
"""
from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from browser import browser_or_unavailable

REPO = Path(__file__).resolve().parents[1]
APP = {"CEL_EXPLORE_MODEL": "random:llama:tiny", "CEL_EXPLORE_TASK": "hellaswag", "CEL_EXPLORE_SEED": "0",
       "CEL_EXPLORE_PRESET": "smoke"}
ITEM, HEAD = 0, "L1.H2"  # the holdout item the app opens on, and the head the test switches off
TIMEOUT_MS = 120_000  # the kernel starts, loads the model and scores the first item before the widgets show


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def app(data_dir, tmp_path_factory):
    """The Voila command `make explore` runs, on a free port, opening the tiny model on HellaSwag."""
    port = free_port()
    log = tmp_path_factory.mktemp("voila") / "voila.log"
    env = {**os.environ, **APP, "CEL_DATA_DIR": data_dir, "OMP_WAIT_POLICY": "PASSIVE"}
    voila = str(Path(sys.executable).with_name("voila"))
    with open(log, "w") as out:
        server = subprocess.Popen([voila, str(REPO / "notebooks" / "explore.ipynb"), "--Voila.ip=127.0.0.1",
                                   f"--port={port}", "--no-browser"], env=env, stdout=out, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}/"
    try:
        for _ in range(300):
            try:  # a connection, not a page request: each request of the page starts a kernel
                socket.create_connection(("127.0.0.1", port), timeout=2).close()
                break
            except OSError:
                if server.poll() is not None:
                    pytest.fail(f"voila exited with {server.returncode}:\n{log.read_text()[-3000:]}")
                time.sleep(0.2)
        yield url
    finally:
        server.terminate()
        try:
            server.wait(timeout=20)
        except subprocess.TimeoutExpired:
            server.kill()


@pytest.fixture(scope="module")
def browser():
    with browser_or_unavailable() as chromium:  # tests/browser.py: fails under CI, skips elsewhere
        yield chromium


def shown(page, which: str) -> list[float]:
    return [float(v) for v in page.eval_on_selector_all(
        f'.cel-item .cel-score[data-which="{which}"]', "cells => cells.map(c => c.dataset.value)")]


def test_switching_a_head_off_in_the_app_shows_the_evaluators_scores(app, browser, lm_for_app):
    from playwright.sync_api import expect

    page = browser.new_page(viewport={"width": 1400, "height": 1000})
    errors = []
    page.on("pageerror", lambda error: errors.append(str(error)))
    page.set_default_timeout(TIMEOUT_MS)
    page.goto(app)
    item = page.locator(".cel-item")
    expect(item).to_contain_text("no head is switched off", timeout=TIMEOUT_MS)
    session, full, ablated = lm_for_app
    expect(item).to_contain_text(session.data.holdout[ITEM].id)
    # before: both columns are the full model, as the evaluator scores it
    np.testing.assert_allclose(shown(page, "full"), full.scores[0], rtol=1e-6)
    np.testing.assert_allclose(shown(page, "ablated"), full.scores[0], rtol=1e-6)

    page.locator(f'button[title="{HEAD}"]').click()  # the grid's toggle for that head
    expect(item).to_contain_text(f"Ablated: {HEAD}")
    # another process computes them (the app's kernel): equal up to its threads' float rounding
    np.testing.assert_allclose(shown(page, "full"), full.scores[0], rtol=1e-6)
    np.testing.assert_allclose(shown(page, "ablated"), ablated.scores[0], rtol=1e-6)
    assert not np.allclose(ablated.scores[0], full.scores[0], rtol=1e-6, atol=0)  # the head changes the scores
    chosen = int(np.argmax(ablated.scores[0]))
    expect(item.locator('.cel-answer[data-which="ablated"]')).to_contain_text(f"chose [{chosen}]")
    expect(item.locator('.cel-answer[data-which="ablated"]')).to_have_attribute(
        "data-correct", str(int(ablated.correct[0])))
    expect(page.locator(".cel-heads input")).to_have_value(HEAD)  # the heads field follows the grid
    assert not errors, errors


@pytest.fixture(scope="module")
def lm_for_app(tokenizer, data_dir):
    """What the evaluator computes, in this process, for the app's item: full and with HEAD off."""
    from cel_utils.config import RunConfig
    from cel_utils.explore.session import ExploreSession
    from cel_utils.models.loading import random_model

    config = RunConfig.from_dict({"model": APP["CEL_EXPLORE_MODEL"], "task": APP["CEL_EXPLORE_TASK"],
                                  "seed": int(APP["CEL_EXPLORE_SEED"]), "preset": APP["CEL_EXPLORE_PRESET"],
                                  "data_dir": data_dir, "cache": False})
    session = ExploreSession(config, random_model("llama", tokenizer=tokenizer))
    full, ablated = session.evaluator([session.data.holdout[ITEM]]).evaluate([(), [HEAD]])
    return session, full, ablated
