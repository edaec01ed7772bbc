"""`remat bench --app`: the app's latency in headless Chromium, and the page-driving it needs.

Two measures, each taken on one or two servers side by side (`roots`: this checkout, and for
a before/after table an older checkout, e.g. one made with `git worktree add`):

- a budget-slider release (a key press on the slider, the page at its top) to the timeline
  redrawn for the new budget (its figure's meta on an animation frame), and to the page
  un-dimmed (the watcher's `data-busy` off, the numbers drawn for the new budget: every view
  in sight drawn for it; views far below the fold are drawn as they come near), on each of
  `models`, each press one step down to a budget the page has not drawn (its plan and views
  made anew, none from a cache);
- a model switch to the first timeline drawn for the new model, and to the page un-dimmed.

With two roots, the moves and switches alternate between the two pages (one browser, two
servers, each with an empty options cache of its own), so both see the same machine load.
Needs playwright (the `bench` extra: `pip install '.[bench]'`) and Debian's chromium
(`apt-get install chromium`). The browser tests drive pages with the same helpers.
"""

from __future__ import annotations

import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable, Iterator, Sequence
from contextlib import ExitStack, contextmanager
from pathlib import Path

from bench import MissingExtra

ROOT = Path(__file__).resolve().parent.parent

CHROMIUM_ARGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]

# Arms `window.__move`: resolves with {timeline, undimmed} (ms from the next keydown) once the
# timeline is painted for budget `pct` and then the page shows no busy bar with the numbers
# drawn for `pct`.
MOVE_JS = """(pct) => {
  let t0 = null;
  document.addEventListener('keydown', () => { t0 = performance.now(); },
    {once: true, capture: true});
  const gd = document.querySelector('#timeline .js-plotly-plot');
  window.__move = new Promise(resolve => {
    const out = {};
    const frame = () => {
      if (t0 !== null) {
        const now = performance.now();
        if (out.timeline === undefined && gd.layout.meta && gd.layout.meta.budget_pct === pct) {
          out.timeline = now - t0;
        }
        const num = document.getElementById('numbers').getAttribute('data-for') || '';
        if (out.timeline !== undefined && !document.body.hasAttribute('data-busy')
            && num.endsWith('|' + pct)) {
          out.undimmed = now - t0; resolve(out); return;
        }
      }
      requestAnimationFrame(frame);
    };
    requestAnimationFrame(frame);
  });
}"""

# Arms `window.__switch`: {timeline, undimmed} in ms after the call, for `model`.
SWITCH_JS = """(model) => {
  const t0 = performance.now();
  window.__switch = new Promise(resolve => {
    const out = {};
    const frame = () => {
      const now = performance.now();
      const gd = document.querySelector('#timeline .js-plotly-plot');
      const f = gd && gd.layout && gd.layout.meta ? gd.layout.meta.for || '' : '';
      if (out.timeline === undefined && f.startsWith(model + '|') && gd.data.length > 3) {
        out.timeline = now - t0;
      }
      const t = document.querySelector('#intro b');
      if (out.timeline !== undefined && !document.body.hasAttribute('data-busy')
          && t && t.textContent === model) {
        out.undimmed = now - t0; resolve(out); return;
      }
      requestAnimationFrame(frame);
    };
    requestAnimationFrame(frame);
  });
}"""


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


def wait_calm(page, timeout_ms: float = 300_000) -> None:
    """Until the page shows no busy bar."""
    page.wait_for_function(
        "() => !document.body.hasAttribute('data-busy')", timeout=timeout_ms, polling="raf"
    )


def wait_idle(page, timeout_ms: float = 300_000) -> None:
    """Until Dash's renderer has no callback in flight (its store's isLoading)."""
    page.wait_for_function(
        "() => { const s = window.dash_stores && window.dash_stores[0];"
        " return !!s && !s.getState().isLoading; }",
        timeout=timeout_ms,
    )


def painted(page, frames: int = 2) -> None:
    """Until the browser has painted `frames` more animation frames (what is in the DOM now
    is on screen)."""
    page.evaluate(
        "(n) => new Promise(r => { const f = () => (--n <= 0 ? r() : requestAnimationFrame(f));"
        " requestAnimationFrame(f); })",
        frames,
    )


def slider_value(page) -> float:
    return float(page.locator("#budget [role=slider]").get_attribute("aria-valuenow"))


def bench_app(
    models: Sequence[str] = ("gpt-tiny", "gpt2-small"),
    moves: int = 10,
    switches: Sequence[str] = (),
    before: str | Path | None = None,
    chromium: str | None = None,
    report: Callable[[str], None] | None = None,
) -> dict:
    """Slider moves on each of `models` and model switches to each of `switches`, on this
    checkout's app ("after") and, with `before`, on that checkout's too, alternating.

    Returns {"slider": {version: {model: [(timeline_ms, undimmed_ms), ...]}},
    "switch": {version: {model: (timeline_s, undimmed_s)}}, "load": (before, after)}, the
    load averages (1 min) at the start and the end: on a shared machine they say what the
    numbers are worth. `report` gets each measurement in words as it is taken.
    """
    say = report or (lambda line: None)
    sync_playwright = _playwright()
    path = chromium or shutil.which("chromium") or "/usr/bin/chromium"
    roots = {"after": ROOT, **({"before": Path(before)} if before else {})}
    out: dict = {"slider": {v: {} for v in roots}, "switch": {v: {} for v in roots}}
    start_load = os.getloadavg()[0]
    with ExitStack() as stack, sync_playwright() as p:
        urls = {v: stack.enter_context(served(root)) for v, root in roots.items()}
        browser = p.chromium.launch(executable_path=path, args=CHROMIUM_ARGS)
        pages = {}
        for v, url in urls.items():
            page = browser.new_page(viewport={"width": 1400, "height": 1000})
            page.set_default_timeout(600_000)
            page.goto(url, wait_until="commit")
            pages[v] = page
        for page in pages.values():
            wait_ready(page, "gpt-tiny", 600_000)
        for model in models:
            for page in pages.values():
                if model != "gpt-tiny":
                    choose(page, "model", model)
                    wait_ready(page, model, 600_000)
                wait_calm(page, 600_000)
                page.locator("#budget [role=slider]").focus()
            for v in pages:
                out["slider"][v][model] = []
            for i in range(moves):  # each press a budget not drawn before: nothing cached
                for v, page in pages.items():
                    page.evaluate(MOVE_JS, slider_value(page) - 0.5)
                    page.keyboard.press("ArrowLeft")
                    got = page.evaluate("() => window.__move")
                    out["slider"][v][model].append(
                        (round(got["timeline"], 1), round(got["undimmed"], 1))
                    )
                    say(f"{v} {model} move {i}: {out['slider'][v][model][-1]} ms")
                    wait_calm(page)
        for model in switches:
            for v, page in pages.items():
                wait_calm(page, 600_000)
                page.evaluate(SWITCH_JS, model)
                choose(page, "model", model)
                got = page.evaluate("() => window.__switch")
                out["switch"][v][model] = (
                    round(got["timeline"] / 1e3, 1),
                    round(got["undimmed"] / 1e3, 1),
                )
                say(f"{v} switch to {model}: {out['switch'][v][model]} s")
        browser.close()
    out["load"] = (round(start_load, 1), round(os.getloadavg()[0], 1))
    return out


def app_table(result: dict) -> str:
    """`bench_app`'s result as markdown tables: median and worst per model and version."""
    lines = [
        "| model | version | release → timeline, median (worst) | release → page un-dimmed, "
        "median (worst) |",
        "|---|---|---|---|",
    ]
    models = {m for per in result["slider"].values() for m in per}
    for model in sorted(models):
        for v, per in sorted(result["slider"].items(), reverse=True):
            if model not in per:
                continue
            tl = [t for t, _ in per[model]]
            ud = [u for _, u in per[model]]
            lines.append(
                f"| {model} | {v} | {statistics.median(tl):.0f} ms ({max(tl):.0f}) | "
                f"{statistics.median(ud):.0f} ms ({max(ud):.0f}) |"
            )
    if "load" in result:
        lines.append(
            f"\n{os.cpu_count()} cores; load average (1 min) {result['load'][0]} at the start, "
            f"{result['load'][1]} at the end"
        )
    switches = result["switch"]
    if any(switches.values()):
        versions = sorted(switches, reverse=True)
        lines += [
            "",
            "| model | "
            + " | ".join(f"{v}: first timeline | {v}: un-dimmed" for v in versions)
            + " |",
            "|---|" + "---|---|" * len(versions),
        ]
        for model in next(iter(switches.values())):
            cells = [f"{switches[v][model][0]} s | {switches[v][model][1]} s" for v in versions]
            lines.append(f"| {model} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


@contextmanager
def served(root: Path) -> Iterator[str]:
    """`remat app`'s server from the checkout at `root`, on a free port, with an options
    cache of its own: its URL."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cache = tempfile.mkdtemp(prefix="remat-bench-cache-")
    env = {**os.environ, "PYTHONPATH": str(root), "REMAT_CACHE": cache}
    server = subprocess.Popen(
        [sys.executable, "-c", f"from app.server import serve; serve(port={port})"],
        cwd=root,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    url = f"http://127.0.0.1:{port}/"
    try:
        _wait_http(url, server)
        yield url
    finally:
        server.terminate()
        server.wait(10)
        shutil.rmtree(cache, ignore_errors=True)


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


def _wait_http(url: str, process: subprocess.Popen, timeout: float = 120) -> None:
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
    before = sys.argv[1] if len(sys.argv) > 1 else None
    switches = sys.argv[2].split(",") if len(sys.argv) > 2 else ()
    result = bench_app(before=before, switches=switches, report=lambda s: print(s, flush=True))
    print(result)
    print(app_table(result))
