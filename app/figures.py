"""Figures as plain data: pure functions from numbers to plotly dicts and cytoscape elements.

No Dash and no `core` solving here, so tests call them without a browser. Plotly figures are
plain dicts (faster than `go.Figure`); the timeline is an SVG scatter with a stackgroup,
decimated to `MAX_POINTS` points per trace keeping each bucket's highest step, so peaks survive.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Sequence
from typing import Any

import numpy as np

from core.errors import fmt_bytes

MAX_POINTS = 1000

KIND_COLORS = {"activations": "#4c78a8", "temporaries": "#f58518", "gradients": "#54a24b"}
RECOMPUTE_COLOR = "#e45756"
BUDGET_COLOR = "#222222"
PEAK_COLOR = "#b279a2"
MARKER_COLOR = "#d4a000"
FATE_COLORS = {
    "kept": "#4c78a8",
    "recomputed": "#e45756",
    "offloaded": "#b279a2",
    "freed": "#c9c9c9",
}
FATE_TEXT = {
    "kept": "kept from the forward to the backward",
    "recomputed": "freed in the forward, recomputed in the backward",
    "offloaded": "sent to host memory in the forward, brought back for the backward",
    "freed": "freed after its last use (the backward does not need it)",
}
# one colour per method, whichever is selected
METHOD_COLORS = {
    "rockmate": "#4c78a8",
    "rotor": "#f58518",
    "checkmate": "#b279a2",
    "store_all": "#54a24b",
    "checkpoint_blocks": "#9d755d",
    "sqrt_n": "#72b7b2",
    "offload": "#b279a2",
    "pofo": "#b279a2",
}
OFFLOAD_CURVES = ("offload", "pofo")  # drawn dashed: remat+offload beside remat-only
HOST_COLOR = "#b279a2"
TRANSFER_COLORS = {"offload": "#b279a2", "prefetch": "#7b4fa0", "stall": "#e45756"}
BLOCK_TINTS = ["#e8f0fb", "#fdf0e2", "#e9f5e8", "#f7e8f2", "#eef0d9", "#e6f4f4", "#f3e9dc"]

# trace order in the timeline figure: callbacks patch traces by these indices (the host
# bytes of an offloading plan come after them)
T_ACTIVATIONS, T_TEMPORARIES, T_GRADIENTS, T_RECOMPUTE, T_BUDGET, T_PEAK, T_MARKER = range(7)


def pick_unit(nbytes: float) -> tuple[str, float]:
    """The binary unit to draw `nbytes`-sized numbers in: (name, bytes per unit)."""
    for name, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if nbytes >= 2 * size:
            return name, size
    return "B", 1


def decimate(totals: Sequence[float], max_points: int = MAX_POINTS) -> list[int]:
    """Indices to draw: every index when few, else each bucket's highest (peaks survive),
    always with the first and last."""
    n = len(totals)
    if n <= max_points:
        return list(range(n))
    per = math.ceil(n / max_points)
    buckets = math.ceil(n / per)
    padded = np.full(buckets * per, -np.inf)
    padded[:n] = np.asarray(totals, dtype=float)
    best = padded.reshape(buckets, per).argmax(axis=1) + np.arange(buckets) * per
    keep = set(best.tolist()) | {0, n - 1}
    return sorted(keep)


def timeline_figure(
    steps: Sequence[Any],
    backward_start: int,
    budget: int,
    block_names: Sequence[str] = (),
    unit: tuple[str, float] | None = None,
    max_points: int = MAX_POINTS,
    marker: int | None = None,
    host: Sequence[int] = (),
) -> dict:
    """Live bytes per program step stacked by kind, phases shaded, recomputes, budget, peak.

    `steps` are `core.schedule.Step`-like records (index, kind, name, label, phase, block,
    recompute, activations, temporaries, gradients). Offload and prefetch steps are marked;
    `host`: bytes parked in host memory after each step (an offloading plan's), drawn as a
    line of its own, not in the stack.
    """
    n = len(steps)
    act = [s.activations for s in steps]
    tmp = [s.temporaries for s in steps]
    grad = [s.gradients for s in steps]
    total = [a + t + g for a, t, g in zip(act, tmp, grad)]
    peak = max(total, default=0)
    peak_step = total.index(peak) if total else 0
    name, size = unit or pick_unit(max(peak, budget))
    keep = decimate(total, max_points)

    def scaled(col: Sequence[int]) -> list[float]:
        return [round(col[i] / size, 4) for i in keep]

    def where(s: Any) -> str:
        block = block_names[s.block] if 0 <= s.block < len(block_names) else ""
        verb = "recompute" if s.recompute else ("run" if s.kind == "run" else s.kind)
        # counted from 1, as the stepper counts
        return f"step {s.index + 1}: {verb} {s.label} <b>{s.name}</b><br>block {s.block} {block}"

    text = [where(steps[i]) for i in keep]
    traces: list[dict] = []
    for kind, col in (("activations", act), ("temporaries", tmp), ("gradients", grad)):
        traces.append(
            {
                "type": "scatter",
                "mode": "lines",
                "name": kind,
                "x": keep,
                "y": scaled(col),
                "stackgroup": "live",
                "line": {"width": 0.5, "color": KIND_COLORS[kind], "shape": "hv"},
                "fillcolor": KIND_COLORS[kind],
                "text": text if kind == "activations" else None,
                "hovertemplate": ("%{text}<br>" if kind == "activations" else "")
                + kind
                + " %{y:.1f} "
                + name
                + "<extra></extra>",
            }
        )
    recomputes = [i for i in range(n) if steps[i].recompute]
    if len(recomputes) > max_points:
        recomputes = recomputes[:: math.ceil(len(recomputes) / max_points)]
    traces.append(
        {
            "type": "scatter",
            "mode": "markers",
            "name": "recomputed op",
            "x": recomputes,
            "y": [round(total[i] / size, 4) for i in recomputes],
            "marker": {"symbol": "triangle-down", "size": 6, "color": RECOMPUTE_COLOR},
            "hoverinfo": "skip",
        }
    )
    b = round(budget / size, 4)
    traces.append(
        {
            "type": "scatter",
            "mode": "lines",
            "name": f"budget {fmt_bytes(budget)}",
            "x": [0, max(n - 1, 1)],
            "y": [b, b],
            "line": {"color": BUDGET_COLOR, "dash": "dash", "width": 2},
            "hoverinfo": "skip",
            "meta": "budget",
        }
    )
    traces.append(
        {
            "type": "scatter",
            "mode": "markers+text",
            "name": f"peak {fmt_bytes(peak)}",
            "x": [peak_step],
            "y": [round(peak / size, 4)],
            "text": [f"peak {fmt_bytes(peak)}"],
            "textposition": "top center",
            "marker": {"symbol": "diamond", "size": 10, "color": PEAK_COLOR},
            "hoverinfo": "skip",
            "meta": "peak",
        }
    )
    traces.append(marker_trace(marker, max(peak, budget) / size))
    copies = [i for i in range(n) if steps[i].kind in ("offload", "prefetch")]
    if len(copies) > max_points:
        copies = copies[:: math.ceil(len(copies) / max_points)]
    if copies:
        traces.append(
            {
                "type": "scatter",
                "mode": "markers",
                "name": "copy to host (▲) / back (▼)",
                "x": copies,
                "y": [round(total[i] / size, 4) for i in copies],
                "marker": {
                    "symbol": [
                        "triangle-up" if steps[i].kind == "offload" else "triangle-down"
                        for i in copies
                    ],
                    "size": 7,
                    "color": [TRANSFER_COLORS[steps[i].kind] for i in copies],
                },
                "hoverinfo": "skip",
                "meta": "copies",
            }
        )
    if any(host):
        traces.append(
            {
                "type": "scatter",
                "mode": "lines",
                "name": f"host memory (parked, peak {fmt_bytes(max(host))})",
                "x": keep,
                "y": [round(host[i] / size, 4) for i in keep],
                "line": {"color": HOST_COLOR, "width": 2, "dash": "dot", "shape": "hv"},
                "hovertemplate": "host %{y:.1f} " + name + "<extra></extra>",
                "meta": "host",
            }
        )
    shapes = [
        _phase_rect(-0.5, backward_start - 0.5, "rgba(76,120,168,0.07)"),
        _phase_rect(backward_start - 0.5, n - 0.5, "rgba(84,162,75,0.07)"),
    ]
    annotations = [
        _phase_label(backward_start / 2, "forward"),
        _phase_label((backward_start + n) / 2, "backward"),
    ]
    return {
        "data": traces,
        "layout": {
            "height": 380,
            "margin": {"l": 60, "r": 10, "t": 24, "b": 90},
            "xaxis": {"title": {"text": "program step"}, "showgrid": False},
            "yaxis": {"title": {"text": f"live memory ({name})"}, "rangemode": "tozero"},
            "hovermode": "x unified",
            "legend": {"orientation": "h", "y": -0.2, "yanchor": "top", "x": 0},
            "shapes": shapes,
            "annotations": annotations,
            "uirevision": "timeline",
            "plot_bgcolor": "white",
            "meta": {"unit": name, "size": size, "steps": n},
        },
    }


MAX_BANDS = 120  # storages drawn one by one in the per-tensor view; smaller ones are summed
BAND_COLORS = {
    "kept": "#4c78a8",
    "recomputed": "#e45756",
    "offloaded": "#b279a2",
    "freed": "#9ecae9",
    "temporary": "#f58518",
    "gradient": "#54a24b",
    "activation": "#4c78a8",
}


def tensor_figure(
    rows: Sequence[dict],
    n_steps: int,
    backward_start: int,
    unit: tuple[str, float] | None = None,
    max_bands: int = MAX_BANDS,
) -> dict:
    """Each live storage as a band over program steps, stacked in allocation order (as
    pytorch.org/memory_viz draws allocations): a band slides down when one below it is freed.

    `rows` are dicts (start, end, nbytes, fate, text) from `app.state.tensor_rows`, steps
    [start, end). The `max_bands` largest are drawn one by one; the rest are summed into one
    grey band on top, so every step's stack still equals the live total.
    """
    rows = list(rows)
    chosen = sorted(range(len(rows)), key=lambda i: -rows[i]["nbytes"])[:max_bands]
    chosen.sort(key=lambda i: (rows[i]["start"], i))
    alive = np.zeros((len(chosen), max(n_steps, 1)), dtype=np.int64)
    for k, i in enumerate(chosen):
        alive[k, rows[i]["start"] : rows[i]["end"]] = rows[i]["nbytes"]
    offsets = np.cumsum(alive, axis=0) - alive  # bytes of earlier allocations still alive
    total = np.zeros(max(n_steps, 1), dtype=np.int64)
    for r in rows:
        total[r["start"] : r["end"]] += r["nbytes"]
    drawn = alive.sum(axis=0)
    peak = int(total.max(initial=0))
    name, size = unit or pick_unit(peak)
    traces = []
    for k, i in enumerate(chosen):
        r = rows[i]
        x, top, bottom = _band_outline(
            offsets[k, r["start"] : r["end"]], r["start"], r["nbytes"], size
        )
        traces.append(
            {
                "type": "scatter",
                "mode": "lines",
                "x": x + x[::-1],
                "y": top + bottom[::-1],
                "fill": "toself",
                "fillcolor": BAND_COLORS.get(r["fate"], "#888888"),
                "line": {"width": 0.5, "color": "white"},
                "hoveron": "fills",
                "hoverinfo": "text",
                "text": r["text"],
                "name": r.get("name", ""),
                "showlegend": False,
            }
        )
    rest = total - drawn
    if len(rows) > len(chosen) and rest.any():
        steps = list(range(n_steps))
        traces.append(
            {
                "type": "scatter",
                "mode": "lines",
                "x": steps + steps[::-1],
                "y": [round(float(drawn[i] + rest[i]) / size, 4) for i in steps]
                + [round(float(drawn[i]) / size, 4) for i in reversed(steps)],
                "fill": "toself",
                "fillcolor": "#d9d9d9",
                "line": {"width": 0, "shape": "hv"},
                "hoveron": "fills",
                "hoverinfo": "text",
                "text": f"{len(rows) - len(chosen)} smaller storages",
                "name": "smaller storages",
                "showlegend": False,
                "meta": "rest",
            }
        )
    legend = [
        {
            "type": "scatter",
            "mode": "markers",
            "x": [None],
            "y": [None],
            "name": label,
            "marker": {"symbol": "square", "size": 12, "color": BAND_COLORS[key]},
        }
        for key, label in (
            ("kept", "kept for the backward"),
            ("recomputed", "recomputed"),
            ("offloaded", "offloaded to host"),
            ("freed", "freed in the forward"),
            ("temporary", "temporary"),
            ("gradient", "gradient"),
        )
    ]
    return {
        "data": traces + legend,
        "layout": {
            "height": 380,
            "margin": {"l": 60, "r": 10, "t": 24, "b": 70},
            "xaxis": {"title": {"text": "program step"}, "showgrid": False},
            "yaxis": {"title": {"text": f"live memory ({name})"}, "rangemode": "tozero"},
            "hovermode": "closest",
            "legend": {"orientation": "h", "y": -0.2, "yanchor": "top", "x": 0},
            "shapes": [_phase_rect(backward_start - 0.5, n_steps - 0.5, "rgba(84,162,75,0.07)")],
            "plot_bgcolor": "white",
            "meta": {"unit": name, "bands": len(chosen), "storages": len(rows)},
        },
    }


def _band_outline(
    offsets: np.ndarray, start: int, nbytes: int, size: float
) -> tuple[list[float], list[float], list[float]]:
    """x, top and bottom of one band whose bottom is `offsets` from step `start` on, as
    step corners only where the offset changes (a band is drawn from step-0.5 to step+0.5)."""
    change = np.flatnonzero(np.diff(offsets)) + 1
    cuts = [0, *change.tolist(), len(offsets)]
    x: list[float] = []
    top: list[float] = []
    bottom: list[float] = []
    for a, b in zip(cuts, cuts[1:]):
        low = float(offsets[a]) / size
        for edge in (start + a - 0.5, start + b - 0.5):
            x.append(edge)
            bottom.append(round(low, 4))
            top.append(round(low + nbytes / size, 4))
    return x, top, bottom


MEASURED_COLOR = "#111111"


def measured_trace(live: Sequence[int], size: float, peak: int) -> dict:
    """Live bytes per program step measured in a real run, as a line over the prediction."""
    keep = decimate(live)
    return {
        "type": "scatter",
        "mode": "lines",
        "name": f"measured here (peak {fmt_bytes(peak)})",
        "x": keep,
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
        "x": [] if step is None else [step, step],
        "y": [] if step is None else [0, round(height * 1.05, 4)],
        "line": {"color": MARKER_COLOR, "width": 3},
        "hoverinfo": "skip",
        "showlegend": False,
        "meta": "marker",
    }


def transfer_figure(
    transfers: Sequence[Any],
    waits: Sequence[tuple[int, float, float]],
    value_names: Sequence[str],
    sizes: Sequence[int],
    link: str,
) -> dict:
    """The transfer lane on a time axis: each copy (`core.simulator.Transfer`: kind, value,
    step, start, end in seconds) a bar on its row, offloads and prefetches, and each stall
    of the compute lane, (run step, ready, started) from the simulation's `waits`, a red bar
    on a row of its own. `link` names the host link, in the title."""
    traces = []
    rows = {"offload": "offload (device→host)", "prefetch": "prefetch (host→device)"}
    for kind, row in rows.items():
        mine = [t for t in transfers if t.kind == kind]
        traces.append(
            {
                "type": "bar",
                "orientation": "h",
                "name": row,
                "y": [row] * len(mine),
                "base": [round(t.start * 1e3, 6) for t in mine],
                "x": [round((t.end - t.start) * 1e3, 6) for t in mine],
                "text": [
                    f"step {t.step + 1}: {kind} {value_names[t.value]} "
                    f"({fmt_bytes(sizes[t.value])}), {_ms(t.start)}–{_ms(t.end)}"
                    for t in mine
                ],
                "hovertemplate": "%{text}<extra></extra>",
                "textposition": "none",
                "marker": {"color": TRANSFER_COLORS[kind], "line": {"width": 0.5, "color": "#fff"}},
                "meta": kind,
            }
        )
    traces.append(
        {
            "type": "bar",
            "orientation": "h",
            "name": "compute waits (stall)",
            "y": ["compute stalls"] * len(waits),
            "base": [round(ready * 1e3, 6) for _, ready, _ in waits],
            "x": [round((started - ready) * 1e3, 6) for _, ready, started in waits],
            "text": [
                f"step {step + 1} waits {_ms(started - ready)} for a prefetch"
                for step, ready, started in waits
            ],
            "hovertemplate": "%{text}<extra></extra>",
            "textposition": "none",
            "marker": {"color": TRANSFER_COLORS["stall"]},
            "meta": "stall",
        }
    )
    stall = sum(started - ready for _, ready, started in waits)
    moved = sum(sizes[t.value] for t in transfers if t.kind == "offload")
    title = (
        f"{len(transfers)} copies, {fmt_bytes(moved)} offloaded, stalls {_ms(stall)} · {link}"
        if transfers
        else f"no copies: this plan keeps or recomputes every activation · {link}"
    )
    return {
        "data": traces,
        "layout": {
            "height": 220,
            "margin": {"l": 150, "r": 10, "t": 30, "b": 40},
            "title": {"text": title, "font": {"size": 12}, "x": 0, "xanchor": "left"},
            "xaxis": {
                "title": {"text": "time from the start of the training step (ms)"},
                "rangemode": "tozero",
            },
            "yaxis": {
                "categoryorder": "array",
                "categoryarray": ["compute stalls", *reversed(rows.values())],
            },
            "barmode": "overlay",
            "showlegend": False,
            "hovermode": "closest",
            "plot_bgcolor": "white",
            "meta": {"copies": len(transfers), "stalls": len(waits), "link": link},
        },
    }


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.3g} ms" if seconds >= 1e-3 else f"{seconds * 1e6:.3g} µs"


def _phase_rect(x0: float, x1: float, color: str) -> dict:
    return {
        "type": "rect",
        "xref": "x",
        "yref": "paper",
        "x0": x0,
        "x1": x1,
        "y0": 0,
        "y1": 1,
        "fillcolor": color,
        "line": {"width": 0},
        "layer": "below",
    }


def _phase_label(x: float, text: str) -> dict:
    return {
        "x": x,
        "y": 1.0,
        "xref": "x",
        "yref": "paper",
        "yanchor": "bottom",
        "text": text,
        "showarrow": False,
        "font": {"size": 11, "color": "#666"},
    }


def tradeoff_figure(
    curves: dict[str, Sequence[tuple[float, float]]],
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
    traces = []
    for method in (m for m in order if m in curves):
        pts = sorted(curves[method])
        dash = "dash" if method in OFFLOAD_CURVES else "solid"
        traces.append(
            {
                "type": "scatter",
                "mode": "lines+markers",
                "name": labels.get(method, method),
                "x": [round(p[0], 2) for p in pts],
                "y": [round(p[1], 2) for p in pts],
                "line": {
                    "width": 3 if method == current else 1.5,
                    "shape": "hv",
                    "color": method_color(method),
                    "dash": dash,
                },
                "marker": {"size": 9 if method == current else 6, "color": method_color(method)},
                "hovertemplate": "budget %{x:.1f}%<br>overhead %{y:.1f}%<extra>"
                + labels.get(method, method)
                + "</extra>",
                "meta": method,
            }
        )
    return {
        "data": traces,
        "layout": {
            "height": 380,
            "margin": {"l": 60, "r": 10, "t": 10, "b": 120},
            "xaxis": {"title": {"text": "budget (% of store-all peak)"}, "rangemode": "tozero"},
            "yaxis": {"title": {"text": "extra time (%)"}, "rangemode": "tozero"},
            "legend": {"orientation": "h", "y": -0.38, "yanchor": "top", "x": 0},
            "shapes": [budget_shape(budget_pct)] + ([floor_shape(floor[0])] if floor else []),
            "annotations": [floor_note(*floor)] if floor else [],
            "hovermode": "closest",
            "plot_bgcolor": "white",
            "clickmode": "event",
        },
    }


def method_color(method: str) -> str:
    """The method's own colour (a grey for methods without one)."""
    return METHOD_COLORS.get(method, "#7f7f7f")


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
        "fillcolor": "#d9d9d9",
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
        "font": {"size": 11, "color": "#595959"},
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


# ---------------------------------------------------------------- block graph (cytoscape)

ROWS = 12  # ops per column inside a block box
DX, DY = 70, 34
BLOCKS_PER_ROW = 6


def graph_prefix(key: str) -> str:
    """The element-id prefix of one analysed model's graph.

    Ids must differ between models: with `o66` in two models, cytoscape kept the old node
    (under its old parent) while adding the new edges, failed ("nonexistant target 'o66'"),
    and left the first model's skeleton under every later one.
    """
    return "g" + hashlib.sha1(key.encode()).hexdigest()[:8] + "-"


def graph_elements(
    blocks: Sequence[Any], ops: Sequence[Any], values: Sequence[Any], prefix: str = ""
) -> list:
    """Cytoscape elements with preset positions: one compound box per block (tinted by kind),
    its forward ops inside in columns, and an edge for each forward value read in the forward.

    `blocks` are `core.blocks.Block`-like (index, name, kind, forward_ops), `ops` and `values`
    the graph's `Op`/`Value` records; every id starts with `prefix` (see `graph_prefix`), and
    the data carry the block and op indices.
    """
    elements: list[dict] = []
    forward = set()
    x0, y0, row_height = 0.0, 0.0, 0.0
    for i, block in enumerate(blocks):
        if i and i % BLOCKS_PER_ROW == 0:
            x0, y0, row_height = 0.0, y0 + row_height + 90, 0.0
        elements.append(
            {
                "data": {
                    "id": f"{prefix}b{block.index}",
                    "block": block.index,
                    "label": f"block {block.index} · {block.name}",
                    "kind": block.kind,
                },
                "classes": f"block kind{block.kind % len(BLOCK_TINTS)}",
            }
        )
        n = len(block.forward_ops)
        cols = max(1, math.ceil(n / ROWS))
        for j, o in enumerate(block.forward_ops):
            forward.add(o)
            op = ops[o]
            elements.append(
                {
                    "data": {
                        "id": f"{prefix}o{o}",
                        "parent": f"{prefix}b{block.index}",
                        "block": block.index,
                        "op": o,
                        "label": op.label.removeprefix("aten."),
                        "name": op.name,
                    },
                    "position": {"x": x0 + (j // ROWS) * DX, "y": y0 + (j % ROWS) * DY},
                    "classes": "op",
                }
            )
        x0 += cols * DX + 70
        row_height = max(row_height, min(n, ROWS) * DY)
    producer_op = {v.index: v.producer for v in values if v.producer in forward}
    for v, p in producer_op.items():
        for c in values[v].consumers:
            if c in forward:
                elements.append(
                    {
                        "data": {
                            "id": f"{prefix}e{v}-{c}",
                            "source": f"{prefix}o{p}",
                            "target": f"{prefix}o{c}",
                        }
                    }
                )
    return elements


def graph_stylesheet(
    fates: dict[str, Sequence[int]] | None = None,
    running: Sequence[int] = (),
    live: Sequence[int] = (),
    block: int | None = None,
    prefix: str = "",
) -> list[dict]:
    """Base style, plus: forward ops coloured by their fate in the plan (op indices per fate),
    the op(s) running at the step-through position, ops whose results are alive there, and the
    block running (ids under `prefix`, as in `graph_elements`)."""
    sheet: list[dict] = [
        {
            "selector": "node.op",
            "style": {
                "label": "data(label)",
                "font-size": 11,
                "min-zoomed-font-size": 7,  # hidden when zoomed out too far to read
                "width": 14,
                "height": 14,
                "background-color": "#9aa5b1",
                "text-valign": "bottom",
                "text-margin-y": 2,
            },
        },
        {
            "selector": "node.block",
            "style": {
                "label": "data(label)",
                "font-size": 11,
                "text-valign": "top",
                "text-halign": "center",
                "border-width": 1,
                "border-color": "#8a94a0",
                "padding": 12,
                "shape": "round-rectangle",
            },
        },
        {
            "selector": "edge",
            "style": {"width": 1, "line-color": "#c3cad3", "curve-style": "haystack"},
        },
    ]
    for k, tint in enumerate(BLOCK_TINTS):
        sheet.append({"selector": f".kind{k}", "style": {"background-color": tint}})
    for fate, ids in (fates or {}).items():
        if ids:
            sheet.append(
                {
                    "selector": ", ".join(f"#{prefix}o{o}" for o in ids),
                    "style": {"background-color": FATE_COLORS[fate]},
                }
            )
    if live:
        sheet.append(
            {
                "selector": ", ".join(f"#{prefix}o{o}" for o in live),
                "style": {"border-width": 3, "border-color": MARKER_COLOR},
            }
        )
    if block is not None:
        sheet.append(
            {
                "selector": f"#{prefix}b{block}",
                "style": {"border-width": 3, "border-color": MARKER_COLOR},
            }
        )
    if running:
        sheet.append(
            {
                "selector": ", ".join(f"#{prefix}o{o}" for o in running),
                "style": {
                    "width": 24,
                    "height": 24,
                    "background-color": MARKER_COLOR,
                    "border-width": 3,
                    "border-color": "#000",
                },
            }
        )
    return sheet
