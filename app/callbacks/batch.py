"""Memory against batch size (`app.batch`), for the plan on screen: each batch size is traced
once per analysis and solved again per budget (seconds on gpt2-small's first draw), so it
runs as a background job, on every model; the figure carries the plan's signature
(layout.meta.for), and the chart shows its own busy sign until it matches (assets/app.js),
never the page's."""

from __future__ import annotations

import logging

from dash import Dash, Input, Output
from dash.exceptions import PreventUpdate

from app import ids
from app.batch import BATCHES, batch_figure, batch_rows
from app.callbacks.common import NOT_OURS, blank, plain_error, stale_on_switch, stamp
from app.callbacks.fit import device_words
from app.figures.axes import empty_figure
from app.state import METHOD_LABELS, Studio, after_the_page, base_key
from core import BatchProblems, Interrupted, device_memory

log = logging.getLogger(__name__)


def register(app: Dash, studio: Studio) -> None:
    @app.callback(
        Output(ids.BATCH_FIG, "figure"),
        Output(ids.BATCH_TEXT, "children"),
        Input(ids.PLAN, "data"),
        background=True,
        cancel=stale_on_switch(),
        interval=250,
        prevent_initial_call=True,
    )
    def draw_batch(plan_ref):
        if plan_ref and plan_ref.get("strategy"):  # an imported strategy: ours only
            return blank(plan_ref["for"], NOT_OURS, 260), ""
        if not plan_ref or not plan_ref.get("key"):
            raise PreventUpdate
        try:
            return batch_view(studio, plan_ref)
        except Interrupted:
            raise PreventUpdate from None
        except Exception as err:  # shown under the chart; the page stays up
            log.exception("memory against batch size of %s failed", plan_ref["key"])
            return stamp(empty_figure(60), plan_ref["for"]), plain_error(err)


def batch_view(studio: Studio, plan_ref: dict) -> tuple[dict, str]:
    """The chart and its note for the plan on screen (cached per key, method, budget %; each
    batch size's trace is kept per analysis, so a budget move only solves again)."""
    key, sig = plan_ref["key"], plan_ref["for"]
    problem = studio.problem(key)
    model, _, device = key.split("|")[:3]
    preset = "cpu" if device == "here" else device
    method = plan_ref["method"]
    fraction = plan_ref["budget"] / problem.store_all_peak
    probe = studio.derived.get_or_make(("batch-probe", key), lambda: batch_probe(studio, key))

    def make():
        capacity = device_memory(preset)
        return batch_rows(probe, method, fraction, lock=after_the_page, capacity=capacity)

    rows, refused = studio.derived.get_or_make(("batch", key, method, round(fraction, 4)), make)
    label = f"{METHOD_LABELS.get(method, method)} at {100 * fraction:.0f}%"
    fig = batch_figure(rows, device_memory(preset), label, device_words(device))
    note = (
        f"Batch sizes {', '.join(str(r.batch) for r in rows)}, each traced and planned at "
        f"{100 * fraction:.0f}% of its own plain peak; AdamW's two moments counted. A gap: "
        "no plan at that budget."
    ) + "".join(left_out(refused))
    return stamp(fig, sig), note


def left_out(refused: list[tuple[int, str]]) -> list[str]:
    """The batch sizes not drawn, one sentence per reason: " Batches 8, 16 left out: ..."."""
    by_why: dict[str, list[int]] = {}
    for b, why in refused:
        by_why.setdefault(why, []).append(b)
    return [
        f" Batch{'es' if len(bs) > 1 else ''} {', '.join(map(str, bs))} left out: {why}."
        for why, bs in by_why.items()
    ]


def batch_probe(studio: Studio, key: str) -> BatchProblems:
    """The chart's per-batch problems for the analysis `key`. The analysis on screen is one of
    them when it was traced as they are (op times estimated, no step switch) at one of the
    chart's batch sizes: kept, not traced again (one trace of five; a minute for an 8B model
    at 8,192 tokens here)."""
    model, costs, device = key.split("|")[:3]
    probe = BatchProblems(studio.builders[model](), None, "cpu" if device == "here" else device)
    if costs == "estimated" and key == base_key(key):
        at = [b for b in BATCHES if probe.shapes(b) == probe.first]
        if at:
            probe.problems[at[0]] = studio.problem(key)
    return probe
