"""The address-by-time view of a plan's arena (core.layout), as a plain plotly dict.

Each storage is a rectangle from the step that allocates it to the last step it is live, at its
offset in the arena, like the allocator state views of pytorch.org/memory_viz; hover names the
value, the op that produced it, the module that ran it and the line of Python behind it. Two
lines mark the live-bytes peak and the arena's size: the gap between them is the fragmentation
a static allocator pays for this order.
A pure function, no Dash and no solving: tests call it without a browser.
"""

from __future__ import annotations

from typing import Any

from app.figures.axes import legend_below, pick_unit, step_x
from app.figures.palette import (
    ARENA_COLOR,
    BACKGROUND,
    EDGE,
    KIND_COLORS,
    PEAK_COLOR,
    PHASE_LINE,
)
from core import fmt_bytes

_KINDS = {"activation": "activations", "temporary": "temporaries", "gradient": "gradients"}


def storage_text(graph: Any, value: int) -> str:
    """Hover text for one storage: its name, the op that produced it and the module."""
    v = graph.values[value]
    op = graph.ops[v.producer]
    module = graph.trace.nodes[op.nodes[0]].module if graph.trace is not None and op.nodes else None
    source = graph.trace.nodes[op.nodes[0]].source if graph.trace is not None and op.nodes else None
    where = (f"<br>module {module}" if module else "") + (f"<br>{source}" if source else "")
    return (
        f"<b>{v.name}</b> ({v.kind}, {fmt_bytes(v.nbytes)})<br>made by {op.label} {op.name}{where}"
    )


def arena_figure(layout: Any, graph: Any, backward_start: int | None = None) -> dict:
    """Storages of `layout` (a `core.Arena`) as rectangles: step on x, address on y.

    `graph` is the plan's `core.Graph` (for names, kinds, ops and modules);
    `backward_start`, when given, draws the boundary between the passes.
    """
    unit, scale = pick_unit(max(layout.size, 1))
    traces = [_storages(layout, graph, kind, label, scale) for kind, label in _KINDS.items()]
    steps = max((p.last for p in layout.placements), default=0) + 1
    for name, height, color in (
        (f"live peak {fmt_bytes(layout.live_peak)}", layout.live_peak, PEAK_COLOR),
        (f"arena {fmt_bytes(layout.size)}", layout.size, ARENA_COLOR),
    ):
        y = round(height / scale, 6)
        traces.append(
            {
                "type": "scatter",
                "mode": "lines",
                "name": name,
                "x": [step_x(-0.5), step_x(steps - 0.5)],
                "y": [y, y],
                "line": {"color": color, "dash": "dash", "width": 1.5},
                "hoverinfo": "skip",
            }
        )
    shapes = [] if backward_start is None else [_pass_boundary(backward_start)]
    return {
        "data": traces,
        "layout": {
            "barmode": "overlay",
            "height": 420,
            "margin": {"l": 60, "r": 10, "t": 36, "b": 110},
            "title": {
                "text": f"arena {fmt_bytes(layout.size)}: {layout.fragmentation:.2f}x the live peak"
            },
            "xaxis": {
                "automargin": True,
                "title": {"text": "program step (from 1)"},
                "showgrid": False,
            },
            "yaxis": {"title": {"text": f"address ({unit})"}, "rangemode": "tozero"},
            "legend": legend_below(),
            "shapes": shapes,
            "plot_bgcolor": BACKGROUND,
            "meta": {"unit": unit, "size": scale, "steps": steps},
        },
    }


def _storages(layout: Any, graph: Any, kind: str, label: str, scale: float) -> dict:
    """The storages of one kind as bars: from first to last step, at their offset."""
    mine = [p for p in layout.placements if graph.values[p.value].kind == kind]
    return {
        "type": "bar",
        "orientation": "h",
        "name": label,
        "base": [step_x(p.first - 0.5) for p in mine],
        "x": [p.last - p.first + 1 for p in mine],
        "y": [round((p.offset + p.size / 2) / scale, 6) for p in mine],
        "width": [round(p.size / scale, 6) for p in mine],
        "marker": {"color": KIND_COLORS[label], "line": {"width": 0.5, "color": EDGE}},
        "text": [
            f"{storage_text(graph, p.value)}<br>offset {fmt_bytes(p.offset)}, "
            f"steps {step_x(p.first)}–{step_x(p.last)}"
            for p in mine
        ],
        "customdata": [[p.value, p.offset, p.size] for p in mine],  # exact bytes
        "hovertemplate": "%{text}<extra></extra>",
        "textposition": "none",
    }


def _pass_boundary(backward_start: int) -> dict:
    """A dotted vertical line between the forward and the backward."""
    return {
        "type": "line",
        "xref": "x",
        "yref": "paper",
        "x0": step_x(backward_start - 0.5),
        "x1": step_x(backward_start - 0.5),
        "y0": 0,
        "y1": 1,
        "line": {"color": PHASE_LINE, "dash": "dot", "width": 1},
    }
