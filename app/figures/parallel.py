"""Per-device memory of each data x tensor-parallel layout, stacked by kind (a
`core.ParallelPlan`'s layouts), the chosen one on top."""

from __future__ import annotations

from typing import Any

from app.figures.axes import legend_below, ms, pick_unit
from app.figures.palette import BACKGROUND, EDGE
from core import fmt_bytes

# Memory.rows() kinds, in stacking order, and their colours
PARALLEL_COLORS = {
    "params": "#4c78a8",
    "AdamW": "#9ecae9",
    "inputs": "#bab0ac",
    "acts+grads": "#f58518",
    "dp buffers": "#b279a2",
}


def layout_name(layout: Any, chosen: bool) -> str:
    """A layout's row label: its name, and whether the planner chose it or it does not fit."""
    mark = " (chosen)" if chosen else "" if layout.fits else " (does not fit)"
    return f"{layout.name}{mark}"


def parallel_figure(plan: Any) -> dict:
    """Horizontal bars, one per layout of `plan` (`core.ParallelPlan`), each the per-device
    bytes stacked by kind; the hover adds the predicted step time per micro-batch. Rows in
    the planner's ranking, the chosen layout at the top."""
    layouts = list(plan.layouts)
    names = [layout_name(x, x is plan.best) for x in layouts]
    top = max((x.memory.total for x in layouts), default=0)
    unit, size = pick_unit(top)
    times = [
        f"{x.dp} x {x.tp} ranks; step {ms(x.time.total)}, {ms(x.per_micro_batch)} per "
        f"micro-batch; total {fmt_bytes(x.memory.total)} per device"
        for x in layouts
    ]
    traces = []
    for k, (kind, color) in enumerate(PARALLEL_COLORS.items()):
        traces.append(
            {
                "type": "bar",
                "orientation": "h",
                "name": kind,
                "y": names,
                "x": [round(x.memory.rows()[k][1] / size, 4) for x in layouts],
                "customdata": [[x.memory.rows()[k][1], t] for x, t in zip(layouts, times)],
                "hovertemplate": f"{kind} %{{x:.2f}} {unit}<br>%{{customdata[1]}}<extra></extra>",
                "marker": {"color": color, "line": {"width": 0.5, "color": EDGE}},
            }
        )
    return {
        "data": traces,
        "layout": {
            "height": 130 + 34 * len(layouts),
            "barmode": "stack",
            "margin": {"l": 170, "r": 10, "t": 10, "b": 90},
            "xaxis": {
                "automargin": True,
                "title": {"text": f"memory per device ({unit})"},
                "rangemode": "tozero",
            },
            "yaxis": {"autorange": "reversed"},
            "legend": {**legend_below(), "traceorder": "normal"},
            "plot_bgcolor": BACKGROUND,
            "meta": {"layouts": [x.name for x in layouts], "devices": plan.devices},
        },
    }
