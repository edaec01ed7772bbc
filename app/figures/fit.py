"""Will it fit: the training footprint (`core.Footprint`) of plain PyTorch and of the
plan on screen, stacked against the device's memory."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from app.figures.axes import legend_below
from app.figures.palette import BACKGROUND, BUDGET_COLOR, KIND_COLORS
from core import fmt_bytes

FIXED_COLORS = {
    "parameters and buffers": "#5b5b5b",
    "optimizer state (AdamW)": "#9a9a9a",
    "inputs": "#c7c7c7",
}
GIB = 1 << 30
# Below this share of the device's memory, a bar drawn to the device's scale is a hairline
# (gpt-tiny's 5.5 MiB on 80 GiB): the axis then ends at the data and the device's line is
# named at the axis' break instead of drawn.
SMALL = 0.01


def capacity_break(capacity: int, biggest: int, device_words: str, inside: bool = False) -> dict:
    """The device's memory, off the scale: an annotation at the axis' right end (a break),
    above the plot or, `inside`, in its top right corner."""
    return {
        "xref": "paper",
        "yref": "paper",
        "x": 1,
        "y": 1,
        "xanchor": "right",
        "yanchor": "top" if inside else "bottom",
        "text": f"// {device_words}, {fmt_bytes(capacity)}, is off this scale: "
        f"{capacity / biggest:,.0f}× the largest total here",
        "showarrow": False,
        "font": {"size": 11, "color": BUDGET_COLOR},
    }


def fit_figure(rows: Sequence[tuple[str, Any]], device_words: str) -> dict:
    """One horizontal stacked bar per (label, footprint) in `rows`, in GiB (MiB for small
    footprints), with the device's memory as a line and each row's total in words. When the
    largest total is under `SMALL` of the device's memory, the axis ends at the data and the
    device's memory is named at its break, so the bars can be seen."""
    biggest = max(f.total for _, f in rows)
    capacity = rows[0][1].capacity
    broken = biggest < SMALL * capacity
    top = biggest if broken else max(biggest, capacity)
    size, unit = (GIB, "GiB") if top >= GIB // 4 else (1 << 20, "MiB")
    labels = [label for label, _ in rows]
    traces = []
    for i, (part, _) in enumerate(rows[0][1].parts()):
        values = [f.parts()[i][1] for _, f in rows]
        traces.append(
            {
                "type": "bar",
                "orientation": "h",
                "name": part,
                "y": labels,
                "x": [v / size for v in values],
                "marker": {"color": KIND_COLORS.get(part) or FIXED_COLORS.get(part, "#888")},
                "customdata": [fmt_bytes(v) for v in values],
                "hovertemplate": f"{part}: %{{customdata}}<extra></extra>",
            }
        )
    notes = [
        {
            "x": f.total / size,
            "y": label,
            "xanchor": "left",
            "text": f" {fmt_bytes(f.total)} ({100 * f.total / f.capacity:.2g}%)",
            "showarrow": False,
            "font": {"size": 11},
        }
        for label, f in rows
    ]
    return {
        "data": traces,
        "layout": {
            "height": 200,
            "barmode": "stack",
            "margin": {"l": 90, "r": 10, "t": 28, "b": 100},
            "title": {
                "text": f"{device_words}: {fmt_bytes(capacity)}",
                "font": {"size": 12},
                "x": 0,
                "xanchor": "left",
            },
            "xaxis": {
                "automargin": True,
                "title": {"text": f"memory at the peak step ({unit})"},
                "range": [0, top / size * (1.4 if broken else 1.12)],
            },
            "yaxis": {"autorange": "reversed"},
            "shapes": []
            if broken
            else [
                {
                    "type": "line",
                    "xref": "x",
                    "yref": "paper",
                    "x0": capacity / size,
                    "x1": capacity / size,
                    "y0": 0,
                    "y1": 1,
                    "line": {"color": BUDGET_COLOR, "width": 2, "dash": "dash"},
                }
            ],
            "annotations": notes
            + ([capacity_break(capacity, biggest, device_words)] if broken else []),
            "legend": legend_below(),
            "plot_bgcolor": BACKGROUND,
            "meta": {
                "unit": unit,
                "capacity": capacity,
                "totals": [f.total for _, f in rows],
                "scale": "break" if broken else "device",
            },
        },
    }
