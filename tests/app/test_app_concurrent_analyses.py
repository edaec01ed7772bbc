"""The page across analyses, in headless Chromium: model switches redraw the graph, pages
opened at once all load, a setting changed while an analysis runs is applied."""

from __future__ import annotations

import pytest
from helpers import serve_in_thread

from app import figures, ids
from app.server import create_app
from bench.app import choose, wait_ready
from core.naming import block_title, op_name

pytestmark = pytest.mark.browser

CY = """() => [document.getElementById('graph'), ...document.querySelectorAll('#graph *')]
  .find(e => e._cyreg) ._cyreg.cy"""


@pytest.fixture(scope="module")
def served():
    app = create_app()
    address, stop = serve_in_thread(app)
    yield app, address
    stop()


def errors_of(page) -> list[str]:
    """Collect the page's uncaught errors and console errors as they happen."""
    seen: list[str] = []
    page.on("pageerror", lambda err: seen.append(str(err)))
    page.on("console", lambda msg: msg.type == "error" and seen.append(msg.text))
    return seen


def test_switching_models_redraws_the_graph_without_errors(served, page):
    app, url = served
    seen = errors_of(page)
    page.set_viewport_size({"width": 1400, "height": 1000})
    page.goto(url)
    wait_ready(page, "gpt-tiny")
    for model in ("mlp-tiny", "resnet-tiny", "gpt-tiny"):
        choose(page, ids.MODEL, model)
        wait_ready(page, model, 180_000)
        problem = app.studio.problem(app.studio.key(model, "estimated", "cpu"))
        graph = problem.graph
        expected = figures.graph_elements(
            problem.blocks,
            graph.ops,
            graph.values,
            names=[op_name(graph, o.index) for o in graph.ops],
            titles=[block_title(graph, b) for b in problem.blocks],
        )
        want = sorted(e["data"]["label"] for e in expected if "source" not in e["data"])
        page.wait_for_function(f"(n) => ({CY})().nodes().length === n", arg=len(want))
        got = sorted(page.evaluate(f"() => ({CY})().nodes().map(n => n.data('label'))"))
        assert got == want  # no stale node of an earlier model
        assert page.locator(f"#{ids.MODEL}").inner_text().strip() == model  # no snap back
    assert seen == []


def test_five_pages_opened_at_once_all_load(served, browser):
    _, url = served
    contexts = [browser.new_context(viewport={"width": 1200, "height": 900}) for _ in range(5)]
    pages = [c.new_page() for c in contexts]
    for page in pages:
        page.goto(url, wait_until="commit")
    for page in pages:
        wait_ready(page, "gpt-tiny")
    for c in contexts:
        c.close()


def test_a_setting_changed_during_an_analysis_is_applied(served, page):
    _, url = served
    page.set_viewport_size({"width": 1400, "height": 1000})
    page.goto(url)
    wait_ready(page, "gpt-tiny")
    choose(page, ids.DEVICE, "rtx4090")
    page.locator(f"#{ids.PROGRESS}").wait_for(state="visible")
    choose(page, ids.DEVICE, "v100")  # while rtx4090's analysis runs
    page.wait_for_function(
        "() => /v100/i.test(document.querySelector('#intro').textContent)", timeout=180_000
    )
    choose(page, ids.DEVICE, "a100")
    page.locator(f"#{ids.PROGRESS}").wait_for(state="visible")
    page.check(f"#{ids.COSTS} input[value=measured]")  # while a100's analysis runs
    page.wait_for_function(
        "() => /measured/i.test(document.querySelector('#intro').textContent)", timeout=180_000
    )
