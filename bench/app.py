"""`remat bench --app`: the app's latency in headless Chromium, and the page-driving it needs.

Measures (1) opening the app on gpt-tiny to a usable page (timeline drawn) from the start of
a `serve()` process (imports included), and (2) on gpt2-small, a budget-slider key press to
the updated timeline painted (plotly's afterplot, then the next animation frame), median of
`moves` presses. Needs playwright (the `bench` extra: `pip install '.[bench]'`) and Debian's
chromium (`apt-get install chromium`). The browser tests drive pages with the same helpers.
"""

from __future__ import annotations

import shutil
import socket
import statistics
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from bench import MissingExtra

READY_JS = """() => { const g = document.querySelector('#timeline .js-plotly-plot');
  return !!(g && g.data && g.data.length > 3 && g.layout.meta && g.layout.meta.budget_pct); }"""

# Resolves when the timeline is painted with the figure for budget `pct` (layout.meta).
PAINTED_JS = """(pct) => { window.__painted = new Promise(resolve => {
  const gd = document.querySelector('#timeline .js-plotly-plot');
  const done = () => requestAnimationFrame(() => requestAnimationFrame(
      () => resolve(performance.now())));
  const check = () => {
    if (gd.layout.meta && gd.layout.meta.budget_pct === pct) { gd.removeListener('plotly_afterplot', check); done(); }
  };
  gd.on('plotly_afterplot', check);
}); }"""

CHROMIUM_ARGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]


def choose(page, dropdown_id: str, value: str) -> None:
    """Pick `value` in a Dash 4 dropdown."""
    page.click(f"#{dropdown_id}")
    page.locator(f"[role=option]:has(input[value='{value}'])").click()


def wait_ready(page, model: str, timeout_ms: float = 300_000) -> None:
    page.wait_for_function(
        """(model) => { const g = document.querySelector('#timeline .js-plotly-plot');
          const t = document.querySelector('#intro b');
          return !!(g && g.data && g.data.length > 3 && t && t.textContent === model); }""",
        arg=model,
        timeout=timeout_ms,
    )


def slider_value(page) -> float:
    return float(page.locator("#budget [role=slider]").get_attribute("aria-valuenow"))


def bench_app(
    model: str = "gpt2-small", moves: int = 15, chromium: str | None = None, pages: int = 1
) -> dict:
    """Open the app (time to usable page on gpt-tiny), then time slider moves on `model`.

    With `pages` > 1, that many pages are opened at once first (a class opening one link)
    and the moves are timed in the last while the others stay open.
    Returns {"open_s", "model", "analyse_s", "move_ms": [...], "median_ms", "method", "pages"}.
    """
    sync_playwright = _playwright()
    path = chromium or shutil.which("chromium") or "/usr/bin/chromium"
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    url = f"http://127.0.0.1:{port}/"
    start = time.perf_counter()
    server = subprocess.Popen(  # what `remat app` runs, in its own process
        [sys.executable, "-c", f"from app.server import serve; serve(port={port})"],
        cwd=Path(__file__).resolve().parent.parent,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    result: dict = {"model": model, "pages": pages}
    try:
        _wait_http(url, server)
        with sync_playwright() as p:
            browser = p.chromium.launch(executable_path=path, args=CHROMIUM_ARGS)
            others = [
                browser.new_page(viewport={"width": 1400, "height": 1000}) for _ in range(pages - 1)
            ]
            page = browser.new_page(viewport={"width": 1400, "height": 1000})
            for p in [*others, page]:
                p.goto(url, wait_until="commit")
            for p in [*others, page]:
                wait_ready(p, "gpt-tiny", 180_000)
            result["open_s"] = round(time.perf_counter() - start, 2)
            t = time.perf_counter()
            choose(page, "model", model)
            wait_ready(page, model)
            result["analyse_s"] = round(time.perf_counter() - t, 2)
            result["method"] = page.locator("#method").inner_text()
            slider = page.locator("#budget [role=slider]")
            slider.focus()
            times = []
            for i in range(moves):
                key = "ArrowLeft" if i % 4 < 2 else "ArrowRight"
                before = slider_value(page)
                target = before - 0.5 if key == "ArrowLeft" else before + 0.5
                page.evaluate(PAINTED_JS, target)
                t0 = page.evaluate("() => performance.now()")
                page.keyboard.press(key)
                t1 = page.evaluate("() => window.__painted")
                times.append(round(t1 - t0, 1))
            result["move_ms"] = times
            result["median_ms"] = statistics.median(times)
            browser.close()
    finally:
        server.terminate()
        server.wait(10)
    return result


def _playwright():
    """playwright's sync_playwright, or an error that says how to install it."""
    try:
        from playwright.sync_api import sync_playwright
    except ImportError as e:
        raise MissingExtra(
            "`remat bench --app` needs playwright: pip install 'remat-studio[bench]' "
            "(and Debian's chromium: apt-get install chromium)"
        ) from e
    return sync_playwright


def _wait_http(url: str, process: subprocess.Popen, timeout: float = 60) -> None:
    deadline = time.perf_counter() + timeout
    while time.perf_counter() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"the app server exited with code {process.returncode}")
        try:
            with urllib.request.urlopen(url, timeout=1):
                return
        except OSError:
            time.sleep(0.1)
    raise TimeoutError(f"the app did not answer on {url} within {timeout} s")


if __name__ == "__main__":
    print(bench_app(pages=int(sys.argv[1]) if len(sys.argv) > 1 else 1))
