"""Cancel: stop the work under way and put the controls back to what the page shows; the
transfer lane shown only with offloading on.

The busy bar itself is the page's watcher's (assets/app.js); this module only restores the
controls (from the CONTEXT and PLAN stores: what the views were drawn for) and says so."""

from __future__ import annotations

from dash import Dash, Input, Output, State

from app import ids

# The stores hold what the page shows: CONTEXT the analysis (key "model|costs|device"), PLAN
# the budget. Cancel writes them back into the controls; with nothing shown yet, it says so.
CANCEL_JS = """function (clicks, context, plan) {
  const nu = window.dash_clientside.no_update;
  if (!clicks) { return [nu, nu, nu, nu, nu, nu, nu, nu, nu, nu]; }
  if (!context || !context.for) {
    return [nu, nu, nu, nu, nu, nu, nu,
      "Cancelled. Nothing was shown yet: choose a model to analyse it.", false, ""];
  }
  const [model, where, method, switches] = context.for.split("|");
  const [offload, ...step] = switches.split("+");
  const costs = where === "here" ? "measured" : "estimated";
  const device = where === "here" ? nu : where;
  const budget = plan && plan.for ? Number(plan.for.split("|")[4]) : nu;
  const said = [model, where === "here" ? "measured here" : where, method,
    offload === "on" ? "with offloading" : "without offloading"];
  return [model, costs, device, method, offload === "on" ? ["on"] : [], step, budget,
    "Cancelled: the controls are back to what the page shows (" + said.join(", ") +
    (budget === nu ? "" : ", budget " + budget + "%") + ").", false, context.for];
}"""

# The note stays while the page shows what it restored, and goes with the next analysis.
HIDE_JS = """function (context, restored) {
  const nu = window.dash_clientside.no_update;
  return (context && restored && context.for !== restored) ? true : nu;
}"""


def register(app: Dash, studio: object) -> None:
    app.clientside_callback(
        CANCEL_JS,
        Output(ids.MODEL, "value"),
        Output(ids.COSTS, "value"),
        Output(ids.DEVICE, "value"),
        Output(ids.METHOD, "value"),
        Output(ids.OFFLOAD, "value"),
        Output(ids.STEP_OPTS, "value"),
        Output(ids.BUDGET, "value", allow_duplicate=True),
        Output(ids.CANCEL_NOTE, "children"),
        Output(ids.CANCEL_NOTE, "hidden"),
        Output(ids.CANCEL_NOTE, "data-for"),
        Input(ids.CANCEL, "n_clicks"),
        State(ids.CONTEXT, "data"),
        State(ids.PLAN, "data"),
        prevent_initial_call=True,
    )
    app.clientside_callback(  # measured here: the device menu does not apply
        """function (costs) { return [costs === "measured",
            costs === "measured" ? "op times are measured on this machine" : ""]; }""",
        Output(ids.DEVICE, "disabled"),
        Output(ids.DEVICE_NOTE, "children"),
        Input(ids.COSTS, "value"),
    )
    app.clientside_callback(  # the transfer lane only when offloading is on
        "function (on) { return !(on && on.length); }",
        Output(ids.TRANSFER_LANE, "hidden"),
        Input(ids.OFFLOAD, "value"),
    )
    app.clientside_callback(
        HIDE_JS,
        Output(ids.CANCEL_NOTE, "hidden", allow_duplicate=True),
        Input(ids.CONTEXT, "data"),
        State(ids.CANCEL_NOTE, "data-for"),
        prevent_initial_call=True,
    )
