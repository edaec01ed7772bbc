"""The trade-off chart: extra time against budget, one curve per method."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from app.figures.axes import legend_below
from app.figures.palette import (
    BACKGROUND,
    BUDGET_COLOR,
    FLOOR_TEXT,
    METHOD_COLORS,
    OTHER_METHOD,
    REST,
)

OFFLOAD_CURVES = ("offload", "pofo")  # drawn dashed: remat+offload beside remat-only


def tradeoff_figure(
    curves: Mapping[str, Sequence[tuple[float, float]]],
    labels: dict[str, str],
    current: str,
    budget_pct: float | None,
    floor: tuple[float, str] | None = None,
) -> dict:
    """Overhead (% extra time) against budget (% of store-all), one line per method.

    `curves` maps a method to its points (budget %, overhead %); the current method is drawn
    first and boldest, remat+offload methods (`OFFLOAD_CURVES`) dashed; clicking a point
    sets the budget (its x). `floor` (budget %, the op): below it no plan can go, shaded.
    """
    order = [current] + [m for m in curves if m != current]
    traces = [
        _curve(method, curves[method], labels.get(method, method), method == current)
        for method in order
        if method in curves
    ]
    return {
        "data": traces,
        "layout": {
            "height": 380,
            "margin": {"l": 60, "r": 10, "t": 10, "b": 130},
            "xaxis": {"title": {"text": "budget (% of store-all peak)"}, "rangemode": "tozero"},
            "yaxis": {"title": {"text": "extra time (%)"}, "rangemode": "tozero"},
            "legend": legend_below(),
            "shapes": [budget_shape(budget_pct)] + ([floor_shape(floor[0])] if floor else []),
            "annotations": [floor_note(*floor)] if floor else [],
            "hovermode": "closest",
            "plot_bgcolor": BACKGROUND,
            "clickmode": "event",
        },
    }


def _curve(method: str, points: Sequence[tuple[float, float]], label: str, current: bool) -> dict:
    """One method's points, bold when it is the current method."""
    pts = sorted(points)
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
            "dash": "dash" if method in OFFLOAD_CURVES else "solid",
        },
        "marker": {"size": 9 if current else 6, "color": method_color(method)},
        "hovertemplate": "budget %{x:.1f}%<br>extra time %{y:.1f}%<extra>" + label + "</extra>",
        "meta": method,
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
