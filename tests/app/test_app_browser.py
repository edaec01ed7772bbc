"""The app in a real headless Chromium (pytest-playwright, Debian's chromium; see conftest)."""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest

import core
from app import ids
from bench.app import choose, painted, slider_value, wait_ready
from core.errors import fmt_bytes

pytestmark = pytest.mark.browser
# screenshots go to test-results/ (ignored); REMAT_SCREENSHOTS=docs refreshes the README's
SHOTS = Path(__file__).resolve().parents[2] / (
    "docs/screenshots" if os.environ.get("REMAT_SCREENSHOTS") == "docs" else "test-results"
)
SHOTS.mkdir(exist_ok=True)

# the timeline's figure, as plotly holds it in the page
FIG = "() => { const g = document.querySelector('#timeline .js-plotly-plot'); return {data: g.data, meta: g.layout.meta}; }"
CY = """() => [document.getElementById('graph'), ...document.querySelectorAll('#graph *')]
  .find(e => e._cyreg) ._cyreg.cy"""


@pytest.fixture
def ready(page, url):
    page.set_viewport_size({"width": 1400, "height": 1100})
    page.goto(url)
    wait_ready(page, "gpt-tiny")
    page.wait_for_function("() => document.querySelector('#num-peak').textContent !== '–'")
    assert page.inner_text(f"#{ids.NATIVE_PEAK}").endswith("B")  # the plan run natively
    return page


def figure(page) -> dict:
    return page.evaluate(FIG)


def trace(fig: dict, meta: str) -> dict:
    return next(t for t in fig["data"] if t.get("meta") == meta)


def press(page, key: str) -> None:
    """Press `key` on the budget slider and wait for the timeline drawn for the new value."""
    page.locator(f"#{ids.BUDGET} [role=slider]").focus()
    page.keyboard.press(key)
    page.wait_for_function(
        """(v) => { const g = document.querySelector('#timeline .js-plotly-plot');
          return g.layout.meta && g.layout.meta.budget_pct === v; }""",
        arg=slider_value(page),
    )


def card(page, id_: str):
    """The card holding component `id_` (for screenshots of one view)."""
    return page.locator(f"#{id_}").locator("xpath=ancestor::div[contains(@class, 'card')][1]")


def graph_nodes(page, selector: str) -> int:
    return page.evaluate(f"() => ({CY})().nodes('{selector}').length")


def test_page_shows_blocks_timeline_and_numbers(ready):
    page = ready
    blocks = graph_nodes(page, ".layer")
    assert blocks >= 3  # gpt-tiny: embeddings, two layers, head
    assert graph_nodes(page, ".op") == 0  # at module level: a layer is one node
    assert "gpt-tiny" in page.inner_text(f"#{ids.INTRO}")
    fig = figure(page)
    kinds = [t["name"] for t in fig["data"][:3]]
    assert kinds == ["activations", "temporaries", "gradients"]
    assert all(t.get("stackgroup") == "live" for t in fig["data"][:3])
    SHOTS.mkdir(parents=True, exist_ok=True)
    painted(page)
    page.screenshot(path=str(SHOTS / "app.png"), full_page=True)


def test_slider_keyboard_re_solves_and_peak_stays_under_budget(ready):
    page = ready
    press(page, "End")
    assert slider_value(page) == 100
    assert page.inner_text(f"#{ids.OVERHEAD}") == "0.0%"
    at_full = figure(page)
    press(page, "Home")  # the smallest feasible budget
    low = slider_value(page)
    assert low < 100
    for _ in range(3):
        press(page, "ArrowRight")
    assert slider_value(page) == low + 1.5
    fig = figure(page)
    budget = trace(fig, "budget")["y"][0]
    peak = trace(fig, "peak")["y"][0]
    assert budget < trace(at_full, "budget")["y"][0]
    assert fig["data"][0]["y"] != at_full["data"][0]["y"]  # the timeline changed
    assert peak <= budget
    assert page.inner_text(f"#{ids.OVERHEAD}") != "0.0%"
    assert int(page.inner_text(f"#{ids.RECOMPUTED}")) > 0


def curves_drawn(page) -> None:
    """Until the trade-off chart, a job of its own after the first timeline, is drawn."""
    page.wait_for_function(
        """() => { const g = document.querySelector('#tradeoff .js-plotly-plot');
          return !!(g && g.data && g.data.length > 0 && g.layout.meta
            && !document.getElementById('tradeoff').hasAttribute('data-refreshing')); }""",
        timeout=180_000,
    )


def test_clicking_the_tradeoff_curve_sets_the_budget(ready):
    page = ready
    curves_drawn(page)
    points = page.locator(f"#{ids.TRADEOFF} .scatterlayer .trace:first-child .points path")
    assert points.count() >= 3
    target = page.evaluate("() => document.querySelector('#tradeoff .js-plotly-plot').data[0].x[2]")
    points.nth(2).scroll_into_view_if_needed()
    box = points.nth(2).bounding_box()
    page.mouse.click(box["x"] + box["width"] / 2, box["y"] + box["height"] / 2)
    expected = round(target * 2) / 2
    page.wait_for_function(
        "(v) => document.querySelector('#timeline .js-plotly-plot').layout.meta.budget_pct === v",
        arg=expected,
    )
    assert slider_value(page) == expected


def test_the_tradeoff_chart_shades_the_budgets_no_plan_meets(ready):
    """gpt-tiny's floor: the loss's softmax backward holds three 256 KiB tensors at once,
    19.0% of its store-all peak; the band ends there and its label names the op."""
    page = ready
    curves_drawn(page)
    layout = page.evaluate("() => document.querySelector('#tradeoff .js-plotly-plot').layout")
    band = layout["shapes"][1]
    assert band["type"] == "rect" and band["x0"] == 0 and round(band["x1"], 1) == 19.0
    label = page.locator(f"#{ids.TRADEOFF} .annotation-text").first.text_content()
    assert "no plan below 19.0%" in label and "_log_softmax_backward_data" in label
    card(page, ids.TRADEOFF).screenshot(path=str(SHOTS / "tradeoff-floor.png"))


def test_export_downloads_a_plan_that_loads(ready, tmp_path):
    page = ready
    press(page, "ArrowLeft")
    shown_peak = page.inner_text(f"#{ids.PEAK}")
    with page.expect_download() as download:
        page.click(f"#{ids.EXPORT}")
    path = tmp_path / "plan.pkl"
    download.value.save_as(path)
    plan = core.load_plan(str(path))
    assert fmt_bytes(plan.predicted_peak) == shown_peak
    code = page.inner_text(f"#{ids.EXPORT_CODE}")
    assert 'core.load_plan("plan.pkl")' in code and "core.apply_plan(model, plan)" in code


def test_step_through_moves_the_highlight(ready):
    page = ready
    page.click(f"#{ids.STEP_NEXT}")
    page.wait_for_function(
        "() => document.querySelector('#step-text').textContent.startsWith('step 1 ')"
    )
    first = page.inner_text(f"#{ids.STEP_WHY}")
    assert "block" in first
    # the step text and the timeline's marker are separate updates: wait for the marker too
    page.wait_for_function(
        "() => { const g = document.querySelector('#timeline .js-plotly-plot');"
        " const m = g && g.data.find(t => t.meta === 'marker'); return m && m.x.length > 0; }"
    )
    marker = trace(figure(page), "marker")["x"]
    assert marker[0] == 1  # "step 1" sits at 1 on the axis: both count from 1
    for _ in range(3):
        page.click(f"#{ids.STEP_NEXT}")
    page.wait_for_function(
        "() => document.querySelector('#step-text').textContent.startsWith('step 4 ')"
    )
    page.wait_for_function(
        "(x) => { const g = document.querySelector('#timeline .js-plotly-plot');"
        " const m = g.data.find(t => t.meta === 'marker'); return m.x[0] !== x; }",
        arg=marker[0],
    )
    # the running layer, closed, is drawn thick in the marker's colour (one layer)
    page.wait_for_function(
        f"() => ({CY})().nodes('.layer').filter(n => n.numericStyle('border-width') >= 8)"
        ".length === 1"
    )
    block = page.evaluate(
        f"() => ({CY})().nodes('.layer').filter(n => n.numericStyle('border-width') >= 8)"
        "[0].data('block')"
    )
    open_layer(page, block)
    page.wait_for_function(  # opened, the running op is drawn large and highlighted
        f"() => ({CY})().nodes('.op').filter(n => n.numericStyle('width') > 20).length > 0"
    )
    page.click(f"#{ids.PLAY}")
    page.wait_for_function(
        "() => parseInt(document.querySelector('#step-text').textContent.split(' ')[1]) > 5"
    )
    page.click(f"#{ids.PLAY}")
    page.screenshot(path=str(SHOTS / "step-through.png"), full_page=True)


def open_layer(page, block: int) -> None:
    """Click layer `block` in the block graph (closed) and wait for its ops."""
    if page.evaluate(f"() => ({CY})().nodes('.block').some(n => n.data('block') === {block})"):
        return  # already open
    page.evaluate(
        f"() => {{ ({CY})().nodes('.layer').filter(n => n.data('block') === {block}).emit('tap'); }}"
    )
    page.wait_for_function(
        f"(b) => ({CY})().nodes('.op').some(n => n.data('block') === b)", arg=block
    )


def test_clicking_a_layer_opens_it_into_its_ops_and_again_closes_it(ready):
    page = ready
    layers = graph_nodes(page, ".layer")
    page.evaluate(
        f"() => {{ ({CY})().nodes('.layer').filter(n => n.data('block') === 1).emit('tap'); }}"
    )
    page.wait_for_function(f"() => ({CY})().nodes('.op').length > 0")
    ops = page.evaluate(f"() => ({CY})().nodes('.op').map(n => [n.data('block'), n.parent().id()])")
    box = page.evaluate(f"() => ({CY})().nodes('.block').map(n => n.id())")
    assert len(box) == 1 and all(b == 1 and parent == box[0] for b, parent in ops)
    assert graph_nodes(page, ".layer") == layers - 1  # the others stay closed
    page.wait_for_selector(f"#{ids.BLOCK_PANEL} table.ops")
    assert re.search(r"block 1 · ", page.inner_text(f"#{ids.BLOCK_PANEL}"))
    rows = page.locator(f"#{ids.BLOCK_PANEL} tbody tr").count()
    assert rows >= len(ops)  # its forward ops (and its backward ones) listed
    page.evaluate(f"() => {{ ({CY})().nodes('.block').emit('tap'); }}")  # its box: close it
    page.wait_for_function(f"(n) => ({CY})().nodes('.layer').length === n", arg=layers)
    assert graph_nodes(page, ".op") == 0


def test_an_untraceable_model_shows_its_error(ready):
    page = ready
    choose(page, ids.MODEL, "untraceable")
    error = page.locator(f"#{ids.ERROR}")
    error.wait_for(state="visible")
    assert "cannot be traced" in error.inner_text()
    page.screenshot(path=str(SHOTS / "error.png"))
    choose(page, ids.MODEL, "gpt-tiny")  # the app stays up
    error.wait_for(state="hidden")


def type_budget(page, text: str) -> None:
    box = page.locator(f"#{ids.BUDGET_INPUT}")
    box.fill(text)
    box.press("Enter")


def test_typed_budgets_commit_on_enter_and_out_of_range_ones_say_the_minimum(ready):
    page = ready
    message = page.locator(f"#{ids.BUDGET_MESSAGE}")
    low = page.evaluate("() => document.querySelector('#budget [role=slider]').ariaValueMin")
    for bad in ("abc", "0", "-5", str(float(low) - 1)):
        type_budget(page, bad)
        message.wait_for(state="visible")
        text = message.inner_text()
        assert f"from {float(low):g}% (" in text, text  # names the minimum, in % and bytes
        assert "NaN" not in page.inner_text(f"#{ids.BUDGET_BYTES}")
    type_budget(page, "90")  # Enter alone commits: no blur
    page.wait_for_function(
        "() => document.querySelector('#timeline .js-plotly-plot').layout.meta.budget_pct === 90"
    )
    assert slider_value(page) == 90
    message.wait_for(state="hidden")


@pytest.mark.parametrize("size", [(1400, 1000), (1000, 700)])
def test_the_typed_box_shows_a_whole_budget_and_follows_the_slider(ready, size):
    """The box holds "100.0" without scrolling at both sizes; moving the slider writes its
    value in the box, and a typed value moves the slider (one callback, no loop)."""
    page = ready
    page.set_viewport_size({"width": size[0], "height": size[1]})
    box = page.locator(f"#{ids.BUDGET_INPUT}")
    box.fill("100.0")
    scroll, client = box.evaluate("(e) => [e.scrollWidth, e.clientWidth]")
    assert scroll <= client, (scroll, client)  # all five characters in view
    press(page, "End")
    page.wait_for_function(
        "(id) => document.getElementById(id).value === '100'", arg=ids.BUDGET_INPUT
    )
    press(page, "ArrowLeft")
    press(page, "ArrowLeft")
    page.wait_for_function(
        "(id) => document.getElementById(id).value === '99'", arg=ids.BUDGET_INPUT
    )
    type_budget(page, "55.3")  # typed: the slider follows, at its 0.5% step
    page.wait_for_function(
        "() => document.querySelector('#timeline .js-plotly-plot').layout.meta.budget_pct === 55.5"
    )
    assert slider_value(page) == 55.5 and box.input_value() == "55.5"
    press(page, "ArrowRight")
    page.wait_for_function(
        "(id) => document.getElementById(id).value === '56'", arg=ids.BUDGET_INPUT
    )


def test_next_copy_is_enabled_only_on_a_plan_with_copies(ready):
    page = ready
    jump = page.locator(f"#{ids.JUMP_TRANSFER}")
    assert jump.is_disabled()  # offloading off: no copies to jump to
    page.click(f"#{ids.OFFLOAD} input[type=checkbox]")
    page.wait_for_function("(id) => !document.getElementById(id).disabled", arg=ids.JUMP_TRANSFER)
    press(page, "End")  # the store-all budget: offloading needs no copy
    page.wait_for_function("(id) => document.getElementById(id).disabled", arg=ids.JUMP_TRANSFER)
    press(page, "Home")  # the smallest budget with offloading: copies again
    page.wait_for_function("(id) => !document.getElementById(id).disabled", arg=ids.JUMP_TRANSFER)
    page.click(f"#{ids.OFFLOAD} input[type=checkbox]")  # off: remat alone, no copies
    page.wait_for_function("(id) => document.getElementById(id).disabled", arg=ids.JUMP_TRANSFER)


def test_jumps_to_the_peak_and_to_the_next_recompute(ready):
    page = ready
    press(page, "Home")  # the smallest budget: some ops are recomputed
    page.click(f"#{ids.JUMP_PEAK}")
    fig = figure(page)
    peak_x = trace(fig, "peak")["x"][0]
    page.wait_for_function(
        "(s) => document.querySelector('#step-text').textContent.startsWith(`step ${s} `)",
        arg=peak_x,  # the axis counts from 1, as the step text does
    )
    page.click(f"#{ids.JUMP_RECOMPUTE}")
    page.wait_for_function(
        "() => document.querySelector('#step-why').textContent.startsWith('Recompute')"
    )
    hover = page.evaluate(
        "() => document.querySelector('#timeline .js-plotly-plot').data[0].text[0]"
    )
    assert hover.startswith("step 1:")  # the hover counts from 1, as the stepper does


def test_per_tensor_view_names_each_storage_and_the_peak_lists_what_sets_it(ready):
    page = ready
    press(page, "Home")  # a plan that recomputes
    tensors = "document.querySelector('#tensors .js-plotly-plot')"
    page.locator("#tensors").scroll_into_view_if_needed()  # drawn as it comes into sight
    page.wait_for_function(f"() => {tensors}.data.length > 5")
    texts = page.evaluate(f"() => {tensors}.data.flatMap(t => t.text ? [].concat(t.text) : [])")
    assert any("made by" in t and ".py:" in t and "recomputed" in t for t in texts)
    page.locator("#tensors").scroll_into_view_if_needed()
    # point at a band: the middle of a stretch of one, where its words are
    x, y = page.evaluate(
        f"""() => {{ const g = {tensors}, t = g.data.find(d => d.meta === 'hover');
          const i = t.text.findIndex(s => s.includes('made by'));
          const r = g.querySelector('.nsewdrag').getBoundingClientRect();
          return [r.left + g._fullLayout.xaxis.l2p(t.x[i]),
                  r.top + g._fullLayout.yaxis.l2p(t.y[i])]; }}"""
    )
    page.mouse.move(x, y)
    page.locator("#tensors .hoverlayer .hovertext").first.wait_for()
    assert "made by" in page.locator("#tensors .hoverlayer").text_content()
    card(page, ids.TENSORS).screenshot(path=str(SHOTS / "tensors.png"))
    page.click(f"#{ids.JUMP_PEAK}")
    peak_list = page.locator(f"#{ids.PEAK_LIST}")
    peak_list.locator("li").first.wait_for()
    assert "This is the peak" in peak_list.inner_text()
    assert peak_list.locator("li").count() >= 2


def test_measure_here_draws_the_real_run_over_the_prediction(ready):
    page = ready
    press(page, "Home")
    page.click(f"#{ids.MEASURE}")
    page.wait_for_function(
        "() => document.querySelector('#timeline .js-plotly-plot').data"
        ".some(t => t.meta === 'measured')",
    )
    fig = figure(page)
    measured = trace(fig, "measured")
    predicted_peak = trace(fig, "peak")["y"][0]
    assert abs(max(measured["y"]) - predicted_peak) < 1e-3  # +4 bytes, below the rounding
    assert "measured peak" in page.inner_text(f"#{ids.MEASURE_TEXT}")
    page.locator(f"#{ids.TIMELINE}").scroll_into_view_if_needed()
    card(page, ids.TIMELINE).screenshot(path=str(SHOTS / "measured.png"))


def test_pointing_at_an_op_names_it(ready):
    page = ready
    open_layer(page, 1)
    page.evaluate(f"() => {{ ({CY})().nodes('.op')[3].emit('mouseover'); }}")
    page.wait_for_function(
        "() => /allocates/.test(document.querySelector('#graph-hover').textContent)"
    )
    hover = page.inner_text(f"#{ids.GRAPH_HOVER}")
    assert " · " in hover and "aten." in hover  # module · kind in words, the ATen op second
    assert hover.index(" · ") < hover.index("aten.")


def test_block_titles_name_modules_and_never_overlap(ready):
    page = ready
    titles = page.evaluate(
        f"() => ({CY})().nodes('.block, .layer').map(n => [n.data('label'),"
        " n.boundingBox({includeNodes: false, includeEdges: false, includeLabels: true})])"
    )
    assert any("transformer.h.0" in t for t, _ in titles)
    for i, (a, p) in enumerate(titles):
        for b, q in titles[i + 1 :]:
            apart = (
                p["x2"] <= q["x1"] or q["x2"] <= p["x1"] or p["y2"] <= q["y1"] or q["y2"] <= p["y1"]
            )
            assert apart, (a, b)


def test_arena_view_places_every_storage_and_names_fragmentation(ready):
    """The address-by-time view: each storage a rectangle at its arena offset, the arena's
    size and the live peak drawn, hover naming the op and module that made the storage."""
    page = ready
    press(page, "Home")  # a plan that recomputes
    arena = "document.querySelector('#arena .js-plotly-plot')"
    page.locator("#arena").scroll_into_view_if_needed()  # drawn as it comes into sight
    page.wait_for_function(f"() => {arena} && {arena}.data.length >= 5")
    fig = page.evaluate(
        f"() => ({{names: {arena}.data.map(t => t.name), title: {arena}.layout.title.text,"
        f" bars: {arena}.data.filter(t => t.type === 'bar')"
        f".map(t => t.customdata.length).reduce((a, b) => a + b, 0),"
        f" texts: {arena}.data.flatMap(t => t.text || [])}})"
    )
    assert any(n.startswith("arena ") for n in fig["names"])
    assert any(n.startswith("live peak ") for n in fig["names"])
    assert "x the live peak" in fig["title"] and fig["bars"] > 10
    assert all("made by" in t and "offset" in t for t in fig["texts"])
    card(page, ids.ARENA).screenshot(path=str(SHOTS / "arena.png"))


def test_the_offload_switch_draws_host_bytes_the_transfer_lane_and_a_second_curve(ready):
    page = ready
    page.click(f"#{ids.OFFLOAD} input[type=checkbox]")
    # the remat+offload curve takes seconds (unless an earlier test left it cached): the page
    # is busy until the curve is drawn
    page.wait_for_function("() => document.body.hasAttribute('data-busy')")
    page.wait_for_function(
        """() => { const g = document.querySelector('#tradeoff .js-plotly-plot');
          return g && g.data.some(t => t.meta === 'offload'); }""",
    )
    traces = page.evaluate(
        "() => document.querySelector('#tradeoff .js-plotly-plot').data.map(t => [t.meta, t.x])"
    )
    # the strategies users run are points drawn over every curve
    curves = [t for t in traces if not str(t[0]).startswith("strategy:")]
    assert curves[-1][0] == "offload"  # the current curve on top of the other curves
    offload, remat = curves[-1][1], dict(curves)["rockmate"]
    assert offload[0] < remat[0]  # offloading fits a lower budget than recomputation alone
    assert "Dashed: remat + offload" in page.inner_text(f"#{ids.TRADEOFF_NOTE}")
    page.wait_for_function(
        """() => { const g = document.querySelector('#transfers .js-plotly-plot');
          return g && g.layout.meta && g.layout.meta.copies > 0; }"""
    )
    lane = page.evaluate("() => document.querySelector('#transfers .js-plotly-plot').layout")
    assert "the cpu preset's, device→host 17.5 GB/s" in lane["meta"]["link"]
    assert page.locator(f"#{ids.TRANSFERS} .barlayer .point").count() == lane["meta"]["copies"]
    page.wait_for_function(
        "() => document.querySelector('#timeline .js-plotly-plot').data.some(t => t.meta === 'host')"
    )
    assert page.inner_text(f"#{ids.HOST}") not in ("–", "0 B")
    page.click(f"#{ids.JUMP_TRANSFER}")
    page.wait_for_function(
        "(id) => document.getElementById(id).textContent.startsWith('Offload ')", arg=ids.STEP_WHY
    )
    assert "Why offload rather than recompute" in page.inner_text(f"#{ids.STEP_WHY}")
    page.evaluate("() => window.scrollTo(0, 0)")  # bounding boxes in page coordinates
    top = page.locator(f"#{ids.TIMELINE}").bounding_box()
    end = page.locator(f"#{ids.STEP_WHY}").bounding_box()
    height = end["y"] + end["height"] - top["y"]
    clip = {"x": top["x"], "y": top["y"], "width": top["width"], "height": height}
    page.screenshot(path=str(SHOTS / "offload.png"), clip=clip, full_page=True)
    card(page, ids.TRADEOFF).screenshot(path=str(SHOTS / "offload-tradeoff.png"))
