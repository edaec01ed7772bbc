"""One screen: at 1400x1000 the step's explanation, the timeline's marker and the graph's
highlighted op are in the viewport together; at 1000x700 no chart's legend covers an axis
title. Bounding boxes measured in a real Chromium."""

from __future__ import annotations

import pytest

from app import ids
from app.figures import T_MARKER
from bench.app import choose, painted, wait_ready

pytestmark = pytest.mark.browser

CY = """[document.getElementById('graph'), ...document.querySelectorAll('#graph *')]
  .find(e => e._cyreg)._cyreg.cy"""
# the running op (drawn large) in page coordinates: the container's box plus its rendered box
HIGHLIGHT = f"""() => {{ const cy = {CY};
  const n = cy.nodes('.op').filter(n => n.numericStyle('width') > 20)[0]
    || cy.nodes('.layer').filter(n => n.numericStyle('border-width') >= 8)[0];
  if (!n) return null;
  const c = cy.container().getBoundingClientRect(), b = n.renderedBoundingBox();
  return {{x: c.x + b.x1, y: c.y + b.y1, width: b.w, height: b.h}}; }}"""
MARKER = f"""() => {{ const t = document.querySelectorAll('#timeline .scatterlayer .trace')[{T_MARKER}];
  const p = t && t.querySelector('.js-line');
  if (!p) return null; const r = p.getBoundingClientRect();
  return {{x: r.x, y: r.y, width: r.width, height: r.height}}; }}"""
# every legend and axis title of every chart, as boxes
LABELS = """() => [...document.querySelectorAll('.js-plotly-plot')].flatMap(g => {
  const box = (e) => { const r = e.getBoundingClientRect();
    return {x: r.x, y: r.y, width: r.width, height: r.height}; };
  const id = g.closest('[id]').id;
  return [...g.querySelectorAll('.legend .bg')].map(e => ({id, kind: 'legend', ...box(e)}))
    .concat([...g.querySelectorAll('.xtitle, .ytitle')].map(e => ({id, kind: 'title', ...box(e)})));
})"""


def inside(box: dict, width: int, height: int) -> bool:
    return (
        box is not None
        and box["width"] + box["height"] > 0  # a line has no width
        and box["x"] >= 0
        and box["y"] >= 0
        and box["x"] + box["width"] <= width
        and box["y"] + box["height"] <= height
    )


def overlap(a: dict, b: dict) -> bool:
    return (
        a["x"] < b["x"] + b["width"]
        and b["x"] < a["x"] + a["width"]
        and a["y"] < b["y"] + b["height"]
        and b["y"] < a["y"] + a["height"]
    )


def open_page(page, url, width: int, height: int) -> None:
    page.set_viewport_size({"width": width, "height": height})
    page.goto(url)
    wait_ready(page, "gpt-tiny")
    page.wait_for_function("() => !document.body.hasAttribute('data-busy')")


def test_step_text_marker_and_graph_highlight_share_the_screen_at_1400x1000(page, url):
    warnings = []
    page.on("console", lambda m: warnings.append(m.text) if m.type == "warning" else None)
    open_page(page, url, 1400, 1000)
    assert not [w for w in warnings if "wheel sensitivity" in w], warnings
    rows = page.evaluate(
        "(id) => [...document.getElementById(id).parentElement.querySelectorAll(':scope > button')]"
        ".map(b => { const r = b.getBoundingClientRect(); return [r.top, r.bottom]; })",
        ids.STEP_RESET,
    )
    assert max(t for t, _ in rows) < min(b for _, b in rows), rows  # one row: no wrapping
    page.locator(f"#{ids.GRAPH_CARD}").evaluate("(e) => e.scrollIntoView({block: 'start'})")
    for _ in range(4):
        page.click(f"#{ids.STEP_NEXT}")
    page.wait_for_function(
        "() => document.querySelector('#step-text').textContent.startsWith('step 4 ')"
    )
    page.wait_for_function(f"() => ({MARKER})() !== null && ({HIGHLIGHT})() !== null")
    painted(page)  # the marker's repaint
    boxes = {
        "step text": page.locator(f"#{ids.STEP_WHY}").bounding_box(),
        "marker": page.evaluate(MARKER),
        "highlight": page.evaluate(HIGHLIGHT),
    }
    out = {k: b for k, b in boxes.items() if not inside(b, 1400, 1000)}
    assert not out, out
    assert page.locator(f"#{ids.TRANSFER_LANE}").is_hidden()  # offloading is off


def test_no_legend_covers_an_axis_title_at_1000x700(page, url):
    open_page(page, url, 1000, 700)
    page.click(f"#{ids.OFFLOAD} input[type=checkbox]")  # the transfer lane too
    page.wait_for_function(
        "() => !document.body.hasAttribute('data-busy') && "
        "document.querySelector('#tradeoff .js-plotly-plot').data.some(t => t.meta === 'offload')",
        timeout=180_000,
    )
    assert page.locator(f"#{ids.TRANSFER_LANE}").is_visible()
    labels = page.evaluate(LABELS)
    assert {b["id"] for b in labels if b["kind"] == "legend"} >= {"timeline", "tradeoff"}
    hits = [
        (a["id"], b)
        for a in labels
        if a["kind"] == "legend"
        for b in labels
        if b["kind"] == "title" and b["id"] == a["id"] and overlap(a, b)
    ]
    assert not hits, hits
    code = page.locator(f"#{ids.EXPORT_CODE}")
    assert code.evaluate("(e) => e.scrollWidth <= e.clientWidth")  # the export code not clipped


# the transfer lane's caption and row names against the chart's own box
CAPTION = """() => { const g = document.querySelector('#transfers .js-plotly-plot');
  const box = (e) => { const r = e.getBoundingClientRect();
    return {x: r.x, y: r.y, width: r.width, height: r.height}; };
  const texts = [...g.querySelectorAll('.gtitle, .ytick text, .xtitle')];
  return {chart: box(g), texts: texts.map(e => ({text: e.textContent, ...box(e)}))}; }"""


@pytest.mark.parametrize("size", [(1400, 1000), (1200, 800), (1000, 700)])
def test_the_transfer_lane_caption_is_whole(page, url, size):
    open_page(page, url, *size)
    choose(page, ids.DEVICE, "rtx4090")  # the longest preset name in the caption
    page.click(f"#{ids.OFFLOAD} input[type=checkbox]")
    page.wait_for_function("() => document.body.hasAttribute('data-busy')")
    page.wait_for_function("() => !document.body.hasAttribute('data-busy')", timeout=180_000)
    page.locator(f"#{ids.BUDGET} [role=slider]").focus()
    page.keyboard.press("Home")  # the smallest budget: the most copies
    page.wait_for_function(
        "() => !document.body.hasAttribute('data-busy') && (() => {"
        " const g = document.querySelector('#transfers .js-plotly-plot');"
        " return g && g.layout.meta && g.layout.meta.copies > 0; })()",
        timeout=180_000,
    )
    got = page.evaluate(CAPTION)
    chart = got["chart"]
    assert any("offloaded" in t["text"] for t in got["texts"]), got
    cut = [
        t["text"]
        for t in got["texts"]
        if t["x"] < chart["x"] - 0.5
        or t["y"] < chart["y"] - 0.5
        or t["x"] + t["width"] > chart["x"] + chart["width"] + 0.5
        or t["y"] + t["height"] > chart["y"] + chart["height"] + 0.5
    ]
    assert not cut, (cut, chart, [t for t in got["texts"] if t["text"] in cut])
