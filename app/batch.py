"""Memory against batch size: the whole training footprint (parameters, AdamW's state, the
batch, the step's peak) of plain PyTorch and of the method on screen at the same budget
fraction, per batch size, against the device preset's memory (`core.fit`'s probes, which
trace each batch on fake tensors, and `core.solve`)."""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass

import core
from app.cache import check_cancelled
from app.figures.axes import legend_below
from app.figures.fit import SMALL, capacity_break
from app.figures.palette import BACKGROUND, BUDGET_COLOR, METHOD_COLORS
from core import BatchProblems, fmt_bytes, optimizer_bytes

BATCHES = (1, 2, 4, 8, 16)  # each one a trace and a solve: seconds on the tiny models
GIB = 1 << 30


@dataclass(frozen=True)
class BatchRow:
    batch: int
    fixed: int  # parameters and buffers, AdamW's state, the batch
    eager: int  # fixed + plain PyTorch's peak
    ours: int | None  # fixed + the plan's peak at the same fraction; None: infeasible
    overhead: float | None


def batch_rows(
    probe: BatchProblems,
    method: str,
    fraction: float,
    batches=BATCHES,
    lock: Callable[[], AbstractContextManager] | None = None,
    capacity: int | None = None,
) -> tuple[list[BatchRow], list[tuple[int, str]]]:
    """Each batch size's footprint, eager and `method` at `fraction` of that batch's
    store-all peak (the budget slider's meaning), and the batch sizes whose step does not
    trace, with why (batch-norm in training needs two samples: a batch of 1 is refused).
    `probe` keeps each batch's trace, so another budget only solves again; each trace is
    taken under a fresh `lock()` (tracing patches process-wide state). Raises the first refusal when
    no batch size traces. With the device's `capacity`, the larger batch sizes are left out,
    not traced, once a batch's floor (the least any plan holds) with its fixed bytes is over
    it (an 8B model at 8,192 tokens: a minute per trace here)."""
    rows, refused = [], []
    for i, b in enumerate(batches):
        check_cancelled()
        try:
            with lock() if lock else nullcontext():
                problem = probe.problem(b)
        except core.UnsupportedModel as e:
            refused.append((b, str(e).split(": check that")[0]))
            if len(refused) == len(batches):
                raise
            continue
        fixed = problem.param_bytes + optimizer_bytes(problem, "adamw") + problem.input_bytes
        try:
            plan = core.solve(problem, int(fraction * problem.store_all_peak), method)
            ours, over = fixed + plan.predicted_peak, plan.overhead
        except core.InfeasibleBudget:
            ours, over = None, None
        rows.append(BatchRow(b, fixed, fixed + problem.store_all_peak, ours, over))
        least = fixed + problem.floor.nbytes
        if capacity is not None and least > capacity and i + 1 < len(batches):
            why = (
                f"not traced: at batch {b} the floor and the fixed bytes alone, "
                f"{fmt_bytes(least)}, are over the device's {fmt_bytes(capacity)}"
            )
            refused.extend((later, why) for later in batches[i + 1 :])
            break
    return rows, refused


def batch_figure(rows: list[BatchRow], capacity: int, label: str, device_words: str) -> dict:
    """Lines of eager's and `label`'s footprint against batch size, and the capacity line;
    when every footprint is under `SMALL` of the device's memory, the axis ends at the data
    and the device's memory is named at its break instead (a flat line at the bottom
    otherwise)."""
    largest = max(r.eager for r in rows)
    broken = largest < SMALL * capacity
    biggest = largest if broken else max(largest, capacity)
    size, unit = (GIB, "GiB") if biggest >= GIB // 4 else (1 << 20, "MiB")
    xs = [r.batch for r in rows]

    def line(name: str, ys: list, color: str, dash: str = "solid") -> dict:
        return {
            "type": "scatter",
            "mode": "lines+markers",
            "name": name,
            "x": xs,
            "y": [None if y is None else round(y / size, 4) for y in ys],
            "line": {"color": color, "dash": dash},
            "customdata": ["–" if y is None else fmt_bytes(y) for y in ys],
            "hovertemplate": f"{name}, batch %{{x}}: %{{customdata}}<extra></extra>",
        }

    traces = [
        line("parameters + AdamW state + batch", [r.fixed for r in rows], "#9a9a9a", "dot"),
        line("plain PyTorch (eager)", [r.eager for r in rows], METHOD_COLORS["store_all"]),
        line(label, [r.ours for r in rows], METHOD_COLORS.get("rockmate", "#4c78a8")),
    ]
    return {
        "data": traces,
        "layout": {
            "height": 260,
            "margin": {"l": 60, "r": 10, "t": 28, "b": 90},
            "title": {"text": f"{device_words}: {fmt_bytes(capacity)}", "font": {"size": 12}},
            "xaxis": {
                "automargin": True,
                "title": {"text": "batch size"},
                "type": "log",
                "tickvals": xs,
            },
            "yaxis": {
                "automargin": True,
                "title": {"text": f"training memory ({unit})"},
                "rangemode": "tozero",
            },
            "annotations": [capacity_break(capacity, largest, device_words, inside=True)]
            if broken
            else [],
            "shapes": []
            if broken
            else [
                {
                    "type": "line",
                    "xref": "paper",
                    "yref": "y",
                    "x0": 0,
                    "x1": 1,
                    "y0": capacity / size,
                    "y1": capacity / size,
                    "line": {"color": BUDGET_COLOR, "width": 2, "dash": "dash"},
                }
            ],
            "legend": legend_below(),
            "plot_bgcolor": BACKGROUND,
            "meta": {"capacity": capacity, "unit": unit, "scale": "break" if broken else "device"},
        },
    }
