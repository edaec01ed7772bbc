"""Dim only what is stale: the views that do not follow the budget and take seconds (the
trade-off curves, memory against batch) refresh under their own busy sign, never the page's.
Their work is held back by a gate here, so the order of events is certain on a loaded
machine: the page must be usable (un-dimmed, the timeline drawn) while they still wait."""

from __future__ import annotations

import threading
from collections.abc import Iterator

import pytest
from helpers import serve_in_thread

from app import ids
from app.callbacks import batch as batch_callbacks
from app.server import create_app
from bench.app import choose, slider_value, wait_calm, wait_ready

pytestmark = pytest.mark.browser

CALM = "() => !document.body.hasAttribute('data-busy')"
SIGN = "(id) => (document.getElementById(id).getAttribute('data-refreshing') || '')"


class Gate:
    """Holds back the work it wraps until opened."""

    def __init__(self) -> None:
        self.open = threading.Event()
        self.open.set()

    def wrap(self, fn):
        def held(*args, **kwargs):
            assert self.open.wait(300), "the gate was never opened"
            return fn(*args, **kwargs)

        return held


@pytest.fixture(scope="module")
def served() -> Iterator[tuple[str, Gate, Gate]]:
    app = create_app()
    studio = app.studio
    curves, batch = Gate(), Gate()
    studio.tradeoff = curves.wrap(studio.tradeoff)
    studio.offload_tradeoff = curves.wrap(studio.offload_tradeoff)
    original = batch_callbacks.batch_view
    batch_callbacks.batch_view = batch.wrap(original)
    address, stop = serve_in_thread(app)
    yield address, curves, batch
    curves.open.set()
    batch.open.set()
    stop()
    batch_callbacks.batch_view = original


def test_a_budget_move_leaves_memory_against_batch_to_its_own_busy_sign(page, served):
    url, _, batch = served
    page.set_viewport_size({"width": 1400, "height": 1000})
    page.goto(url)
    wait_ready(page, "gpt-tiny", 180_000)
    wait_calm(page, 180_000)
    batch.open.clear()
    try:
        slider = page.locator(f"#{ids.BUDGET} [role=slider]")
        slider.focus()
        target = slider_value(page) - 0.5
        page.keyboard.press("ArrowLeft")
        # the plan's views are redrawn and the page un-dims while the batch chart still waits
        page.wait_for_function(
            """(pct) => { const g = document.querySelector('#timeline .js-plotly-plot');
              return g.layout.meta.budget_pct === pct
                && !document.body.hasAttribute('data-busy'); }""",
            arg=target,
        )
        assert page.evaluate(SIGN, ids.BATCH_FIG).startswith("updating memory against batch")
        assert "batch" not in page.inner_text(f"#{ids.PROGRESS}")
    finally:
        batch.open.set()
    page.wait_for_function(f"() => !({SIGN})('{ids.BATCH_FIG}')", timeout=180_000)


def test_a_new_model_draws_its_first_timeline_before_its_curves(page, served):
    url, curves, _ = served
    page.set_viewport_size({"width": 1400, "height": 1000})
    page.goto(url)
    wait_ready(page, "gpt-tiny", 180_000)
    wait_calm(page, 180_000)
    curves.open.clear()
    try:
        choose(page, ids.MODEL, "mlp-tiny")
        wait_ready(page, "mlp-tiny")  # the timeline, while no curve is computed
        page.wait_for_function(CALM)
        assert page.evaluate(SIGN, ids.TRADEOFF).startswith("updating the trade-off curves")
    finally:
        curves.open.set()
    page.wait_for_function(
        """() => { const g = document.querySelector('#tradeoff .js-plotly-plot');
          return g.layout.meta && (g.layout.meta.for || '').startsWith('mlp-tiny|')
            && !document.getElementById('tradeoff').hasAttribute('data-refreshing'); }""",
        timeout=180_000,
    )
