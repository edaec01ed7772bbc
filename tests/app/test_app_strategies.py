"""Your current setting on the page: the strategies users run (Hugging Face, torchtitan,
torchtune, PyTorch auto-SAC), imported by `core.strategies`, as points on the trade-off chart
and as entries of the method menu that draw their predicted timeline."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest
from helpers import serve_in_thread

from app import figures, ids
from app.callbacks.analysis import method_options, strategy_marks
from app.callbacks.budget import solved
from app.callbacks.common import NOT_OURS
from app.callbacks.memory import tensors_view
from app.server import create_app
from app.state import Studio
from app.strategies import AUTOSAC_BUDGETS, STRATEGY_LABELS, StrategyPoint
from bench.app import choose, wait_calm, wait_ready
from core import fmt_bytes
from core import strategies as imports

# the screenshot goes to test-results/ (ignored); REMAT_SCREENSHOTS=docs refreshes docs'
SHOTS = Path(__file__).resolve().parents[2] / (
    "docs/screenshots" if os.environ.get("REMAT_SCREENSHOTS") == "docs" else "test-results"
)

# the trade-off chart drawn for gpt-tiny and `method`, with the strategies' points
CHART = """(method) => { const g = document.querySelector('#tradeoff .js-plotly-plot');
  return g && g.layout && g.layout.meta
    && (g.layout.meta.for || '').startsWith('gpt-tiny|cpu|' + method + '|')
    && !document.getElementById('tradeoff').hasAttribute('data-refreshing')
    && g.data.some(t => (t.meta || '').startsWith('strategy:')); }"""
# the timeline drawn for the imported strategy `method`
DRAWN = """(method) => { const g = document.querySelector('#timeline .js-plotly-plot');
  return g.layout.meta.strategy === method
    && (g.layout.meta.for || '').split('|')[2] === method; }"""
TIMELINE_META = "() => document.querySelector('#timeline .js-plotly-plot').layout.meta"
POINTS = """() => Object.fromEntries(document.querySelector('#tradeoff .js-plotly-plot').data
  .filter(t => (t.meta || '').startsWith('strategy:'))
  .map(t => [t.meta.slice(9), {x: t.x, y: t.y, name: t.name, text: t.text}]))"""


def test_the_strategy_points_and_the_menu_say_what_applies():
    """Without a browser: a model without decoder layers (gpt-1layer) leaves out all but
    torchtune, disabled in the menu with the reason; torchtune chosen draws its predicted
    timeline; the chart's marks are at each predicted peak as % of store-all, auto-SAC's
    joined and labelled once."""
    studio = Studio()
    key = studio.key("gpt-1layer", "estimated", "cpu")
    offered = studio.strategies(key)
    assert offered["torchtune"] is None
    for method in ("hf", "torchtitan", "autosac"):
        assert "no decoder layers" in (offered[method] or "")
    options = {
        o["value"]: o for o in method_options({"methods": ["rockmate"], "strategies": offered})
    }
    assert options["torchtune"] == {"label": STRATEGY_LABELS["torchtune"], "value": "torchtune"}
    assert options["hf"]["disabled"] and "no decoder layers" in options["hf"]["label"].title

    # torchtune chosen: its predicted timeline and numbers, the plan views ours only
    peak = studio.problem(key).store_all_peak
    context = {
        "key": key,
        "peak": peak,
        "method": "torchtune",
        "for": "gpt-1layer|cpu|torchtune|off",
    }
    shown = solved(studio, context, 60.0, None)
    tune = studio.imported(key, "torchtune").prediction
    assert shown["timeline"]["layout"]["meta"]["peak"] == tune.peak
    assert shown["peak"] == fmt_bytes(tune.peak) and shown["for"] == context["for"] + "|60"
    assert "fixed plan: the budget has nothing to choose" in shown["hint"]
    assert shown["plan"]["strategy"] == "torchtune" and shown["plan"]["steps"] == 0
    said = tensors_view(studio, shown["plan"])
    assert said["layout"]["annotations"][0]["text"] == NOT_OURS
    assert said["layout"]["meta"]["for"] == shown["for"]  # stamped: never stale

    points = [
        StrategyPoint("torchtitan", 713, 1.137),
        StrategyPoint("autosac", 800, 1.10, 900),
        StrategyPoint("autosac", 600, 1.20, 700),
    ]
    fig = figures.tradeoff_figure({"rockmate": [(30, 150), (100, 0)]}, {}, "rockmate", 50)
    figures.add_strategy_points(fig, strategy_marks(points, 1000), "torchtitan")
    drawn = {t["meta"]: t for t in fig["data"]}
    titan, sac = drawn["strategy:torchtitan"], drawn["strategy:autosac"]
    assert titan["x"] == [71.3] and titan["y"] == [13.7] and titan["text"] == ["torchtitan"]
    assert titan["marker"]["size"] > sac["marker"]["size"]  # the menu's method: larger
    assert sac["x"] == [60.0, 80.0] and sac["customdata"] == [70.0, 90.0]  # by peak
    assert sac["text"] == ["auto-SAC", ""] and "lines" in sac["mode"]
    assert fig["layout"]["shapes"][0]["x0"] == 50  # the budget line stays the first shape


@pytest.fixture(scope="module")
def served() -> Iterator[tuple[str, Studio]]:
    """An app of this module's own (not the session's `url`): the test needs its studio, for
    auto-SAC's points depend on op times measured once per analysis, so they are compared
    with `core.strategies` on the same analysis."""
    app = create_app()
    address, stop = serve_in_thread(app)
    yield address, app.studio
    stop()


@pytest.mark.browser
@pytest.mark.slow
def test_the_strategies_users_run_sit_beside_our_curves_and_draw_their_timeline(page, served):
    """gpt-tiny, one page load: the chart's strategy points are at the peaks and times
    `core.strategies` predicts (auto-SAC's once chosen), and choosing torchtitan draws its
    predicted timeline."""
    url, studio = served
    page.set_viewport_size({"width": 1400, "height": 1000})
    page.goto(url)
    wait_ready(page, "gpt-tiny")
    page.wait_for_function(CHART, arg="rockmate")
    drawn = page.evaluate(POINTS)
    problem = studio.problem(studio.key("gpt-tiny", "estimated", "cpu"))
    peak = problem.store_all_peak

    def at(p: imports.Imported) -> tuple[float, float]:
        got = p.prediction
        return round(100 * got.peak / peak, 2), round(100 * (got.overhead - 1), 2)

    fixed = {m: imports.by_method(problem, m) for m in ("hf", "torchtitan", "torchtune")}
    assert set(drawn) == set(fixed)  # auto-SAC's points wait until it is chosen
    for method, imported in fixed.items():
        assert (drawn[method]["x"][0], drawn[method]["y"][0]) == at(imported), method

    # auto-SAC: solved for the slider's budget, then its points join the chart
    choose(page, ids.METHOD, "autosac")
    page.wait_for_function(DRAWN, arg="autosac")
    page.wait_for_function(CHART, arg="autosac")
    drawn = page.evaluate(POINTS)
    solved = [imports.by_method(problem, "autosac", int(f * peak)) for f in AUTOSAC_BUDGETS]
    expected = sorted(at(s) for s in solved if s.modules)
    assert expected and sorted(zip(drawn["autosac"]["x"], drawn["autosac"]["y"])) == expected
    page.locator(f"#{ids.TRADEOFF}").scroll_into_view_if_needed()
    SHOTS.mkdir(exist_ok=True)
    page.locator(f"#{ids.TRADEOFF}").locator(
        "xpath=ancestor::div[contains(@class, 'card')][1]"
    ).screenshot(path=str(SHOTS / "strategies.png"))

    # torchtitan: a fixed plan, its predicted timeline whatever the budget
    choose(page, ids.METHOD, "torchtitan")
    page.wait_for_function(DRAWN, arg="torchtitan")
    titan = fixed["torchtitan"].prediction
    assert page.evaluate(TIMELINE_META)["peak"] == titan.peak
    wait_calm(page)  # every view drawn for torchtitan (the plan views say they are ours only)
    assert page.inner_text(f"#{ids.PEAK}") == fmt_bytes(titan.peak)
    said = page.inner_text(f"#{ids.BUDGET_HINT}")
    assert "fixed plan: the budget has nothing to choose" in said
    assert "predicted by the native simulation" in said

    # the offload switch is ours: on, the strategy is unchanged and every view in sight is
    # drawn for the switch (the transfer lane, shown, says it is drawn for our plans)
    page.click(f"#{ids.OFFLOAD} input[type=checkbox]")
    page.wait_for_function(
        "() => (document.querySelector('#numbers').getAttribute('data-for') || '')"
        ".includes('|torchtitan|on|')"
    )
    page.locator(f"#{ids.TIMELINE}").scroll_into_view_if_needed()  # the lane in sight
    wait_calm(page)
    assert page.evaluate(TIMELINE_META)["peak"] == titan.peak
    assert "The offload switch is ours" in page.inner_text(f"#{ids.BUDGET_HINT}")
