"""The per-tensor view: each live storage a band over program steps, stacked in allocation
order (as pytorch.org/memory_viz draws allocations)."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from app.figures.axes import legend_below, phase_rect, pick_unit, step_x
from app.figures.hover import hover_html
from app.figures.palette import BACKGROUND, BACKWARD_SHADE, BAND_COLORS, EDGE, REST, UNKNOWN

MAX_BANDS = 120  # storages drawn one by one in the per-tensor view; smaller ones are summed
LEGEND = (
    ("kept", "kept for the backward"),
    ("recomputed", "recomputed"),
    ("offloaded", "offloaded to host"),
    ("freed", "freed in the forward"),
    ("temporary", "temporary"),
    ("gradient", "gradient"),
)


def tensor_figure(
    rows: Sequence[dict],
    n_steps: int,
    backward_start: int,
    unit: tuple[str, float] | None = None,
    max_bands: int = MAX_BANDS,
) -> dict:
    """Each live storage as a band over program steps, stacked in allocation order: a band
    slides down when one below it is freed.

    `rows` are dicts (start, end, nbytes, fate, text) from `app.explain.tensor_rows`, steps
    [start, end); `text` a `Note` or plain hover text. The `max_bands` largest are drawn one
    by one; the rest are summed into one grey band on top, so every step's stack still
    equals the live total.
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
    name, size = unit or pick_unit(int(total.max(initial=0)))
    outlines = [
        _band_outline(
            offsets[k][rows[i]["start"] : rows[i]["end"]], rows[i]["start"], rows[i]["nbytes"], size
        )
        for k, i in enumerate(chosen)
    ]
    traces = _fills(rows, chosen, outlines) + [_hover_points(rows, chosen, outlines)]
    rest = total - drawn
    if len(rows) > len(chosen) and rest.any():
        traces.append(_rest(drawn, rest, n_steps, len(rows) - len(chosen), size))
    legend = [
        {
            "type": "scatter",
            "mode": "markers",
            "x": [None],
            "y": [None],
            "name": label,
            "marker": {"symbol": "square", "size": 12, "color": BAND_COLORS[key]},
        }
        for key, label in LEGEND
    ]
    return {
        "data": traces + legend,
        "layout": {
            "height": 380,
            "margin": {"l": 60, "r": 10, "t": 24, "b": 110},
            "xaxis": {
                "automargin": True,
                "title": {"text": "program step (from 1)"},
                "showgrid": False,
            },
            "yaxis": {"title": {"text": f"live memory ({name})"}, "rangemode": "tozero"},
            "hovermode": "closest",
            "legend": legend_below(),
            "shapes": [
                phase_rect(step_x(backward_start - 0.5), step_x(n_steps - 0.5), BACKWARD_SHADE)
            ],
            "plot_bgcolor": BACKGROUND,
            "meta": {"unit": name, "bands": len(chosen), "storages": len(rows)},
        },
    }


def _fills(rows: Sequence[dict], chosen: Sequence[int], outlines: Sequence[tuple]) -> list:
    """The bands, one filled trace per fate (each band a closed shape, shapes apart by a
    gap): a handful of traces, not one per storage, so the page redraws them at once."""
    by_fate: dict[str, tuple[list, list]] = {}
    for i, (x, top, bottom) in zip(chosen, outlines):
        xs, ys = by_fate.setdefault(rows[i]["fate"], ([], []))
        xs += [*x, *x[::-1], None]
        ys += [*top, *bottom[::-1], None]
    return [
        {
            "type": "scatter",
            "mode": "lines",
            "x": xs,
            "y": ys,
            "fill": "toself",
            "fillcolor": BAND_COLORS.get(fate, UNKNOWN),
            "line": {"width": 0.5, "color": EDGE},
            "hoverinfo": "skip",
            "name": fate,
            "showlegend": False,
            "meta": "bands",
        }
        for fate, (xs, ys) in by_fate.items()
    ]


def _hover_points(rows: Sequence[dict], chosen: Sequence[int], outlines: Sequence[tuple]) -> dict:
    """Each band's words, at the middle of each stretch where it sits still (one invisible
    marker each): what pointing at a band shows."""
    x: list[float] = []
    y: list[float] = []
    text: list[str] = []
    for i, (bx, top, bottom) in zip(chosen, outlines):
        words = hover_html(rows[i]["text"])
        for j in range(0, len(bx), 2):  # a stretch: two corners at one height
            x.append(round((bx[j] + bx[j + 1]) / 2, 2))
            y.append(round((top[j] + bottom[j]) / 2, 4))
            text.append(words)
    return {
        "type": "scatter",
        "mode": "markers",
        "x": x,
        "y": y,
        "text": text,
        "marker": {"size": 14, "opacity": 0},
        "hoverinfo": "text",
        "showlegend": False,
        "name": "storages",
        "meta": "hover",
    }


def _rest(drawn: np.ndarray, rest: np.ndarray, n_steps: int, count: int, size: float) -> dict:
    """The storages not drawn one by one, summed into one grey band on top."""
    steps = list(range(n_steps))
    x = [step_x(i) for i in steps]
    return {
        "type": "scatter",
        "mode": "lines",
        "x": x + x[::-1],
        "y": [round(float(drawn[i] + rest[i]) / size, 4) for i in steps]
        + [round(float(drawn[i]) / size, 4) for i in reversed(steps)],
        "fill": "toself",
        "fillcolor": REST,
        "line": {"width": 0, "shape": "hv"},
        "hoveron": "fills",
        "hoverinfo": "text",
        "text": f"{count} smaller storages",
        "name": "smaller storages",
        "showlegend": False,
        "meta": "rest",
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
            x.append(step_x(edge))
            bottom.append(round(low, 4))
            top.append(round(low + nbytes / size, 4))
    return x, top, bottom
