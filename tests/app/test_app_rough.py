"""Rough edges of issue 38 on the page, each in a real Chromium at 1400x1000: "reveal" keeps
the lesson's chart in view, an opened block's op names read and do not overlap, "offloaded"
stays on one line in the op table, and a view the slider's request left out of sight is drawn
as it comes near (never shown stale)."""

from __future__ import annotations

from pathlib import Path

import pytest

from app import ids
from bench.app import slider_value, wait_calm, wait_ready

pytestmark = pytest.mark.browser

CY = """[document.getElementById('graph'), ...document.querySelectorAll('#graph *')]
  .find(e => e._cyreg)._cyreg.cy"""
IN_VIEW = """(id) => { const r = document.getElementById(id).getBoundingClientRect();
  return r.top >= 0 && r.bottom <= window.innerHeight; }"""


@pytest.fixture
def ready(page, url):
    page.set_viewport_size({"width": 1400, "height": 1000})
    page.goto(url)
    wait_ready(page, "gpt-tiny", 180_000)
    wait_calm(page, 180_000)
    return page


@pytest.mark.slow
def test_reveal_keeps_the_lessons_chart_in_view(ready):
    page = ready
    page.click(f"#{ids.LESSON_START}")
    for _ in range(2):  # to step 3, the first whose question is about the trade-off chart
        page.click(f"#{ids.LESSON_NEXT}")
    page.wait_for_function(
        """() => document.getElementById('lesson-title').textContent.startsWith('3/5')
          && document.querySelector('#method-value').textContent.startsWith('Rockmate')
          && !document.body.hasAttribute('data-busy')""",
        timeout=600_000,  # three analyses: at load 23 on 2 cores 180 s was not enough
    )
    page.wait_for_function(IN_VIEW, arg=ids.TRADEOFF)  # the question scrolled to the chart
    page.click(f"#{ids.LESSON_REVEAL}")
    page.locator(f"#{ids.LESSON_ANSWER}").wait_for(state="visible")
    assert page.evaluate(IN_VIEW, ids.TRADEOFF)  # the answer beside it, not a page away


def test_an_opened_blocks_op_names_read_and_do_not_overlap(ready):
    page = ready
    page.evaluate(
        f"""() => {{ {CY}.nodes().filter(n => n.data('block') === 2
          && (n.data('op') === undefined || n.data('op') === null)).emit('tap'); }}"""
    )
    # opened: its ops are in the graph and the view has zoomed to them
    page.wait_for_function(
        f"""() => {{ const cy = {CY}; const ops = cy.nodes('.op');
          return ops.length > 10 && cy.zoom() * parseFloat(ops[0].style('font-size')) >= 10; }}"""
    )
    # dash-cytoscape refits its layout 100 ms after the last element change; under load that
    # came after the zoom and undid it (CI, 2026-11-28): the zoom must survive a late refit
    page.evaluate(f"() => {{ {CY}.layout({{name: 'preset', fit: true, padding: 10}}).run(); }}")
    labels = page.evaluate(
        f"""() => {{ const cy = {CY}, z = cy.zoom();
          return cy.nodes('.op').filter(n => n.visible()).map(n => {{
            const b = n.renderedBoundingBox({{includeNodes: false, includeLabels: true}});
            return {{size: parseFloat(n.style('font-size')) * z, label: n.data('label'),
                     box: [b.x1, b.y1, b.x2, b.y2],
                     inside: b.x1 >= 0 && b.y1 >= 0 && b.x2 <= cy.width() && b.y2 <= cy.height()}};
          }}); }}"""
    )
    shown = [x for x in labels if x["inside"]]  # those in the graph's view; hover names all
    assert len(shown) >= 8, labels
    assert min(x["size"] for x in shown) >= 10  # was ~5 px
    for i, a in enumerate(shown):
        for b in shown[i + 1 :]:
            (ax1, ay1, ax2, ay2), (bx1, by1, bx2, by2) = a["box"], b["box"]
            overlap = ax1 < bx2 and bx1 < ax2 and ay1 < by2 and by1 < ay2
            assert not overlap, (a["label"], b["label"])


def test_offloaded_stays_on_one_line_in_the_op_table(page):
    # the op table as `app.callbacks.graph.block_panel` writes it, under the page's stylesheet,
    # from wide to as narrow as the panel gets
    css = (Path(__file__).resolve().parents[2] / "assets" / "app.css").read_text()
    row = (
        "<tr><td>transformer.h.0.attn · scaled attention scores</td>"
        "<td>aten._scaled_dot_product_flash_attention_for_cpu · sdpa</td>"
        "<td>64.0 KiB</td><td class='fate offloaded'>offloaded</td></tr>"
    )
    page.set_content(
        f"<style>{css}</style><div id='panel' class='block-panel'><table class='ops'>"
        f"<thead><tr><th>op</th><th>ATen op</th><th>allocates</th><th>plan</th></tr></thead>"
        f"<tbody>{row * 3}</tbody></table></div>"
    )
    for width in range(200, 801, 60):
        lines = page.evaluate(
            """(w) => { document.getElementById('panel').style.width = w + 'px';
              const td = document.querySelector('td.fate');
              const r = document.createRange(); r.selectNodeContents(td);
              return new Set([...r.getClientRects()].map(q => Math.round(q.top))).size; }""",
            width,
        )
        assert lines == 1, width  # not "offloa|ded"


def test_a_view_left_out_of_sight_is_drawn_as_it_comes_near(ready):
    page = ready
    slider = page.locator(f"#{ids.BUDGET} [role=slider]")
    slider.focus()
    page.evaluate("() => window.scrollTo(0, 0)")
    target = slider_value(page) - 0.5
    page.keyboard.press("ArrowLeft")
    plan = "() => document.getElementById('numbers').getAttribute('data-for')"
    page.wait_for_function(
        f"(v) => ({plan})().endsWith('|' + v) && !document.body.hasAttribute('data-busy')",
        arg=target,
    )
    sig = page.evaluate(plan)
    arena = "() => (document.querySelector('#arena .js-plotly-plot').layout.meta || {}).for"
    assert page.evaluate(arena) != sig  # far below the fold: left for later
    # scrolled to, it is stale in sight: the page is busy until it is drawn for the plan
    page.evaluate(
        """() => { window.__shown_stale = false;
          const gd = () => document.querySelector('#arena .js-plotly-plot');
          const watch = () => { const r = document.getElementById('arena').getBoundingClientRect();
            const seen = r.top < window.innerHeight && r.bottom > 0;
            const drawn = (gd().layout.meta || {}).for === document.getElementById('numbers')
              .getAttribute('data-for');
            if (seen && !drawn && !document.body.hasAttribute('data-busy')) {
              window.__shown_stale = true; }
            if (!drawn) { requestAnimationFrame(watch); } };
          requestAnimationFrame(watch);
          document.getElementById('arena').scrollIntoView({block: 'center'}); }"""
    )
    page.wait_for_function(f"(s) => ({arena})() === s", arg=sig)
    assert not page.evaluate("() => window.__shown_stale")
    wait_calm(page)
