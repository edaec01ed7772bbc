"""The transfer lane: copies to and from host memory, and the compute lane's stalls, on a
time axis."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from app.figures.axes import ms
from app.figures.palette import BACKGROUND, EDGE, TRANSFER_COLORS
from core import fmt_bytes

ROWS = {"offload": "offload (device→host)", "prefetch": "prefetch (host→device)"}


def transfer_figure(
    transfers: Sequence[Any],
    waits: Sequence[tuple[int, float, float]],
    value_names: Sequence[str],
    sizes: Sequence[int],
    link: str,
) -> dict:
    """The transfer lane on a time axis: each copy (`core.Transfer`: kind, value,
    step, start, end in seconds) a bar on its row, offloads and prefetches, and each stall
    of the compute lane, (run step, ready, started) from the simulation's `waits`, a red bar
    on a row of its own. `link` names the host link, in the title."""
    traces = [_copies(kind, transfers, value_names, sizes) for kind in ROWS]
    traces.append(_stalls(waits))
    stall = sum(started - ready for _, ready, started in waits)
    moved = sum(sizes[t.value] for t in transfers if t.kind == "offload")
    # two short lines: a chart's title does not wrap, and one line ran past a narrow chart
    title = (
        f"{len(transfers)} copies, {fmt_bytes(moved)} offloaded, stalls {ms(stall)}<br>{link}"
        if transfers
        else f"no copies: this plan keeps or recomputes every activation<br>{link}"
    )
    return {
        "data": traces,
        "layout": {
            "height": 240,
            "margin": {"l": 150, "r": 10, "t": 48, "b": 40},
            "title": {
                "text": title,
                "font": {"size": 12},
                "x": 0,
                "xanchor": "left",
            },
            "xaxis": {
                "automargin": True,
                "title": {"text": "time from the start of the training step (ms)"},
                "rangemode": "tozero",
            },
            "yaxis": {
                "categoryorder": "array",
                "categoryarray": ["compute stalls", *reversed(ROWS.values())],
            },
            "barmode": "overlay",
            "showlegend": False,
            "hovermode": "closest",
            "plot_bgcolor": BACKGROUND,
            "meta": {"copies": len(transfers), "stalls": len(waits), "link": link},
        },
    }


def _copies(
    kind: str, transfers: Sequence[Any], value_names: Sequence[str], sizes: Sequence[int]
) -> dict:
    """The bars of one kind of copy (offload or prefetch), on its row."""
    row = ROWS[kind]
    mine = [t for t in transfers if t.kind == kind]
    return {
        "type": "bar",
        "orientation": "h",
        "name": row,
        "y": [row] * len(mine),
        "base": [round(t.start * 1e3, 6) for t in mine],
        "x": [round((t.end - t.start) * 1e3, 6) for t in mine],
        "text": [
            f"step {t.step + 1}: {kind} {value_names[t.value]} "
            f"({fmt_bytes(sizes[t.value])}), {ms(t.start)}–{ms(t.end)}"
            for t in mine
        ],
        "hovertemplate": "%{text}<extra></extra>",
        "textposition": "none",
        "marker": {"color": TRANSFER_COLORS[kind], "line": {"width": 0.5, "color": EDGE}},
        "meta": kind,
    }


def _stalls(waits: Sequence[tuple[int, float, float]]) -> dict:
    """Each wait of the compute lane for a prefetch, a red bar on its own row."""
    return {
        "type": "bar",
        "orientation": "h",
        "name": "compute waits (stall)",
        "y": ["compute stalls"] * len(waits),
        "base": [round(ready * 1e3, 6) for _, ready, _ in waits],
        "x": [round((started - ready) * 1e3, 6) for _, ready, started in waits],
        "text": [
            f"step {step + 1} waits {ms(started - ready)} for a prefetch"
            for step, ready, started in waits
        ],
        "hovertemplate": "%{text}<extra></extra>",
        "textposition": "none",
        "marker": {"color": TRANSFER_COLORS["stall"]},
        "meta": "stall",
    }
