"""Measure here: run the plan on screen for real under the storage tracker, in the
background, and draw what was measured over the prediction."""

from __future__ import annotations

import logging

from dash import Dash, Input, Output, Patch, State, no_update
from dash.exceptions import PreventUpdate

from app import figures, ids
from app.callbacks.common import fmt, plain_error, shown
from app.measure import measure_plan
from app.state import Studio, studio_lock

log = logging.getLogger(__name__)

STRATEGY_MEASURED = (
    "An imported strategy runs with its own code, not as a plan of ours: `remat bench` "
    "measures it beside its prediction (bench/current.py, docs/results.md)."
)


def register(app: Dash, studio: Studio) -> None:
    @app.callback(
        Output(ids.MEASURED, "data"),
        Input(ids.MEASURE, "n_clicks"),
        State(ids.PLAN, "data"),
        background=True,
        running=[
            (Output(ids.MEASURE, "disabled"), True, False),
            (Output(ids.MEASURE_TEXT, "children"), "running the step…", ""),
        ],
        prevent_initial_call=True,
    )
    def measure_here(_clicks, plan_ref):
        """Run the plan's real step here under the storage tracker (in the background)."""
        if plan_ref and plan_ref.get("strategy"):  # imported: it runs with its own code
            return {"plan": plan_ref, "error": STRATEGY_MEASURED}
        plan, _ = shown(studio, plan_ref)
        try:
            call = studio.builders[plan_ref["key"].split("|")[0]]()
            with studio_lock():
                got = measure_plan(call, plan)
        except Exception as err:  # shown next to the button; the app stays up
            log.exception("measuring the plan %s failed", plan_ref)
            return {"plan": plan_ref, "error": plain_error(err)}
        return {"plan": plan_ref, "live": got.live, "peak": got.peak, "error": None}

    @app.callback(
        output={
            "timeline": Output(ids.TIMELINE, "figure", allow_duplicate=True),
            "text": Output(ids.MEASURE_TEXT, "children", allow_duplicate=True),
        },
        inputs=[Input(ids.MEASURED, "data")],
        state=[State(ids.PLAN, "data")],
        prevent_initial_call=True,
    )
    def draw_measured(measured, plan_ref):
        """Overlay the measured live bytes on the predicted timeline of the same plan."""
        if not measured or measured["plan"] != plan_ref:
            raise PreventUpdate  # another plan is on screen now
        if measured["error"] == STRATEGY_MEASURED:
            return {"timeline": no_update, "text": STRATEGY_MEASURED}
        plan, problem = shown(studio, plan_ref)
        if measured["error"]:
            return {"timeline": no_update, "text": f"Could not run the step: {measured['error']}"}
        _, size = figures.pick_unit(problem.store_all_peak)
        patch = Patch()
        patch["data"].append(figures.measured_trace(measured["live"], size, measured["peak"]))
        return {
            "timeline": patch,
            "text": (
                f"measured peak {fmt(measured['peak'])}, predicted {fmt(plan.predicted_peak)} "
                "(the tracker also counts the 4-byte seed of loss.backward())"
            ),
        }
