"""The trade-off chart: extra time against budget, one curve per method."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from app.figures.axes import legend_below
from app.figures.palette import (
    BACKGROUND,
    BUDGET_COLOR,
    FLOOR_TEXT,
    METHOD_COLORS,
    OTHER_METHOD,
    REST,
    STRATEGY_COLORS,
)

OFFLOAD_CURVES = ("offload", "pofo")  # drawn dashed: remat+offload beside remat-only

# each method's marker and dash, so that curves that meet stay told apart (open markers show
# the line beneath them)
METHOD_STYLE = {
    "rockmate": ("circle", "solid"),
    "rotor": ("square", "solid"),
    "checkmate": ("diamond", "solid"),
    "store_all": ("star", "solid"),
    "checkpoint_blocks": ("diamond-open", "dot"),
    "sqrt_n": ("circle-open", "solid"),
    **{m: ("triangle-up", "dash") for m in OFFLOAD_CURVES},
}


def tradeoff_figure(
    curves: Mapping[str, Sequence[tuple[float, float]]],
    labels: dict[str, str],
    current: str,
    budget_pct: float | None,
    floor: tuple[float, str] | None = None,
    notes: Mapping[str, Sequence[str]] | None = None,
) -> dict:
    """Overhead (% extra time) against budget (% of store-all), one line per method.

    `curves` maps a method to its points (budget %, overhead %). Every curve stays visible:
    each method has its own marker and dash (remat+offload methods, `OFFLOAD_CURVES`,
    dashed); the current method is drawn boldest and on top, first in the legend; a curve
    whose every point lies on another is drawn over it and says so in its legend entry; the
    y-axis starts below 0, so a curve at no extra time sits above the axis line, not on it.
    Clicking a point sets the budget (its x). `floor` (budget %, the op): below it no plan can
    go, shaded. `notes`: per method, a line of hover text per point, in `curves`' order ("" for
    none).
    """
    present = [m for m in curves if curves[m]]
    top = max((y for m in present for _, y in curves[m]), default=0.0)
    pad = max(top, 1.0) * 0.06
    # closer than this on screen, two curves look like one: 1.5% of the axes' spans
    near = (
        0.015 * (top + 2 * pad),
        0.005 * max((x for m in present for x, _ in curves[m]), default=100),
    )
    on = {m: _lies_on(m, present, curves, near) for m in present}
    # drawn later is drawn on top: the others, then the curves lying on another, then the
    # current method; the legend keeps the current method first
    order = sorted(present, key=lambda m: (m == current, on[m] is not None))
    traces = []
    for method in order:
        label = labels.get(method, method)
        under = on[method]
        if under is not None:
            # the other curve's name alone, not its parenthesis (nor a note in it)
            other, gap = labels.get(under[0], under[0]).split(" (")[0], under[1]
            label += (
                f" (coincides with {other})"
                if gap < 0.005
                else f" (within {gap:.2g} points of {other})"
            )
        said = (notes or {}).get(method)
        trace = _curve(method, curves[method], label, method == current, said)
        trace["legendrank"] = 1 if method == current else 2 + present.index(method)
        traces.append(trace)
    return {
        "data": traces,
        "layout": {
            "height": 380,
            "margin": {"l": 60, "r": 10, "t": 10, "b": 130},
            "xaxis": {
                "automargin": True,
                "title": {"text": "budget (% of store-all peak)"},
                # fixed, so moving the budget line redraws the line alone (`MARK_BUDGET_JS`);
                # autoranged, it took the shape in and replotted the chart
                "range": [0, 102],
            },
            "yaxis": {"title": {"text": "extra time (%)"}, "range": [-pad, top + pad]},
            "legend": legend_below(),
            "shapes": [budget_shape(budget_pct)] + ([floor_shape(floor[0])] if floor else []),
            "annotations": [floor_note(*floor)] if floor else [],
            "hovermode": "closest",
            "plot_bgcolor": BACKGROUND,
            "clickmode": "event",
        },
    }


def _lies_on(
    method: str,
    present: Sequence[str],
    curves: Mapping[str, Sequence[tuple[float, float]]],
    near: tuple[float, float],
) -> tuple[str, float] | None:
    """The first other curve on which every point of `method`'s curve lies, within `near`
    (extra-time points, budget points), and the largest gap: drawn apart, one would hide
    the other."""
    mine = (len(curves[method]), -present.index(method))
    for other in present:
        # of two curves on each other, the one with fewer points (or listed later) says so
        if (len(curves[other]), -present.index(other)) <= mine:
            continue
        gaps = [_gap(p, curves[other], near[1]) for p in curves[method]]
        if all(g is not None and g <= near[0] for g in gaps):
            return other, max(g for g in gaps if g is not None)
    return None


def _gap(
    point: tuple[float, float], curve: Sequence[tuple[float, float]], dx: float
) -> float | None:
    """How far `point` is above or below `curve` drawn as steps (each point's y holds until
    the next); None outside the curve's budgets (`dx` of slack)."""
    x, y = point
    pts = sorted(curve)
    if not pts or x < pts[0][0] - dx or x > pts[-1][0] + dx:
        return None
    before = [q for q in pts if q[0] <= x + dx]
    return abs(before[-1][1] - y)


def _curve(
    method: str,
    points: Sequence[tuple[float, float]],
    label: str,
    current: bool,
    notes: Sequence[str] | None = None,
) -> dict:
    """One method's points, bold when it is the current method, with its own marker and dash;
    `notes`, one per point, end its hover text."""
    order = sorted(range(len(points)), key=lambda i: points[i])
    pts = [points[i] for i in order]
    symbol, dash = METHOD_STYLE.get(method, ("circle", "solid"))
    extra: dict = {}
    if notes and any(notes):
        extra["customdata"] = [notes[i] for i in order]
    hover = "budget %{x:.1f}%<br>extra time %{y:.1f}%" + ("%{customdata}" if extra else "")
    return {
        "type": "scatter",
        "mode": "lines+markers",
        "name": label,
        "x": [round(p[0], 2) for p in pts],
        "y": [round(p[1], 2) for p in pts],
        "line": {
            "width": 3 if current else 1.5,
            "shape": "hv",
            "color": method_color(method),
            "dash": dash,
        },
        "marker": {
            "size": 10 if current else 8,
            "symbol": symbol,
            "color": method_color(method),
            "line": {"width": 2, "color": method_color(method)},
        },
        "hovertemplate": hover + "<extra>" + label + "</extra>",
        "meta": method,
        **extra,
    }


def method_color(method: str) -> str:
    """The method's own colour (a grey for methods without one)."""
    return METHOD_COLORS.get(method, OTHER_METHOD)


def floor_shape(floor_pct: float) -> dict:
    """Budgets no plan can meet (below one op's own inputs and outputs): a grey band."""
    return {
        "type": "rect",
        "xref": "x",
        "yref": "paper",
        "x0": 0,
        "x1": floor_pct,
        "y0": 0,
        "y1": 1,
        "fillcolor": REST,
        "opacity": 0.5,
        "line": {"width": 0},
        "layer": "below",
    }


def floor_note(floor_pct: float, op: str) -> dict:
    """The band's label: where the floor is and which op sets it."""
    return {
        "x": floor_pct / 2,
        "y": 0.5,
        "xref": "x",
        "yref": "paper",
        "textangle": -90,
        "showarrow": False,
        "text": f"no plan below {floor_pct:.1f}%<br>{op}",
        "font": {"size": 11, "color": FLOOR_TEXT},
    }


def budget_shape(budget_pct: float | None) -> dict:
    """The current budget on the trade-off curve: a vertical dashed line."""
    x = budget_pct if budget_pct is not None else 100
    return {
        "type": "line",
        "xref": "x",
        "yref": "paper",
        "x0": x,
        "x1": x,
        "y0": 0,
        "y1": 1,
        "line": {"color": BUDGET_COLOR, "dash": "dash", "width": 1.5},
    }


# each imported strategy's marker: told apart from the curves' markers and from each other
STRATEGY_SYMBOLS = {
    "hf": "x",
    "torchtitan": "cross",
    "torchtune": "hexagram",
    "autosac": "star-diamond",
}


@dataclass(frozen=True)
class StrategyMark:
    """An imported strategy's point: x its predicted peak (% of store-all), y its extra time
    (%); `budget_pct` what auto-SAC was asked for (None for a fixed plan)."""

    method: str
    label: str  # the legend's and the hover's name
    short: str  # written beside the marker
    peak_pct: float
    extra_pct: float
    budget_pct: float | None = None


def add_strategy_points(fig: dict, marks: Sequence[StrategyMark], current: str) -> dict:
    """`fig` (a `tradeoff_figure`) with the imported strategies beside the curves: each fixed
    plan one labelled marker at (its predicted peak, its extra time), auto-SAC one marker
    per budget it was solved at, joined by a dotted line and labelled once; `current` (the
    menu's method) drawn larger. The axes widen to take them in. Their x is a peak, not a
    budget: at that x, our curve's y is what a plan of ours fitting in the same memory
    costs."""
    by: dict[str, list[StrategyMark]] = {}
    for m in marks:
        by.setdefault(m.method, []).append(m)
    layout = fig["layout"]
    for method, group in by.items():
        group = sorted(group, key=lambda m: m.peak_pct)
        first = group[0]
        big = method == current
        budgets = [m.budget_pct for m in group]
        name = first.label + (" at several budgets" if len(group) > 1 else "")
        asked = "<br>asked for %{customdata:.1f}%" if budgets[0] is not None else ""
        fig["data"].append(
            {
                "type": "scatter",
                "mode": "lines+markers+text" if len(group) > 1 else "markers+text",
                "name": f"{name} (predicted)",
                "x": [round(m.peak_pct, 2) for m in group],
                "y": [round(m.extra_pct, 2) for m in group],
                "customdata": budgets,
                "text": [first.short] + [""] * (len(group) - 1),
                "textposition": "middle left" if len(group) > 1 else "top right",
                "textfont": {"color": STRATEGY_COLORS.get(method, OTHER_METHOD), "size": 12},
                "line": {"color": STRATEGY_COLORS.get(method, OTHER_METHOD), "dash": "dot"},
                "marker": {
                    "symbol": STRATEGY_SYMBOLS.get(method, "x"),
                    "size": 15 if big else 12,
                    "color": STRATEGY_COLORS.get(method, OTHER_METHOD),
                    "line": {"width": 1, "color": "white"},
                },
                "hovertemplate": "predicted peak %{x:.1f}% of store-all<br>extra time %{y:.1f}%"
                + asked
                + "<extra>"
                + first.label
                + "</extra>",
                "legendrank": 1 if big else 50,
                "meta": f"strategy:{method}",
            }
        )
    if marks:
        # a legend row per strategy more (pinned under the x-axis title): the plot keeps its
        # height rather than shrinking under the longer legend
        layout["height"] += 19 * len(by)
        top = max(m.extra_pct for m in marks)
        low, high = layout["yaxis"]["range"]
        if top > high:
            pad = top * 0.08
            layout["yaxis"]["range"] = [min(low, -pad), top + pad]
        right = max(m.peak_pct for m in marks) + 3
        layout["xaxis"]["range"] = [0, max(layout["xaxis"]["range"][1], right)]
        layout["xaxis"]["title"]["text"] = (
            "budget, or a strategy's predicted peak (% of store-all peak)"
        )
    return fig
