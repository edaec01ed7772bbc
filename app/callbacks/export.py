"""Download the plan on screen as a plan file."""

from __future__ import annotations

import logging
import os
import tempfile

from dash import Dash, Input, Output, State, dcc, no_update

from app import ids
from app.callbacks.common import plain_error, plan_of
from app.state import Studio

log = logging.getLogger(__name__)


def register(app: Dash, studio: Studio) -> None:
    @app.callback(
        output={
            "download": Output(ids.DOWNLOAD, "data"),
            "error": Output(ids.PLAN_ERROR, "children", allow_duplicate=True),
            "error_hidden": Output(ids.PLAN_ERROR, "hidden", allow_duplicate=True),
        },
        inputs=[Input(ids.EXPORT, "n_clicks")],
        state=[State(ids.PLAN, "data")],
        prevent_initial_call=True,
    )
    def export(_clicks, plan_ref):
        plan, _ = plan_of(studio, plan_ref)
        if plan is None:
            strategy = (plan_ref or {}).get("strategy")
            return {
                "download": no_update,
                "error": (
                    f"{strategy} is imported, not a plan of ours: it runs with its own code "
                    f"(core.strategies.by_method(problem, {strategy!r}) predicts it)."
                    if strategy
                    else "There is no plan to export yet: choose a feasible budget."
                ),
                "error_hidden": False,
            }
        try:
            with tempfile.TemporaryDirectory() as tmp:
                path = os.path.join(tmp, "plan.pkl")
                plan.save(path)
                with open(path, "rb") as f:
                    data = f.read()
        except Exception as err:
            log.exception("exporting the plan %s failed", plan_ref)
            return {
                "download": no_update,
                "error": f"Cannot export the plan: {plain_error(err)}",
                "error_hidden": False,
            }
        return {
            "download": dcc.send_bytes(data, "plan.pkl"),
            "error": no_update,
            "error_hidden": no_update,
        }
