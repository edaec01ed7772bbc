"""A budget move draws "Will it fit?" (the footprint chart and its words) in the slider's
`paint` request, beside the plan's other views: it followed the PLAN store, which the `solve`
request sets, so it came one round trip after them."""

from __future__ import annotations

import json

import pytest

from app import ids
from bench.app import wait_calm, wait_ready

pytestmark = pytest.mark.browser


def _outputs(request) -> set[str]:
    """The "id.property" outputs a Dash callback request asks for (empty for other requests)."""
    if "_dash-update-component" not in request.url or not request.post_data:
        return set()
    outputs = json.loads(request.post_data).get("outputs", [])
    outputs = outputs if isinstance(outputs, list) else [outputs]
    return {f"{o['id']}.{o['property']}" for o in outputs if isinstance(o.get("id"), str)}


def test_a_budget_move_draws_the_footprint_with_the_plans_other_views(page, url):
    page.set_viewport_size({"width": 1400, "height": 1000})
    page.goto(url)
    wait_ready(page, "gpt-tiny", 300_000)
    wait_calm(page, 300_000)
    page.locator(f"#{ids.FIT}").scroll_into_view_if_needed()
    wait_calm(page, 300_000)
    asked: list[set[str]] = []
    page.on("request", lambda r: asked.append(_outputs(r)))
    slider = page.locator(f"#{ids.BUDGET} [role=slider]")
    slider.focus()
    page.keyboard.press("ArrowLeft")
    # the chart drawn for the new budget (its meta.for is the plan's controls, budget last)
    page.wait_for_function(
        """() => { const g = document.querySelector('#FIT .js-plotly-plot');
          const now = document.querySelector('#budget [role=slider]').getAttribute('aria-valuenow');
          const f = g && g.layout && g.layout.meta ? g.layout.meta.for || '' : '';
          return f.split('|').pop() === String(Number(now)); }""".replace("FIT", ids.FIT),
        timeout=120_000,
    )
    wait_calm(page, 120_000)
    fit = f"{ids.FIT}.figure"
    with_fit = [a for a in asked if fit in a]
    assert len(with_fit) == 1, f"the footprint was asked for {len(with_fit)} times: {with_fit}"
    # the graph's outlines (stylesheet, maybe with Dash's "@hash" of a duplicate output)
    assert any(o.startswith(f"{ids.GRAPH}.stylesheet") for o in with_fit[0]), (
        f"the footprint came in a request of its own: {sorted(with_fit[0])}"
    )
