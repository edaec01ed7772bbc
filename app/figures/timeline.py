"""The memory timeline: live bytes per program step stacked by kind, with the budget, the
peak, recomputes, copies to host, the step-through marker and a measured run on top.

An SVG scatter with a stackgroup, decimated to `MAX_POINTS` points per trace keeping each
bucket's highest step, so peaks survive.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from app.figures.axes import (
    MAX_POINTS,
    decimate,
    legend_below,
    phase_label,
    phase_rect,
    pick_unit,
    step_x,
    thin,
)
from app.figures.palette import (
    BACKGROUND,
    BACKWARD_SHADE,
    BUDGET_COLOR,
    FORWARD_SHADE,
    HOST_COLOR,
    KIND_COLORS,
    MARKER_COLOR,
    MEASURED_COLOR,
    PEAK_COLOR,
    RECOMPUTE_COLOR,
    TRANSFER_COLORS,
    UPDATE_COLOR,
)
from core import fmt_bytes

# trace order in the timeline figure: callbacks patch traces by these indices (the host
# bytes of an offloading plan come after them)
T_ACTIVATIONS, T_TEMPORARIES, T_GRADIENTS, T_RECOMPUTE, T_BUDGET, T_PEAK, T_MARKER = range(7)


def timeline_figure(
    steps: Sequence[Any],
    backward_start: int,
    budget: int,
    block_names: Sequence[str] = (),
    unit: tuple[str, float] | None = None,
    max_points: int = MAX_POINTS,
    marker: int | None = None,
    host: Sequence[int] = (),
    updates: Sequence[int] = (),
) -> dict:
    """Live bytes per program step stacked by kind, phases shaded, recomputes, budget, peak.

    `steps` are `core.Step`-like records (index, kind, name, label, phase, block,
    recompute, activations, temporaries, gradients). Offload and prefetch steps are marked;
    `host`: bytes parked in host memory after each step (an offloading plan's), drawn as a
    line of its own, not in the stack. `updates`: the steps that run an optimizer's update
    (the optimizer in the step), marked.
    """
    n = len(steps)
    total = [s.activations + s.temporaries + s.gradients for s in steps]
    peak = max(total, default=0)
    name, size = unit or pick_unit(max(peak, budget))
    keep = decimate(total, max_points)
    traces = _stack(steps, keep, block_names, name, size)
    recomputes = thin([i for i in range(n) if steps[i].recompute], max_points)
    traces.append(
        {
            "type": "scatter",
            "mode": "markers",
            "name": "recomputed op",
            "x": [step_x(i) for i in recomputes],
            "y": [round(total[i] / size, 4) for i in recomputes],
            "marker": {"symbol": "triangle-down", "size": 6, "color": RECOMPUTE_COLOR},
            "hoverinfo": "skip",
        }
    )
    traces.append(_budget_trace(budget, n, size))
    traces.append(_peak_trace(total, size))
    traces.append(marker_trace(marker, max(peak, budget) / size))
    copies = thin([i for i in range(n) if steps[i].kind in ("offload", "prefetch")], max_points)
    if copies:
        traces.append(_copies_trace(steps, copies, total, size))
    if any(host):
        traces.append(_host_trace(host, keep, name, size))
    if updates:
        traces.append(_updates_trace(thin(list(updates), max_points), total, size))
    layout = _layout(backward_start, n, name, size)
    layout["meta"]["peak"] = peak  # bytes: the tallest step, which the tests compare
    return {"data": traces, "layout": layout}


def _stack(
    steps: Sequence[Any], keep: list[int], block_names: Sequence[str], unit: str, size: float
) -> list[dict]:
    """The three stacked areas (activations, temporaries, gradients); the first carries the
    hover text naming each step."""

    def where(s: Any) -> str:
        block = block_names[s.block] if 0 <= s.block < len(block_names) else ""
        verb = "recompute" if s.recompute else ("run" if s.kind == "run" else s.kind)
        return (
            f"step {step_x(s.index)}: {verb} {s.label} <b>{s.name}</b><br>block {s.block} {block}"
        )

    text = [where(steps[i]) for i in keep]
    traces = []
    for kind in ("activations", "temporaries", "gradients"):
        first = kind == "activations"
        traces.append(
            {
                "type": "scatter",
                "mode": "lines",
                "name": kind,
                "x": [step_x(i) for i in keep],
                "y": [round(getattr(steps[i], kind) / size, 4) for i in keep],
                "stackgroup": "live",
                "line": {"width": 0.5, "color": KIND_COLORS[kind], "shape": "hv"},
                "fillcolor": KIND_COLORS[kind],
                "text": text if first else None,
                "hovertemplate": ("%{text}<br>" if first else "")
                + f"{kind} %{{y:.1f}} {unit}<extra></extra>",
            }
        )
    return traces


def _budget_trace(budget: int, n: int, size: float) -> dict:
    b = round(budget / size, 4)
    return {
        "type": "scatter",
        "mode": "lines",
        "name": f"budget {fmt_bytes(budget)}",
        "x": [step_x(0), step_x(max(n - 1, 1))],
        "y": [b, b],
        "line": {"color": BUDGET_COLOR, "dash": "dash", "width": 2},
        "hoverinfo": "skip",
        "meta": "budget",
    }


def _peak_trace(total: list[int], size: float) -> dict:
    peak = max(total, default=0)
    return {
        "type": "scatter",
        "mode": "markers+text",
        "name": f"peak {fmt_bytes(peak)}",
        "x": [step_x(total.index(peak) if total else 0)],
        "y": [round(peak / size, 4)],
        "text": [f"peak {fmt_bytes(peak)}"],
        "textposition": "top center",
        "marker": {"symbol": "diamond", "size": 10, "color": PEAK_COLOR},
        "hoverinfo": "skip",
        "meta": "peak",
    }


def _copies_trace(steps: Sequence[Any], copies: list[int], total: list[int], size: float) -> dict:
    return {
        "type": "scatter",
        "mode": "markers",
        "name": "copy to host (▲) / back (▼)",
        "x": [step_x(i) for i in copies],
        "y": [round(total[i] / size, 4) for i in copies],
        "marker": {
            "symbol": [
                "triangle-up" if steps[i].kind == "offload" else "triangle-down" for i in copies
            ],
            "size": 7,
            "color": [TRANSFER_COLORS[steps[i].kind] for i in copies],
        },
        "hoverinfo": "skip",
        "meta": "copies",
    }


def _updates_trace(updates: list[int], total: list[int], size: float) -> dict:
    return {
        "type": "scatter",
        "mode": "markers",
        "name": "optimizer update (AdamW)",
        "x": [step_x(i) for i in updates],
        "y": [round(total[i] / size, 4) for i in updates],
        "marker": {"symbol": "diamond", "size": 6, "color": UPDATE_COLOR},
        "hoverinfo": "skip",
        "meta": "updates",
    }


def _host_trace(host: Sequence[int], keep: list[int], unit: str, size: float) -> dict:
    return {
        "type": "scatter",
        "mode": "lines",
        "name": f"host memory (parked, peak {fmt_bytes(max(host))})",
        "x": [step_x(i) for i in keep],
        "y": [round(host[i] / size, 4) for i in keep],
        "line": {"color": HOST_COLOR, "width": 2, "dash": "dot", "shape": "hv"},
        "hovertemplate": "host %{y:.1f} " + unit + "<extra></extra>",
        "meta": "host",
    }


def _layout(backward_start: int, n: int, unit: str, size: float) -> dict:
    return {
        "height": 360,
        "margin": {"l": 60, "r": 10, "t": 24, "b": 110},
        "xaxis": {
            "automargin": True,
            "title": {"text": "program step (from 1)"},
            "showgrid": False,
        },
        "yaxis": {"title": {"text": f"live memory ({unit})"}, "rangemode": "tozero"},
        "hovermode": "x unified",
        "legend": legend_below(),
        "shapes": [
            phase_rect(step_x(-0.5), step_x(backward_start - 0.5), FORWARD_SHADE),
            phase_rect(step_x(backward_start - 0.5), step_x(n - 0.5), BACKWARD_SHADE),
        ],
        "annotations": [
            phase_label(step_x(backward_start / 2 - 0.5), "forward"),
            phase_label(step_x((backward_start + n) / 2 - 0.5), "backward"),
        ],
        "uirevision": "timeline",
        "plot_bgcolor": BACKGROUND,
        "meta": {"unit": unit, "size": size, "steps": n},
    }


def measured_trace(live: Sequence[int], size: float, peak: int) -> dict:
    """Live bytes per program step measured in a real run, as a line over the prediction."""
    keep = decimate(live)
    return {
        "type": "scatter",
        "mode": "lines",
        "name": f"measured here (peak {fmt_bytes(peak)})",
        "x": [step_x(i) for i in keep],
        "y": [round(live[i] / size, 4) for i in keep],
        "line": {"color": MEASURED_COLOR, "width": 1.5, "shape": "hv"},
        "hovertemplate": "measured %{y:.2f}<extra></extra>",
        "meta": "measured",
    }


def marker_trace(step: int | None, height: float) -> dict:
    """The step-through marker: a vertical line at `step` (empty when None)."""
    return {
        "type": "scatter",
        "mode": "lines",
        "name": "step",
        "x": [] if step is None else [step_x(step)] * 2,
        "y": [] if step is None else [0, round(height * 1.05, 4)],
        "line": {"color": MARKER_COLOR, "width": 3},
        "hoverinfo": "skip",
        "showlegend": False,
        "meta": "marker",
    }
