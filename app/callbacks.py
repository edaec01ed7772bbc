"""Callbacks: thin glue from page events to `app.state` (core, cached) and `app.figures`."""

from __future__ import annotations

import os
import tempfile
import traceback

from dash import (
    ClientsideFunction,
    Dash,
    Input,
    Output,
    Patch,
    State,
    ctx,
    dcc,
    html,
    no_update,
    set_props,
)
from dash.exceptions import PreventUpdate

import core
from app import figures, ids
from app.arena import arena_figure
from app.cache import Cancelled
from app.layout import intro
from app.measure import measure_plan
from app.state import (
    BASELINES,
    METHOD_LABELS,
    Studio,
    alive_at,
    link_text,
    next_recompute,
    next_transfer,
    op_fates,
    peak_hint,
    peak_step,
    percent,
    slider_minimum,
    step_view,
    studio_lock,
)
from core.errors import fmt_bytes
from core.layout import arena

HIDDEN, SHOWN = {"display": "none"}, {"display": "flex"}
PEAK_ROWS = 10  # storages listed at the peak


def plain_error(err: BaseException) -> str:
    """An exception in words a user can act on."""
    if isinstance(err, core.UnsupportedModel):
        return f"This model cannot be traced: {err}"
    if isinstance(err, core.InfeasibleBudget):
        return f"Impossible budget: {err}"
    if isinstance(err, core.errors.RematError):
        return str(err)
    return f"Something went wrong ({type(err).__name__}): {err}"


def register(app: Dash, studio: Studio) -> None:
    """Every callback of the page, by concern."""
    _analysis(app, studio)
    _budget(app, studio)
    _graph(app, studio)
    _memory(app, studio)
    _step_through(app, studio)
    _export(app, studio)


def _analysis(app: Dash, studio: Studio) -> None:
    """Analyse the chosen model in the background and show what it gives: intro, graph, limits."""

    @app.callback(
        Output(ids.CONTEXT, "data"),
        Input(ids.MODEL, "value"),
        Input(ids.COSTS, "value"),
        Input(ids.DEVICE, "value"),
        Input(ids.METHOD, "value"),
        Input(ids.OFFLOAD, "value"),
        background=True,
        progress=[Output(ids.PROGRESS_BAR, "value"), Output(ids.PROGRESS_TEXT, "children")],
        progress_default=["0", ""],
        running=[(Output(ids.PROGRESS, "style"), SHOWN, HIDDEN)],
        cancel=[Input(ids.CANCEL, "n_clicks")],
        interval=250,
    )
    def prepare(set_progress, model, costs, device, method, offload):
        """Analyse the model (trace, costs, blocks) and the method's trade-off, in the
        background; with the offload switch on, the remat+offload curve too."""
        key = studio.key(model, costs, device)

        def report(stage: str, frac: float) -> None:  # the analysis is 2-75% of the bar
            set_progress([str(int(2 + 73 * frac)), f"{model}: {stage}…"])

        try:
            problem = studio.problem(key, report)
            methods = studio.methods(problem)
            if method not in methods:
                method = studio.default_method()
            set_progress(["78", f"{model}: solving {method} at several budgets…"])
            minimum = studio.minimum(key, method)
            for i, m in enumerate(m for m in BASELINES if m in methods):
                set_progress([str(85 + 5 * i), f"{model}: the trade-off of {m}…"])
                studio.tradeoff(key, m)
            peak = problem.store_all_peak
            numbers = {
                "store_all_peak": peak,
                "store_all_time": problem.store_all_time,
                "cost_model": problem.cost_model,
                "n_blocks": len(problem.blocks),
            }
            if "checkpoint_blocks" in methods:
                ck = studio.tradeoff(key, "checkpoint_blocks")
                if ck:
                    p = min(ck, key=lambda p: p.budget)
                    numbers["ckpt_peak"] = p.peak
                    numbers["ckpt_time"] = p.overhead * problem.store_all_time
            offload_method = studio.offload_method if offload else None
            if offload_method:
                label = f"{model}: computing the remat+offload curve…"
                set_progress(["95", label])  # after the baselines' 85-95
                curve = studio.offload_tradeoff(
                    key, lambda f: set_progress([str(int(95 + 5 * f)), label])
                )
                minimum = min([minimum, *(p.budget for p in curve)])
            set_progress(["100", ""])
            return {
                "key": key,
                "model": model,
                "method": method,
                "offload": offload_method,
                "methods": methods,
                "peak": peak,
                "minimum": minimum,
                "min_pct": slider_minimum(minimum, peak),
                "min_text": f"{slider_minimum(minimum, peak):g}% ({fmt(minimum)})",
                "numbers": numbers,
                "error": None,
            }
        except Cancelled:
            raise PreventUpdate from None
        except Exception as err:  # shown in the page; the app stays up
            traceback.print_exc()
            return {"key": None, "model": model, "method": method, "error": plain_error(err)}

    @app.callback(
        Output(ids.ERROR, "children"),
        Output(ids.ERROR, "hidden"),
        Output(ids.METHOD, "options"),
        Output(ids.BUDGET, "min"),
        Output(ids.BUDGET, "marks"),
        Output(ids.BUDGET, "value"),
        Output(ids.INTRO, "children"),
        Output(ids.GRAPH, "elements"),
        Output(ids.TRADEOFF, "figure"),
        Output(ids.TRADEOFF_NOTE, "children"),
        Input(ids.CONTEXT, "data"),
        State(ids.BUDGET, "value"),
        State(ids.METHOD, "value"),
        prevent_initial_call=True,
    )
    def show_context(context, value, method):
        if not context:
            raise PreventUpdate
        if context["error"]:
            return (context["error"], False) + (no_update,) * 8
        key = context["key"]
        problem = studio.problem(key)
        lo = context["min_pct"]
        if value is None or value < lo or value > 100:
            value = round((lo + 100) / 4) * 2 if lo < 100 else 100  # middle, on a 0.5 step
            value = max(lo, min(100, value))
        marks = {lo: f"{lo:g}%", 100: "100%"}
        options = [{"label": METHOD_LABELS.get(m, m), "value": m} for m in context["methods"]]
        graph = problem.graph
        elements = figures.graph_elements(
            problem.blocks, graph.ops, graph.values, figures.graph_prefix(key)
        )
        if context["method"] != method:
            # not an Output: METHOD is an Input of `prepare`, and a declared cycle
            # (prepare -> CONTEXT -> here -> METHOD -> prepare) made Dash's renderer hold back
            # every later `prepare` request while one ran (a device changed meanwhile was lost)
            set_props(ids.METHOD, {"value": context["method"]})
        return (
            "",
            True,
            options,
            lo,
            marks,
            value,
            intro(context["model"], studio.describe(context["model"]), context["numbers"]),
            elements,
            _tradeoff(studio, context, value),
            tradeoff_note(context, link_text(problem)),
        )

    app.clientside_callback(  # the curve takes seconds: say so at once
        """function (on) { return (on && on.length) ?
            "Computing the remat+offload curve (seconds: one solve per budget)…" :
            window.dash_clientside.no_update; }""",
        Output(ids.TRADEOFF_NOTE, "children", allow_duplicate=True),
        Input(ids.OFFLOAD, "value"),
        prevent_initial_call=True,
    )


def _budget(app: Dash, studio: Studio) -> None:
    """The budget: slider, typed box, trade-off clicks; the slider's hot path re-solves."""
    app.clientside_callback(  # a slider move retires a refused typed budget's message
        "function (value) { return true; }",
        Output(ids.BUDGET_MESSAGE, "hidden", allow_duplicate=True),
        Input(ids.BUDGET, "value"),
        prevent_initial_call=True,
    )
    app.clientside_callback(
        ClientsideFunction("remat", "typedBudget"),
        Output(ids.BUDGET, "value", allow_duplicate=True),
        Output(ids.BUDGET_MESSAGE, "children"),
        Output(ids.BUDGET_MESSAGE, "hidden"),
        Input(ids.BUDGET_INPUT, "value"),
        State(ids.CONTEXT, "data"),
        prevent_initial_call=True,
    )

    @app.callback(
        Output(ids.TIMELINE, "figure"),
        Output(ids.PEAK, "children"),
        Output(ids.OVERHEAD, "children"),
        Output(ids.RECOMPUTED, "children"),
        Output(ids.SOLVE_TIME, "children"),
        Output(ids.HOST, "children"),
        Output(ids.BUDGET_BYTES, "children"),
        Output(ids.PLAN, "data"),
        Output(ids.PLAN_ERROR, "children"),
        Output(ids.PLAN_ERROR, "hidden"),
        Output(ids.STEP, "data"),
        Output(ids.BUDGET_HINT, "children"),
        Input(ids.BUDGET, "value"),
        Input(ids.CONTEXT, "data"),
        State(ids.STEP, "data"),
        prevent_initial_call=True,
    )
    def solve(value, context, step):
        """The slider's hot path: re-solve (cached), redraw the timeline and the numbers."""
        if not context or not context.get("key") or value is None:
            raise PreventUpdate
        key, peak = context["key"], context["peak"]
        method = context.get("offload") or context["method"]
        budget = int(value / 100 * peak)
        label = f"{fmt(budget)} · {value:g}% of {fmt(peak)}"
        try:
            plan = studio.plan(key, method, budget)
        except Exception as err:
            return (no_update,) * 6 + (label, None, plain_error(err), False, None, "")
        problem = studio.problem(key)
        sim = plan.simulate()
        fig = figures.timeline_figure(
            plan.timeline,
            plan.backward_start,
            budget,
            [b.name for b in problem.blocks],
            unit=figures.pick_unit(peak),
            host=sim.host,
        )
        fig["layout"]["meta"]["budget_pct"] = value
        return (
            fig,
            fmt(plan.predicted_peak),
            f"{100 * (plan.overhead - 1):.1f}%",
            f"{plan.recomputed_ops}",
            f"{plan.solve_seconds * 1e3:.0f} ms",
            fmt(sim.host_peak) if context.get("offload") else "–",
            label,
            {"key": key, "method": method, "budget": budget, "value": value},
            "",
            True,
            None if step is not None else no_update,
            peak_hint(plan.timeline),
        )

    @app.callback(
        Output(ids.TRADEOFF, "figure", allow_duplicate=True),
        Input(ids.BUDGET, "value"),
        prevent_initial_call=True,
    )
    def mark_budget(value):
        patch = Patch()
        patch["layout"]["shapes"][0] = figures.budget_shape(value)
        return patch

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


def _graph(app: Dash, studio: Studio) -> None:
    """The block graph: colours for the plan and the step, the op under the mouse, a block's ops."""

    @app.callback(
        Output(ids.GRAPH, "stylesheet"),
        Output(ids.STEP_TEXT, "children"),
        Output(ids.STEP_WHY, "children"),
        Input(ids.PLAN, "data"),
        Input(ids.STEP, "data"),
        prevent_initial_call=True,
    )
    def colour_graph(plan_ref, step):
        """Graph colours for the plan and the step-through highlight (off the slider's path)."""
        plan, problem = _plan(studio, plan_ref)
        if plan is None:
            return figures.graph_stylesheet(), "", ""
        fates = op_fates(problem, plan)
        prefix = figures.graph_prefix(plan_ref["key"])
        if step is None or step >= len(plan.program):
            return (
                figures.graph_stylesheet(fates, prefix=prefix),
                f"{len(plan.program)} steps",
                "Press play or step to walk through the program.",
            )
        view = step_view(problem, plan, step)
        sheet = figures.graph_stylesheet(
            fates, view["running"], view["live"], view["block"], prefix
        )
        return sheet, view["label"], view["why"]

    @app.callback(
        Output(ids.GRAPH_HOVER, "children"),
        Input(ids.GRAPH, "mouseoverNodeData"),
        State(ids.PLAN, "data"),
        prevent_initial_call=True,
    )
    def hover_op(node, plan_ref):
        """Name the op under the mouse: ATen op, bytes it allocates, what the plan does."""
        if not node or node.get("op") is None:
            raise PreventUpdate
        plan, problem = _shown(studio, plan_ref)
        graph = problem.graph
        op = graph.ops[int(node["op"])]
        fate = next((f for f, ops in op_fates(problem, plan).items() if op.index in ops), "")
        out = fmt_bytes(sum(graph.values[v].nbytes for v in op.outputs))
        return f"{op.name}: {op.label}, block {node['block']}, allocates {out}" + (
            f"; {figures.FATE_TEXT[fate]}" if fate else ""
        )

    @app.callback(
        Output(ids.BLOCK_PANEL, "children"),
        Input(ids.GRAPH, "tapNodeData"),
        State(ids.PLAN, "data"),
        prevent_initial_call=True,
    )
    def open_block(node, plan_ref):
        if not node:
            raise PreventUpdate
        plan, problem = _shown(studio, plan_ref)
        if node.get("block") is None:
            raise PreventUpdate
        block = problem.blocks[int(node["block"])]
        fate_of = {}
        for fate, ops in op_fates(problem, plan).items():
            fate_of.update(dict.fromkeys(ops, fate))
        graph = problem.graph
        same = [b.index for b in problem.blocks if b.kind == block.kind]

        def row(o: int):
            op = graph.ops[o]
            out = sum(graph.values[v].nbytes for v in op.outputs)
            fate = fate_of.get(o, "backward" if op.phase == "backward" else "")
            return html.Tr(
                [
                    html.Td(op.name),
                    html.Td(op.label),
                    html.Td(fmt_bytes(out)),
                    html.Td(fate, className=f"fate {fate}"),
                ]
            )

        return [
            html.H3(f"block {block.index} · {block.name}"),
            html.P(
                f"{len(block.forward_ops)} forward and {len(block.backward_ops)} backward ops; "
                f"activations {fmt_bytes(block.activation_bytes)}; same kind as blocks "
                f"{', '.join(map(str, same))}."
            ),
            html.Table(
                [html.Thead(html.Tr([html.Th(h) for h in ("op", "ATen", "allocates", "plan")]))]
                + [html.Tbody([row(o) for o in block.forward_ops + block.backward_ops])],
                className="ops",
            ),
        ]


def _memory(app: Dash, studio: Studio) -> None:
    """The memory views: step marker, per-tensor view, the peak's list, measure here."""

    @app.callback(
        Output(ids.TIMELINE, "figure", allow_duplicate=True),
        Input(ids.STEP, "data"),
        State(ids.PLAN, "data"),
        prevent_initial_call=True,
    )
    def move_marker(step, plan_ref):
        plan, problem = _shown(studio, plan_ref)
        patch = Patch()
        _, size = figures.pick_unit(plan_ref and problem.store_all_peak)
        height = max(plan.predicted_peak, plan_ref["budget"]) / size
        patch["data"][figures.T_MARKER] = figures.marker_trace(step, height)
        return patch

    @app.callback(
        Output(ids.TENSORS, "figure"),
        Input(ids.PLAN, "data"),
        prevent_initial_call=True,
    )
    def draw_tensors(plan_ref):
        """The per-tensor view of the plan on screen (a request of its own, off the slider's
        timeline paint)."""
        plan, problem = _shown(studio, plan_ref)
        rows = studio.tensors(plan_ref["key"], plan_ref["method"], plan_ref["budget"])
        return figures.tensor_figure(
            rows,
            len(plan.program),
            plan.backward_start,
            unit=figures.pick_unit(problem.store_all_peak),
        )

    @app.callback(
        Output(ids.TRANSFERS, "figure"),
        Input(ids.PLAN, "data"),
        prevent_initial_call=True,
    )
    def draw_transfers(plan_ref):
        """The transfer lane of the plan on screen: copies and compute stalls over time."""
        plan, problem = _shown(studio, plan_ref)
        sim, values = plan.simulate(), problem.graph.values
        return figures.transfer_figure(
            sim.transfers,
            sim.waits,
            [v.name for v in values],
            [v.nbytes for v in values],
            link_text(problem),
        )

    @app.callback(
        Output(ids.ARENA, "figure"),
        Input(ids.PLAN, "data"),
        prevent_initial_call=True,
    )
    def draw_arena(plan_ref):
        """The address-by-time view of the plan on screen (`core.layout.arena`)."""
        plan, problem = _shown(studio, plan_ref)
        return arena_figure(arena(plan), problem.graph, plan.backward_start)

    @app.callback(
        Output(ids.PEAK_LIST, "children"),
        Input(ids.STEP, "data"),
        State(ids.PLAN, "data"),
        prevent_initial_call=True,
    )
    def list_peak(step, plan_ref):
        """At the peak step: what is alive there, largest first."""
        plan, problem = _plan(studio, plan_ref)
        if plan is None or step is None or step != peak_step(plan.timeline):
            return []
        rows = alive_at(
            studio.tensors(plan_ref["key"], plan_ref["method"], plan_ref["budget"]), step
        )
        total = sum(r["nbytes"] for r in rows)
        items = [
            html.Li(
                [html.B(fmt_bytes(r["nbytes"])), " ", html.Span(r["name"]), f" · {r['fate']}"],
                title=r["text"].replace("<br>", "\n").replace("<b>", "").replace("</b>", ""),
            )
            for r in rows[:PEAK_ROWS]
        ]
        more = len(rows) - len(items)
        return [
            html.P(
                f"This is the peak: {fmt_bytes(total)} in {len(rows)} storages set it. "
                "Largest first:"
            ),
            html.Ol(items + ([html.Li(f"… and {more} smaller")] if more > 0 else [])),
        ]

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
        plan, _ = _shown(studio, plan_ref)
        try:
            call = studio.builders[plan_ref["key"].split("|")[0]]()
            with studio_lock():
                got = measure_plan(call, plan)
        except Exception as err:  # shown next to the button; the app stays up
            traceback.print_exc()
            return {"plan": plan_ref, "error": plain_error(err)}
        return {"plan": plan_ref, "live": got.live, "peak": got.peak, "error": None}

    @app.callback(
        Output(ids.TIMELINE, "figure", allow_duplicate=True),
        Output(ids.MEASURE_TEXT, "children", allow_duplicate=True),
        Input(ids.MEASURED, "data"),
        State(ids.PLAN, "data"),
        prevent_initial_call=True,
    )
    def draw_measured(measured, plan_ref):
        """Overlay the measured live bytes on the predicted timeline of the same plan."""
        plan, problem = _shown(studio, plan_ref)
        if not measured or measured["plan"] != plan_ref:
            raise PreventUpdate  # another plan is on screen now
        if measured["error"]:
            return no_update, f"Could not run the step: {measured['error']}"
        _, size = figures.pick_unit(problem.store_all_peak)
        patch = Patch()
        patch["data"].append(figures.measured_trace(measured["live"], size, measured["peak"]))
        return patch, (
            f"measured peak {fmt(measured['peak'])}, predicted {fmt(plan.predicted_peak)} "
            "(the tracker also counts the 4-byte seed of loss.backward())"
        )


def _step_through(app: Dash, studio: Studio) -> None:
    """Play, step, jump: the step-through position over the plan's program."""

    @app.callback(
        Output(ids.STEP, "data", allow_duplicate=True),
        Output(ids.TICKER, "disabled"),
        Output(ids.PLAY, "children"),
        Input(ids.PLAY, "n_clicks"),
        Input(ids.STEP_NEXT, "n_clicks"),
        Input(ids.STEP_BACK, "n_clicks"),
        Input(ids.STEP_RESET, "n_clicks"),
        Input(ids.JUMP_PEAK, "n_clicks"),
        Input(ids.JUMP_RECOMPUTE, "n_clicks"),
        Input(ids.JUMP_TRANSFER, "n_clicks"),
        Input(ids.TICKER, "n_intervals"),
        State(ids.STEP, "data"),
        State(ids.TICKER, "disabled"),
        State(ids.SPEED, "value"),
        State(ids.PLAN, "data"),
        prevent_initial_call=True,
    )
    def step_through(
        _play, _next, _back, _reset, _peak, _rec, _copy, _tick, step, paused, speed, plan_ref
    ):
        plan, _ = _shown(studio, plan_ref)
        last = len(plan.program) - 1
        trigger = ctx.triggered_id
        if trigger == ids.PLAY:
            if paused:
                start = 0 if step is None or step >= last else step
                return start, False, "⏸ pause"
            return no_update, True, "▶ play"
        if trigger == ids.STEP_RESET:
            return 0, True, "▶ play"
        if trigger == ids.JUMP_PEAK:
            return peak_step(plan.timeline), True, "▶ play"
        if trigger in (ids.JUMP_RECOMPUTE, ids.JUMP_TRANSFER):
            jump = next_recompute if trigger == ids.JUMP_RECOMPUTE else next_transfer
            target = jump(plan.timeline, step)
            return (no_update if target is None else target), True, "▶ play"
        if trigger == ids.STEP_BACK:
            return max(0, (step or 0) - 1), no_update, no_update
        stride = (speed or 1) if trigger == ids.TICKER else 1
        nxt = 0 if step is None else step + stride
        if nxt >= last:
            return last, True, "▶ play"
        return nxt, no_update, no_update


def _export(app: Dash, studio: Studio) -> None:
    """Download the plan on screen as a plan file."""

    @app.callback(
        Output(ids.DOWNLOAD, "data"),
        Output(ids.PLAN_ERROR, "children", allow_duplicate=True),
        Output(ids.PLAN_ERROR, "hidden", allow_duplicate=True),
        Input(ids.EXPORT, "n_clicks"),
        State(ids.PLAN, "data"),
        prevent_initial_call=True,
    )
    def export(_clicks, plan_ref):
        plan, _ = _plan(studio, plan_ref)
        if plan is None:
            return no_update, "There is no plan to export yet: choose a feasible budget.", False
        try:
            with tempfile.TemporaryDirectory() as tmp:
                path = os.path.join(tmp, "plan.pkl")
                plan.save(path)
                with open(path, "rb") as f:
                    data = f.read()
        except Exception as err:
            return no_update, f"Cannot export the plan: {plain_error(err)}", False
        return dcc.send_bytes(data, "plan.pkl"), no_update, no_update


def _plan(studio: Studio, plan_ref: dict | None):
    """The plan (and problem) a PLAN store names, from the caches."""
    if not plan_ref:
        return None, None
    try:
        plan = studio.plan(plan_ref["key"], plan_ref["method"], plan_ref["budget"])
    except Exception:
        return None, None
    return plan, studio.problem(plan_ref["key"])


def _shown(studio: Studio, plan_ref: dict | None):
    """`_plan`, for a view with nothing to draw without a plan: PreventUpdate then."""
    plan, problem = _plan(studio, plan_ref)
    if plan is None:
        raise PreventUpdate
    return plan, problem


def _tradeoff(studio: Studio, context: dict, value: float) -> dict:
    """The remat curves (the method's and the baselines'), and beside them the remat+offload
    curve when the switch is on (`prepare` computed it)."""
    key, peak = context["key"], context["peak"]
    curves = {}
    for m in [context["method"], *BASELINES]:
        if m in context["methods"] and m not in curves:
            points = studio.tradeoff(key, m)
            curves[m] = [(percent(p.budget, peak), 100 * (p.overhead - 1)) for p in points]
    offload = context.get("offload")
    if offload:
        points = studio.offload_tradeoff(key)
        curves[offload] = [(percent(p.budget, peak), 100 * (p.overhead - 1)) for p in points]
    floor = studio.problem(key).floor
    return figures.tradeoff_figure(
        curves,
        METHOD_LABELS,
        offload or context["method"],
        value,
        (percent(floor.nbytes, peak), floor.op),
    )


def tradeoff_note(context: dict, link: str) -> str:
    """What the trade-off chart's curves are, under it."""
    if context.get("offload"):
        return (
            f"Dashed: {METHOD_LABELS.get(context['offload'], context['offload'])}, beside "
            f"remat alone ({METHOD_LABELS.get(context['method'], context['method'])}); {link}."
        )
    return "Turn on “offload to host memory” to draw the remat+offload curve beside these."


def fmt(n: float) -> str:
    return fmt_bytes(n)
