"""Beyond one device: the devices control, and per-device memory of the layout the planner
chooses (`core.parallel_plan`) and of its alternatives.

The plan re-traces the model once per tensor-parallel degree (seconds), so it runs as a
background job; the card carries what it was drawn for (`data-for`, `data-devices`), so the
page's watcher shows the busy bar until it matches the controls."""

from __future__ import annotations

import logging

from dash import Dash, Input, Output, State, html
from dash.exceptions import PreventUpdate

from app import ids
from app.callbacks.common import plain_error, stale_on_switch
from app.figures.axes import empty_figure
from app.figures.parallel import parallel_figure
from app.state import PARALLEL_MAX_OPS, Studio
from core import Interrupted, fmt_bytes

log = logging.getLogger(__name__)

EMPTY = empty_figure(60)

# cancel: the devices control back to what the card shows
RESTORE_JS = """function (clicks, drawn) {
  const nu = window.dash_clientside.no_update;
  return (clicks && drawn) ? Number(drawn) : nu;
}"""


def register(app: Dash, studio: Studio) -> None:
    @app.callback(
        output={
            "fig": Output(ids.PARALLEL_FIG, "figure"),
            "text": Output(ids.PARALLEL_TEXT, "children"),
            "for": Output(ids.PARALLEL_CARD, "data-for"),
            "devices": Output(ids.PARALLEL_CARD, "data-devices"),
        },
        inputs=[Input(ids.CONTEXT, "data"), Input(ids.DEVICES_N, "value")],
        background=True,
        cancel=stale_on_switch(),
        interval=250,
        prevent_initial_call=True,
    )
    def draw_parallel(context, devices):
        if not context:
            raise PreventUpdate
        out = {"for": context["for"], "devices": str(devices)}
        if context.get("error") or not context.get("key"):
            return {**out, "fig": EMPTY, "text": ""}
        try:
            fig, text = parallel_view(studio, context["key"], int(devices))
        except Interrupted:
            raise PreventUpdate from None
        except Exception as err:  # shown in the card; the page stays up
            log.exception("parallel plan of %s over %s devices failed", context["key"], devices)
            fig, text = EMPTY, [html.P(plain_error(err), className="message warn")]
        return {**out, "fig": fig, "text": text}

    app.clientside_callback(
        RESTORE_JS,
        Output(ids.DEVICES_N, "value", allow_duplicate=True),
        Input(ids.CANCEL, "n_clicks"),
        State(ids.PARALLEL_CARD, "data-devices"),
        prevent_initial_call=True,
    )


def parallel_view(studio: Studio, key: str, devices: int) -> tuple[dict, list]:
    """The card's figure and words for the analysis `key` over `devices` devices."""
    problem = studio.problem(key)
    if len(problem.graph.ops) > PARALLEL_MAX_OPS:
        return EMPTY, [
            html.P(
                f"Shown for small models only (up to {PARALLEL_MAX_OPS} ops; this one has "
                f"{len(problem.graph.ops)}): the planner re-traces the model once per "
                "tensor-parallel degree, which takes minutes here. `remat parallel MODEL "
                "--devices N` prints the same table.",
                className="hint",
            )
        ]
    plan = studio.parallel(key, devices)
    device = key.split("|")[2]
    where = "this machine's memory" if device in ("cpu", "here") else f"the {device} preset's"
    best = plan.best
    said = (
        f"Chosen: {best.name}, {fmt_bytes(best.memory.total)} per device, "
        f"predicted step {best.time.total * 1e3:.3g} ms for {best.dp} micro-batch(es)."
        if best
        else "No layout fits: every one needs more memory per device than there is."
    )
    words = [
        html.P(
            f"{devices} device(s) of {fmt_bytes(plan.memory)} each ({where}), link "
            f"{plan.link.name}. {said}"
        )
    ]
    if best and best.tp > 1 and best.kinds:
        words.append(html.P("Sharded: " + "; ".join(best.kinds), className="hint"))
    if plan.refused:
        words.append(
            html.P(f"Replicated, not sharded: {'; '.join(plan.refused[:3])}", className="hint")
        )
    return parallel_figure(plan), words
