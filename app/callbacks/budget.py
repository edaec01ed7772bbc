"""The budget: slider, typed box, trade-off clicks; the slider's hot path re-solves and
redraws every view of the plan in two requests side by side: the timeline and the numbers
(`solve`), then the graph's colours, the step's words, the footprint ("Will it fit?"), the
transfer lane, and the tensors, the arena and the compare view in sight (`paint`)."""

from __future__ import annotations

import logging
from typing import Any

from dash import Dash, Input, Output, State, no_update
from dash.exceptions import PreventUpdate

import core
from app import figures, ids
from app.callbacks.common import blank, fmt, plain_error, plan_sig, stamp
from app.callbacks.compare import COMPARED, compare_view
from app.callbacks.fit import FIT_VIEW, fit_view
from app.callbacks.graph import GRAPH_VIEW, graph_view
from app.callbacks.memory import arena_view, tensors_view, transfers_view
from app.explain import peak_hint
from app.state import Studio
from app.strategies import hint, is_strategy

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
# The plan's other views, from `paint`, a request beside `solve`'s (chained on the PLAN store,
# as they were, each cost a round trip and a paint more). The views far below the fold wait:
# those out of sight when the slider moves (the page's `data-visible`, kept by assets/app.js)
# are left as they were and listed in `data-skipped`; while one of them is stale in sight the
# page is dimmed and asks for it (`data-lagging`, `catch_up`). Redrawing charts nobody sees
# took a second of the browser's time under load (`remat bench --app`, docs/app.md).
# compare-a stands for both panels; the transfer lane (small, right under the timeline, shown
# with offloading on) is always drawn
DEFERRED = (ids.TENSORS, ids.ARENA, ids.COMPARE_A)
LATER = {
    "tensors": Output(ids.TENSORS, "figure", allow_duplicate=True),
    "transfers": Output(ids.TRANSFERS, "figure", allow_duplicate=True),
    "arena": Output(ids.ARENA, "figure", allow_duplicate=True),
    **{f"compare_{k}": v for k, v in COMPARED.items()},
}
VIEWS = {
    **{f"graph_{k}": v for k, v in GRAPH_VIEW.items()},
    **LATER,
    **FIT_VIEW,
    "skipped": Output(ids.NUMBERS, "data-skipped"),
}
VIEW_STATE = [
    State(ids.COMPARE_METHOD, "value"),
    State(ids.COMPARE_BUDGET, "value"),
    State(ids.COMPARE_DIFF, "data-b"),
]
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
# It moves in the page's plotly chart itself once a plan's views are drawn (the numbers'
# data-for changed) and the browser is idle: through the figure prop, plotly redrew the whole
# chart (100-130 ms under load) before the slider's request even left, and a relayout still
# costs 200-300 ms under load (dcc.Graph replots on its event). The figure the server sends
# next carries the budget it was drawn at.
MARK_BUDGET_JS = """function (drawn) {
  const gd = document.querySelector("#TRADEOFF .js-plotly-plot");
  if (!drawn || !gd || !window.Plotly) { return; }
  const move = () => {
    const line = gd.layout && gd.layout.shapes && gd.layout.shapes[0];
    const now = Number(drawn.split("|").pop());
    if (line && Number.isFinite(now) && line.x0 !== now) {
      window.Plotly.relayout(gd, {"shapes[0].x0": now, "shapes[0].x1": now});
    }
  };
  (window.requestIdleCallback || setTimeout)(move, {timeout: 3000});
}""".replace("TRADEOFF", ids.TRADEOFF)
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

    @app.callback(
        output=VIEWS,
        inputs=[Input(ids.BUDGET, "value"), Input(ids.CONTEXT, "data")],
        state=[State(ids.NUMBERS, "data-visible"), *VIEW_STATE],
        prevent_initial_call=True,
    )
    def paint(value, context, visible, method_b, pct_b, b_shown):
        """Beside `solve`, in a request of its own (so the timeline paints without waiting
        for the graph's restyle): the graph's colours, the step's words, the footprint and
        the views in sight; the others listed as skipped ("plan signature#ids")."""
        if not context or not context.get("key") or value is None:
            raise PreventUpdate
        ref = plan_ref(studio, context, value)
        wanted = set(DEFERRED) if visible is None else set(visible.split())
        views = plan_views(studio, ref, context, wanted, method_b, pct_b, b_shown)
        graph = graph_view(studio, ref, None)
        skipped = " ".join(v for v in DEFERRED if v not in wanted)
        return {
            **{f"graph_{k}": v for k, v in graph.items()},
            **views,
            **fit_view(studio, ref),
            "skipped": f"{ref['for']}#{skipped}",
        }

    @app.callback(
        output=LATER,
        inputs=[Input(ids.NUMBERS, "data-lagging")],
        state=[State(ids.PLAN, "data"), State(ids.CONTEXT, "data"), *VIEW_STATE],
        prevent_initial_call=True,
    )
    def catch_up(lagging, plan_ref, context, method_b, pct_b, b_shown):
        """Views the slider's request left out of sight, now in sight: "plan signature#ids"."""
        sig, _, wanted = (lagging or "").partition("#")
        if not plan_ref or plan_ref.get("for") != sig or not context or not context.get("key"):
            raise PreventUpdate
        return plan_views(studio, plan_ref, context, set(wanted.split()), method_b, pct_b, b_shown)

    app.clientside_callback(  # the budget's line on the trade-off chart, once it is drawn
        MARK_BUDGET_JS,
        Input(ids.NUMBERS, "data-for"),  # no output: the chart is moved in place
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
    if is_strategy(context["method"]):
        return imported_solved(studio, context, value, step)
    try:
        plan = studio.plan(key, method, budget)
    except Exception as err:  # an infeasible budget, in words under the slider
        if not isinstance(err, core.InfeasibleBudget):
            log.exception("solving %s with %s at %s bytes failed", key, method, budget)
        return no_plan(sig, label, err, "no plan at this budget")
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
        "plan": plan_ref(studio, context, value),
        "error": "",
        "error_hidden": True,
        "step": None if step is not None else no_update,
        "hint": peak_hint(plan.timeline),
    }


def no_plan(sig: str, label: str, err: Exception, text: str) -> dict[str, Any]:
    """`SOLVED`'s values when there is no plan: every plan view says so (the timeline with
    `text`), for these controls, and the error in words under the slider."""
    return {
        **dict.fromkeys(PLAN_NUMBERS, "–"),
        "timeline": blank(sig, text, 380),
        "budget": label,
        "plan": {"for": sig},
        "error": plain_error(err),
        "error_hidden": False,
        "step": None,
        "hint": "",
        "for": sig,
    }


def imported_solved(
    studio: Studio, context: dict, value: float, step: int | None
) -> dict[str, Any]:
    """`SOLVED`'s values for an imported strategy (`app.strategies`): its timeline and
    numbers as the native simulation predicts them (auto-SAC solved for the slider's
    budget), what the budget does to it said under the slider; or why it does not apply."""
    key, peak, method = context["key"], context["peak"], context["method"]
    budget = int(value / 100 * peak)
    label = f"{fmt(budget)} · {value:g}% of {fmt(peak)}"
    sig = plan_sig(context["for"], value)
    try:
        imported = studio.imported(key, method, budget)
    except Exception as err:  # not on this model, or torch's own tooling failed: in words
        if not isinstance(err, core.RematError):
            log.exception("importing %s on %s at %s bytes failed", method, key, budget)
        return no_plan(sig, label, err, "no prediction for this strategy here")
    problem = studio.problem(key)
    steps = imported.timeline
    p = imported.prediction
    fig = figures.timeline_figure(
        steps,
        imported.program.backward_start,
        budget,
        [b.name for b in problem.blocks],
        unit=figures.pick_unit(peak),
        updates=update_steps(problem, steps),
    )
    fig["layout"]["meta"]["budget_pct"] = value
    fig["layout"]["meta"]["strategy"] = method
    stamp(fig, sig)
    notes = " ".join(imported.notes)
    if imported.bound is not None:
        notes = f"Its own peak bound: {fmt(imported.bound)}. {notes}".strip()
    if context.get("offload") is None and "|on" in context["for"]:
        notes += " The offload switch is ours: the strategy runs as its own code does."
    return {
        "timeline": fig,
        "peak": fmt(p.peak),
        "overhead": f"{100 * (p.overhead - 1):.1f}%",
        "recomputed": f"{sum(1 for s in steps if s.recompute)}",
        "solve_time": "–",
        "host": "–",
        "native": fmt(p.peak),  # it is a native program: this is its prediction
        "budget": label,
        "for": sig,
        "plan": imported_ref(context, value),
        "error": "",
        "error_hidden": True,
        "step": None if step is not None else no_update,
        "hint": hint(method, p.peak, p.overhead, budget, peak, notes.strip()),
    }


def imported_ref(context: dict, value: float) -> dict[str, Any]:
    """The PLAN store's value for an imported strategy: its controls and which strategy;
    no plan of ours, so the plan views (`plan_of`) say they are drawn for ours only and the
    step-through has no steps."""
    return {
        "for": plan_sig(context["for"], value),
        "strategy": context["method"],
        "value": value,
        "copies": 0,
        "recomputes": 0,
        "steps": 0,
    }


def plan_ref(studio: Studio, context: dict, value: float) -> dict[str, Any]:
    """The PLAN store's value for a budget of `value`%: what names the plan (its controls,
    analysis, method, bytes) and what the page's buttons need; only its controls when no
    plan fits."""
    key, peak = context["key"], context["peak"]
    method = context.get("offload") or context["method"]
    budget = int(value / 100 * peak)
    sig = plan_sig(context["for"], value)
    if is_strategy(context["method"]):
        return imported_ref(context, value)
    try:
        plan = studio.plan(key, method, budget)
    except Exception:  # `solved` says why, under the slider
        return {"for": sig}
    return {
        "for": sig,
        "key": key,
        "method": method,
        "budget": budget,
        "value": value,
        "copies": len(plan.simulate().transfers),  # "next copy" is enabled only with some
        "recomputes": plan.recomputed_ops,  # and "next recompute"
        "steps": len(plan.program),  # play's ticks stop at the last (in the page)
    }


def plan_views(
    studio: Studio,
    plan_ref: dict,
    context: dict,
    wanted: set[str],
    method_b: str | None,
    pct_b: float | None,
    b_shown: str | None,
) -> dict[str, Any]:
    """`LATER`'s values for the plan `plan_ref` names (a blank "no plan" where none fits):
    the `wanted` views (ids in `DEFERRED`), no_update for the others. The transfer lane is
    drawn only with offloading on (hidden otherwise, which the page's watcher skips);
    `b_shown`: what compare's B panel shows (`compare_view`)."""
    out: dict[str, Any] = dict.fromkeys(LATER, no_update)
    if ids.TENSORS in wanted:
        out["tensors"] = tensors_view(studio, plan_ref)
    # with an imported strategy the switch may be on (the lane shown) with no offload method:
    # the lane says it is drawn for our plans
    if context.get("offload") or is_strategy(context["method"]):
        out["transfers"] = transfers_view(studio, plan_ref)
    if ids.ARENA in wanted:
        out["arena"] = arena_view(studio, plan_ref)
    if ids.COMPARE_A in wanted:
        compared = compare_view(studio, plan_ref, method_b, pct_b, context, b_shown)
        out.update({f"compare_{k}": v for k, v in compared.items()})
    return out


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
