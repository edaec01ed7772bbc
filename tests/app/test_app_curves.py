"""The trade-off curves drawn first without the budgets that wait for rockmate's whole-graph
ILP (seconds each; on gpt-1layer, 75 ops, the curve's lowest budgets), then whole: the first
draw runs no ILP, leaves out exactly the budgets where the whole curve runs one, says so in
its legend and keeps its own busy sign (stamped for other controls) until the whole lands."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

import core
from app import figures
from app.callbacks.analysis import FILLING, curves_view, found_below
from app.state import Point, Studio
from core import frontier
from core.frontier import TradeoffPoint
from core.solvers import rockmate


@pytest.fixture(scope="module")
def studio() -> Studio:
    return Studio()


def test_first_curve_runs_no_ilp_and_leaves_out_where_the_whole_one_runs_it(
    studio: Studio, monkeypatch: pytest.MonkeyPatch
) -> None:
    key = studio.key("gpt-1layer", "estimated", "cpu")
    problem = studio.problem(key)
    ran: list[int] = []

    def no_ilp(problem: core.Problem, budget: int) -> None:  # the ILP finding nothing, at once
        ran.append(budget)
        return None

    monkeypatch.setattr(rockmate, "_bounded_ilp", no_ilp)
    first = studio.tradeoff_first(key, "rockmate")
    assert first is not None and not ran, "the first draw ran a whole-graph ILP"
    points, left = first
    assert left and all(rockmate.ilp_pending(problem, b) for b in left)
    assert {p.budget for p in points}.isdisjoint(left)

    whole = core.tradeoff(problem, "rockmate")
    assert sorted(ran) == sorted(left), "the whole curve ran the ILP elsewhere"
    # with the ILP finding nothing, the first draw's points are the whole curve's there
    assert [p for p in whole if p.budget not in left] == [
        TradeoffPoint(p.budget, p.peak, p.overhead, p.found_at) for p in points
    ]
    assert not any(rockmate.ilp_pending(problem, b) for b in left)  # memoised now

    sig = "gpt-1layer|cpu|Rockmate|off"
    context: dict = {
        "key": key,
        "peak": problem.store_all_peak,
        "method": "rockmate",
        "methods": ["rockmate"],
        "min_pct": 50.0,
        "for": sig,
    }
    figure, _ = curves_view(studio, context, 80.0, first)
    assert figure["layout"]["meta"]["for"] == sig + FILLING
    names = [t["name"] for t in figure["data"]]
    assert any("whole-graph ILP still solving at" in n for n in names), names


def test_a_point_whose_plan_was_found_at_a_lower_budget_says_so(
    studio: Studio, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The curve keeps the fastest plan so far; where that plan was found at a lower budget
    (a node-limited ILP found a slower one at this budget: gpt-1layer at 57.5%), the slider
    there shows another plan, and the point's hover says whose plan it is."""
    problem = studio.problem(studio.key("gpt-1layer", "estimated", "cpu"))
    peak = problem.store_all_peak
    overheads = iter([1.4, 1.6, 1.2])  # the middle budget's own plan is slower

    def solve(problem: core.Problem, budget: int, method: str) -> SimpleNamespace:
        ov = next(overheads)
        return SimpleNamespace(predicted_time=ov, predicted_peak=budget, overhead=ov)

    monkeypatch.setattr(frontier, "minimum_budget", lambda problem, method: peak // 2)
    monkeypatch.setattr(frontier, "solve", solve)
    low, mid, high = frontier.tradeoff(problem, "rockmate", points=3)
    assert (mid.overhead, mid.found_at) == (1.4, low.budget)
    assert (low.found_at, high.found_at) == (low.budget, high.budget)
    notes = [
        found_below(Point(p.budget, p.predicted_peak, p.overhead, p.found_at), peak)
        for p in (low, mid, high)
    ]
    assert notes[0] == notes[2] == ""
    assert f"found at {100 * low.budget / peak:.1f}%" in notes[1]
    fig = figures.tradeoff_figure(
        {"rockmate": [(50.0, 40.0), (75.0, 40.0), (100.0, 20.0)]},
        {},
        "rockmate",
        60,
        None,
        {"rockmate": notes},
    )
    assert fig["data"][0]["customdata"] == notes
    assert "%{customdata}" in fig["data"][0]["hovertemplate"]
