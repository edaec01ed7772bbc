"""The budget: slider, typed box, trade-off clicks; the slider's hot path re-solves and
redraws the timeline and the numbers."""

from __future__ import annotations

import logging
from typing import Any

from dash import Dash, Input, Output, State, no_update
from dash.exceptions import PreventUpdate

import core
from app import figures, ids
from app.callbacks.common import blank, fmt, plain_error, plan_sig, stamp
from app.explain import peak_hint
from app.state import Studio

log = logging.getLogger(__name__)

SOLVED = {
    "timeline": Output(ids.TIMELINE, "figure"),
    "peak": Output(ids.PEAK, "children"),
    "overhead": Output(ids.OVERHEAD, "children"),
    "recomputed": Output(ids.RECOMPUTED, "children"),
    "solve_time": Output(ids.SOLVE_TIME, "children"),
    "host": Output(ids.HOST, "children"),
    "native": Output(ids.NATIVE_PEAK, "children"),
    "budget": Output(ids.BUDGET_BYTES, "children"),
    "plan": Output(ids.PLAN, "data"),
    "error": Output(ids.PLAN_ERROR, "children"),
    "error_hidden": Output(ids.PLAN_ERROR, "hidden"),
    "step": Output(ids.STEP, "data"),
    "hint": Output(ids.BUDGET_HINT, "children"),
    "for": Output(ids.NUMBERS, "data-for"),
}
# The slider and the typed box follow each other in one callback (two would be a loop): a
# typed budget sets the slider or says why not (`remat.typedBudget`, assets/app.js); a slider
# move writes its value in the box and retires a refused typed budget's message.
FOLLOW = (
    Output(ids.BUDGET, "value", allow_duplicate=True),
    Output(ids.BUDGET_INPUT, "value"),
    Output(ids.BUDGET_MESSAGE, "children"),
    Output(ids.BUDGET_MESSAGE, "hidden"),
    Input(ids.BUDGET, "value"),
    Input(ids.BUDGET_INPUT, "value"),
    State(ids.CONTEXT, "data"),
)
FOLLOW_JS = """function (value, typed, context) {
  const dc = window.dash_clientside, nu = dc.no_update;
  const fired = dc.callback_context.triggered.map(t => t.prop_id);
  if (fired.some(p => p.startsWith("BOX."))) {
    const [v, message, hidden] = dc.remat.typedBudget(typed, context);
    return [v, v === nu ? nu : String(v), message, hidden];
  }
  if (value === null || value === undefined) { return [nu, nu, nu, nu]; }
  return [nu, String(value), nu, true];
}""".replace("BOX", ids.BUDGET_INPUT)
# The trade-off chart comes from its own job (`draw_curves`), after the first timeline: until
# it has its budget line (shapes[0], `figures.budget_shape`) there is nothing to move.
MARK_BUDGET_JS = """function (value, fig) {
  const dc = window.dash_clientside;
  if (value === null || value === undefined || !fig || !fig.layout || !fig.layout.shapes
      || !fig.layout.shapes.length) { return dc.no_update; }
  const patch = new dc.Patch();
  patch.assign(["layout", "shapes", 0, "x0"], value);
  patch.assign(["layout", "shapes", 0, "x1"], value);
  return patch.build();
}"""
PLAN_NUMBERS = ("timeline", "peak", "overhead", "recomputed", "solve_time", "host", "native")


def register(app: Dash, studio: Studio) -> None:
    app.clientside_callback(FOLLOW_JS, *FOLLOW, prevent_initial_call=True)

    app.clientside_callback(  # "next copy" does something only on a plan with copies
        "function (plan) { return !(plan && plan.copies > 0); }",
        Output(ids.JUMP_TRANSFER, "disabled"),
        Input(ids.PLAN, "data"),
    )

    @app.callback(
        output=SOLVED,
        inputs=[Input(ids.BUDGET, "value"), Input(ids.CONTEXT, "data")],
        state=[State(ids.STEP, "data")],
        prevent_initial_call=True,
    )
    def solve(value, context, step):
        """The slider's hot path: re-solve (cached), redraw the timeline and the numbers."""
        if not context or not context.get("key") or value is None:
            raise PreventUpdate
        return solved(studio, context, value, step)

    app.clientside_callback(  # the budget's line on the trade-off chart, once it is drawn
        MARK_BUDGET_JS,
        Output(ids.TRADEOFF, "figure", allow_duplicate=True),
        Input(ids.BUDGET, "value"),
        State(ids.TRADEOFF, "figure"),
        prevent_initial_call=True,
    )

    @app.callback(
        Output(ids.BUDGET, "value", allow_duplicate=True),
        Input(ids.TRADEOFF, "clickData"),
        State(ids.CONTEXT, "data"),
        prevent_initial_call=True,
    )
    def pick_budget(click, context):
        if not click or not click.get("points") or not context or not context.get("key"):
            raise PreventUpdate
        x = float(click["points"][0]["x"])
        return max(context["min_pct"], min(100.0, round(x * 2) / 2))


def solved(studio: Studio, context: dict, value: float, step: int | None) -> dict[str, Any]:
    """`SOLVED`'s values for a budget of `value`% of the store-all peak: the plan's timeline
    and numbers, or the reason there is no plan."""
    key, peak = context["key"], context["peak"]
    method = context.get("offload") or context["method"]
    budget = int(value / 100 * peak)
    label = f"{fmt(budget)} · {value:g}% of {fmt(peak)}"
    sig = plan_sig(context["for"], value)
    try:
        plan = studio.plan(key, method, budget)
    except Exception as err:  # an infeasible budget, in words under the slider
        if not isinstance(err, core.InfeasibleBudget):
            log.exception("solving %s with %s at %s bytes failed", key, method, budget)
        return {  # no plan: every plan view says so, for these controls
            **dict.fromkeys(PLAN_NUMBERS, "–"),
            "timeline": blank(sig, "no plan at this budget", 380),
            "budget": label,
            "plan": {"for": sig},
            "error": plain_error(err),
            "error_hidden": False,
            "step": None,
            "hint": "",
            "for": sig,
        }
    problem = studio.problem(key)
    sim = plan.simulate()
    fig = figures.timeline_figure(
        plan.timeline,
        plan.backward_start,
        budget,
        [b.name for b in problem.blocks],
        unit=figures.pick_unit(peak),
        host=sim.host,
        updates=update_steps(problem, plan.timeline),
    )
    fig["layout"]["meta"]["budget_pct"] = value
    stamp(fig, sig)
    return {
        "timeline": fig,
        "peak": fmt(plan.predicted_peak),
        "overhead": f"{100 * (plan.overhead - 1):.1f}%",
        "recomputed": f"{plan.recomputed_ops}",
        "solve_time": f"{plan.solve_seconds * 1e3:.0f} ms",
        "host": fmt(sim.host_peak) if context.get("offload") else "–",
        "native": native_peak(studio, key, method, budget),
        "budget": label,
        "for": sig,
        "plan": {
            "for": sig,
            "key": key,
            "method": method,
            "budget": budget,
            "value": value,
            "copies": len(sim.transfers),  # "next copy" is enabled only when there are some
            "recomputes": plan.recomputed_ops,  # and "next recompute"
            "steps": len(plan.program),  # play's ticks stop at the last (in the page)
        },
        "error": "",
        "error_hidden": True,
        "step": None if step is not None else no_update,
        "hint": peak_hint(plan.timeline),
    }


def native_peak(studio: Studio, key: str, method: str, budget: int) -> str:
    """The plan's native peak in words; a dash (and the log) when it cannot be lowered."""
    try:
        return fmt(studio.native_peak(key, method, budget))
    except Exception:
        log.exception("lowering %s %s at %s bytes failed", key, method, budget)
        return "–"


def update_steps(problem, steps) -> list[int]:
    """The timeline's steps that run an optimizer's update (`Op.update`)."""
    ops = problem.graph.ops
    return [i for i, s in enumerate(steps) if s.kind == "run" and ops[s.target].update]
