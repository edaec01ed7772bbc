"""Two of docs/screenshots/, taken in Debian's headless chromium at 1400x1000 (playwright,
as the browser tests): the Hugging Face menu planning Llama 3 8B at 1 x 8192 tokens for an
H100 (`hf-llama3-8b-h100.png`, the page's top), and "Will it fit?" on gpt-tiny for an H100
(`fit.png`, its card). Prints how long each took from the click to the answer.

    PYTHONPATH=. python docs/app_screenshots.py [hf] [fit]

The Llama shot waits for its analysis on the meta device (minutes on a loaded 2-core
machine: docs/app.md gives the times).
"""

from __future__ import annotations

import logging
import os
import shutil
import sys
import threading
import time
from pathlib import Path

from playwright.sync_api import sync_playwright
from werkzeug.serving import make_server

from app import ids
from app.server import create_app
from bench.app import CHROMIUM_ARGS, choose, painted, wait_calm, wait_ready

SHOTS = Path(__file__).resolve().parent / "screenshots"
LIMIT_MS = 1_800_000  # a wait's limit: the analysis of an 8B model, on a loaded machine
BUDGET_PCT = 50  # the Llama shot's budget, % of plain PyTorch's step peak


def hf_llama(page) -> None:
    """The menu: Llama 3 8B, 1 x 8192 tokens, for an H100; the page's top once it answers."""
    choose(page, ids.ARCH, "llama3-8b")
    page.fill(f"#{ids.ARCH_BATCH}", "1")
    page.fill(f"#{ids.ARCH_SEQ}", "8192")
    choose(page, ids.ARCH_DEVICE, "h100")
    start = time.perf_counter()
    page.click(f"#{ids.ARCH_PLAN}")
    wait_ready(page, "llama3-8b 1x8192", LIMIT_MS)
    page.wait_for_function(
        "(id) => document.getElementById(id).textContent.startsWith('On an H100')",
        arg=ids.ARCH_FIT,
        timeout=LIMIT_MS,
    )
    wait_calm(page, LIMIT_MS)
    print(f"llama3-8b 1x8192, h100: the answer {time.perf_counter() - start:.0f} s after the click")
    print(f"  {page.inner_text(f'#{ids.ARCH_FIT}')}")
    # a budget whose whole footprint fits 80 GiB: parameters and AdamW's state take 45 GiB
    page.fill(f"#{ids.BUDGET_INPUT}", str(BUDGET_PCT))
    page.press(f"#{ids.BUDGET_INPUT}", "Enter")
    page.wait_for_function(
        "([id, pct]) => document.getElementById(id).textContent.includes(' at ' + pct + '%')",
        arg=[ids.ARCH_FIT, BUDGET_PCT],
        timeout=LIMIT_MS,
    )
    print(f"  {page.inner_text(f'#{ids.ARCH_FIT}')}")
    page.evaluate("() => window.scrollTo(0, 0)")
    calm(page)
    page.screenshot(path=str(SHOTS / "hf-llama3-8b-h100.png"))


def fit_gpt_tiny(page) -> None:
    """Will it fit? on gpt-tiny for an H100, its memory-against-batch chart drawn."""
    choose(page, ids.MODEL, "gpt-tiny")
    choose(page, ids.DEVICE, "h100")
    start = time.perf_counter()
    page.wait_for_function(
        "(id) => document.getElementById(id).textContent.startsWith('On an H100')",
        arg=ids.FIT_TEXT,
        timeout=LIMIT_MS,
    )
    wait_calm(page, LIMIT_MS)
    page.wait_for_function(  # the batch chart, its own busy sign gone
        """() => { const g = document.querySelector('#batch-fig .js-plotly-plot');
          return !!(g && g.data && g.data.length > 0
            && !document.getElementById('batch-fig').hasAttribute('data-refreshing')); }""",
        timeout=LIMIT_MS,
    )
    print(f"gpt-tiny, h100: answer and batch chart {time.perf_counter() - start:.0f} s")
    print(f"  {page.inner_text(f'#{ids.FIT_TEXT}')}")
    card = page.locator(f"#{ids.FIT}").locator("xpath=ancestor::div[contains(@class, 'card')][1]")
    card.scroll_into_view_if_needed()  # views in sight are drawn then (docs/app.md)
    calm(page)
    card.screenshot(path=str(SHOTS / "fit.png"))


def calm(page) -> None:
    """Until nothing on the page is dimmed: no busy bar, no view under its own busy sign."""
    wait_calm(page, LIMIT_MS)
    page.wait_for_function(
        "() => !document.querySelector('[data-refreshing]')", timeout=LIMIT_MS, polling="raf"
    )
    wait_calm(page, LIMIT_MS)
    painted(page)


def main(which: list[str]) -> None:
    logging.getLogger("werkzeug").setLevel(logging.ERROR)
    app = create_app()
    server = make_server("127.0.0.1", 0, app.server, threaded=True)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    address = f"http://127.0.0.1:{server.server_port}/"
    path = shutil.which("chromium") or "/usr/bin/chromium"
    try:
        with sync_playwright() as p:
            browser = p.chromium.launch(executable_path=path, args=CHROMIUM_ARGS)
            page = browser.new_page(viewport={"width": 1400, "height": 1000})
            page.set_default_timeout(LIMIT_MS)
            page.goto(address)
            wait_ready(page, "gpt-tiny", LIMIT_MS)
            print(f"load average at the start: {os.getloadavg()[0]:.1f}")
            if "fit" in which:
                fit_gpt_tiny(page)
            if "hf" in which:
                hf_llama(page)
            print(f"load average at the end: {os.getloadavg()[0]:.1f}")
            browser.close()
    finally:
        server.shutdown()
        app.jobs.stop_all()


if __name__ == "__main__":
    main(sys.argv[1:] or ["fit", "hf"])
