"""The README's screenshot of the head explorer (_static/explorer.png): `make explore`'s Voila app with the default
model on HellaSwag and one head switched off that flips the item shown, taken with Playwright driving the system
Chromium.

    python scripts/explorer_screenshot.py --find          # look for (item, head) pairs that flip, and print them
    python scripts/explorer_screenshot.py --item 17 --head L12.H3   # the screenshot of one

``--find`` scores the full model on the holdout's first ``--scan`` items, keeps the ``--near`` nearest the decision
boundary and, on each, evaluates exactly (the run's evaluator) the ``--tries`` heads that attribution patching
estimates to move its margin most towards a flip. The PNG is reduced to a
256-colour palette, as scripts/screenshot.py does, so the committed file stays small.
"""
from __future__ import annotations

import argparse
import io
import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
# What the app opens: the default model on HellaSwag with the cpu preset's items; CEL_EXPLORE_* variables override it
APP = {"CEL_EXPLORE_MODEL": "smollm2-135m-instruct", "CEL_EXPLORE_TASK": "hellaswag", "CEL_EXPLORE_SEED": "0",
       "CEL_EXPLORE_PRESET": "cpu"}
APP.update({name: os.environ[name] for name in APP if os.environ.get(name)})


def find_flips(scan: int, near: int, tries: int) -> None:
    import numpy as np

    from cel_utils.models.heads import HeadId
    from cel_utils.search.attribution import head_attributions

    from cel_utils.explore.app import arguments_from_environment
    from cel_utils.explore.session import ExploreSession

    session = ExploreSession.open(**arguments_from_environment(APP))
    items = session.data.holdout[:scan]
    full = session.evaluator(items, progress=True).evaluate_one(())
    closest = np.argsort(np.abs(full.margin))[:near]
    for index in closest:
        # Attribution patching ranks every head by its estimated effect on this item's margin (one backward pass);
        # only the --try heads estimated to move the margin most towards a flip are evaluated exactly.
        evaluator = session.evaluator([items[index]], progress=True)
        estimate = head_attributions(evaluator).per_item[0]
        towards_flip = estimate if full.margin[index] < 0 else -estimate
        order = np.argsort(-towards_flip, axis=None)[:tries]
        heads = [HeadId(int(layer), int(head)) for layer, head in zip(*np.unravel_index(order, estimate.shape))]
        outcomes = evaluator.evaluate([()] + [(h,) for h in heads])
        base = outcomes[0]
        for head, outcome in zip(heads, outcomes[1:]):
            if outcome.correct[0] != base.correct[0]:
                print(f"holdout #{index} ({items[index].id}): {head} "
                      f"{'wrong -> right' if outcome.correct[0] else 'right -> wrong'}, "
                      f"answer {base.predictions[0]} -> {outcome.predictions[0]} (gold {items[index].doc['label']})",
                      flush=True)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def shoot(item: int, head: str, out: Path, chromium: str) -> None:
    from PIL import Image
    from playwright.sync_api import expect, sync_playwright

    port = free_port()
    server = subprocess.Popen([str(Path(sys.executable).with_name("voila")), str(REPO / "notebooks" / "explore.ipynb"),
                               "--Voila.ip=127.0.0.1", f"--port={port}", "--no-browser"], env={**os.environ, **APP},
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        for _ in range(300):
            try:
                socket.create_connection(("127.0.0.1", port), timeout=2).close()
                break
            except OSError:
                time.sleep(0.2)
        with sync_playwright() as p:
            browser = p.chromium.launch(executable_path=chromium, args=["--no-sandbox", "--hide-scrollbars"])
            page = browser.new_page(viewport={"width": 1400, "height": 1500})
            page.set_default_timeout(300_000)
            page.goto(f"http://127.0.0.1:{port}/")
            shown = page.locator(".cel-item")
            expect(shown).to_contain_text("no head is switched off", timeout=300_000)
            index = page.locator(".cel-index input")
            index.fill(str(item))
            index.press("Enter")
            expect(shown).to_contain_text(f"holdout #{item} ", timeout=300_000)
            toggle = page.locator(f'button[title="{head}"]')
            toggle.click()
            expect(shown).to_contain_text(f"Ablated: {head}", timeout=300_000)
            toggle.scroll_into_view_if_needed()
            png = page.screenshot(full_page=True)
            browser.close()
    finally:
        server.terminate()
        server.wait(timeout=30)
    image = Image.open(io.BytesIO(png)).convert("RGB").quantize(colors=256)
    buffer = io.BytesIO()
    image.save(buffer, format="PNG", optimize=True)
    out.write_bytes(buffer.getvalue())
    print(f"{out}: {len(buffer.getvalue())} bytes")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--find", action="store_true", help="print (item, head) pairs that flip")
    parser.add_argument("--scan", type=int, default=120)
    parser.add_argument("--near", type=int, default=6)
    parser.add_argument("--tries", type=int, default=8, help="heads evaluated exactly per item (attribution's top)")
    parser.add_argument("--item", type=int)
    parser.add_argument("--head")
    parser.add_argument("--out", type=Path, default=REPO / "_static" / "explorer.png")
    parser.add_argument("--chromium", default=shutil.which("chromium") or shutil.which("chromium-browser"))
    args = parser.parse_args()
    if args.find:
        find_flips(args.scan, args.near, args.tries)
    elif args.item is None or not args.head:
        parser.error("give --item and --head (find them with --find)")
    else:
        if not args.chromium:
            parser.error("no Chromium found: install it (make browser) or pass --chromium")
        shoot(args.item, args.head, args.out, args.chromium)


if __name__ == "__main__":
    main()
