"""What several figures share: units, decimation, phase shading, times in words."""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from app.figures.palette import LABEL_TEXT

MAX_POINTS = 1000


def step_x(i: float) -> float:
    """Where program step `i` (0-based, as the simulator counts) sits on a program-step axis:
    the axes, the hovers, the stepper and the step text all count from 1."""
    return i + 1


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


def thin(indices: list[int], max_points: int) -> list[int]:
    """Every k-th of `indices`, so that at most about `max_points` remain."""
    if len(indices) > max_points:
        return indices[:: math.ceil(len(indices) / max_points)]
    return indices


def phase_rect(x0: float, x1: float, color: str) -> dict:
    """A shaded band over steps [x0, x1] behind the traces (a pass of the step)."""
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


def phase_label(x: float, text: str) -> dict:
    """A pass's name above its band."""
    return {
        "x": x,
        "y": 1.0,
        "xref": "x",
        "yref": "paper",
        "yanchor": "bottom",
        "text": text,
        "showarrow": False,
        "font": {"size": 11, "color": LABEL_TEXT},
    }


def ms(seconds: float) -> str:
    """A duration in words, ms or µs, three digits."""
    return f"{seconds * 1e3:.3g} ms" if seconds >= 1e-3 else f"{seconds * 1e6:.3g} µs"


def legend_below() -> dict:
    """A horizontal legend pinned to the figure's bottom edge (container coordinates), under
    the x-axis title whatever the plot's height or the legend's rows: a legend placed in plot
    coordinates rode up over the title when the page narrowed and the legend wrapped."""
    return {
        "orientation": "h",
        "yref": "container",
        "y": 0,
        "yanchor": "bottom",
        "x": 0,
        "font": {"size": 11},
    }


def empty_figure(height: int) -> dict:
    """A figure with nothing drawn yet (or nothing to draw): no margins and no axes, so a
    short placeholder leaves plotly a plot area of positive size however it is resized."""
    return {
        "data": [],
        "layout": {
            "height": height,
            "margin": {"l": 0, "r": 0, "t": 0, "b": 0},
            "xaxis": {"visible": False},
            "yaxis": {"visible": False},
        },
    }
