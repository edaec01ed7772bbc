"""Analyse the chosen model in the background and show what it gives: intro, graph, limits,
the trade-off chart (with the remat+offload curve when the offload switch is on)."""

from __future__ import annotations

import logging
from collections.abc import Callable

from dash import Dash, Input, Output, State, no_update, set_props
from dash.exceptions import PreventUpdate

from app import figures, ids
from app.cache import Cancelled
from app.callbacks.common import HIDDEN, SHOWN, fmt, plain_error
from app.explain import link_text
from app.layout import intro
from app.readback import percent, slider_minimum
from app.state import BASELINES, METHOD_LABELS, Studio

log = logging.getLogger(__name__)

Progress = Callable[[list[str]], None]


def register(app: Dash, studio: Studio) -> None:
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
        try:
            return analyse(studio, set_progress, model, costs, device, method, bool(offload))
        except Cancelled:
            raise PreventUpdate from None
        except Exception as err:  # shown in the page; the app stays up
            log.exception("analysing %s (%s, %s) failed", model, costs, device)
            return {"key": None, "model": model, "method": method, "error": plain_error(err)}

    @app.callback(
        output={
            "error": Output(ids.ERROR, "children"),
            "error_hidden": Output(ids.ERROR, "hidden"),
            "methods": Output(ids.METHOD, "options"),
            "low": Output(ids.BUDGET, "min"),
            "marks": Output(ids.BUDGET, "marks"),
            "budget": Output(ids.BUDGET, "value"),
            "intro": Output(ids.INTRO, "children"),
            "graph": Output(ids.GRAPH, "elements"),
            "tradeoff": Output(ids.TRADEOFF, "figure"),
            "note": Output(ids.TRADEOFF_NOTE, "children"),
        },
        inputs=[Input(ids.CONTEXT, "data")],
        state=[State(ids.BUDGET, "value"), State(ids.METHOD, "value")],
        prevent_initial_call=True,
    )
    def show_context(context, value, method):
        if not context:
            raise PreventUpdate
        if context["error"]:
            return {
                "error": context["error"],
                "error_hidden": False,
                **dict.fromkeys(
                    ("methods", "low", "marks", "budget", "intro", "graph", "tradeoff", "note"),
                    no_update,
                ),
            }
        if context["method"] != method:
            # not an Output: METHOD is an Input of `prepare`, and a declared cycle
            # (prepare -> CONTEXT -> here -> METHOD -> prepare) made Dash's renderer hold back
            # every later `prepare` request while one ran (a device changed meanwhile was lost)
            set_props(ids.METHOD, {"value": context["method"]})
        return context_view(studio, context, value)

    app.clientside_callback(  # the curve takes seconds: say so at once
        """function (on) { return (on && on.length) ?
            "Computing the remat+offload curve (seconds: one solve per budget)…" :
            window.dash_clientside.no_update; }""",
        Output(ids.TRADEOFF_NOTE, "children", allow_duplicate=True),
        Input(ids.OFFLOAD, "value"),
        prevent_initial_call=True,
    )


def context_view(studio: Studio, context: dict, value: float | None) -> dict:
    """What a fresh analysis shows: the methods on offer, the slider's range and position
    (kept when still in range, else the middle), the intro, the graph and the trade-off."""
    problem = studio.problem(context["key"])
    lo = context["min_pct"]
    if value is None or value < lo or value > 100:
        value = round((lo + 100) / 4) * 2 if lo < 100 else 100  # middle, on a 0.5 step
        value = max(lo, min(100, value))
    graph = problem.graph
    return {
        "error": "",
        "error_hidden": True,
        "methods": [{"label": METHOD_LABELS.get(m, m), "value": m} for m in context["methods"]],
        "low": lo,
        "marks": {lo: f"{lo:g}%", 100: "100%"},
        "budget": value,
        "intro": intro(context["model"], studio.describe(context["model"]), context["numbers"]),
        "graph": figures.graph_elements(
            problem.blocks, graph.ops, graph.values, figures.graph_prefix(context["key"])
        ),
        "tradeoff": tradeoff_chart(studio, context, value),
        "note": tradeoff_note(context, link_text(problem)),
    }


def analyse(
    studio: Studio,
    set_progress: Progress,
    model: str,
    costs: str,
    device: str,
    method: str,
    offload: bool,
) -> dict:
    """The CONTEXT store's data: the analysed problem's key, the methods on offer, the
    budget limits and the intro's numbers; the caches warmed with the curves drawn next."""
    key = studio.key(model, costs, device)

    def report(stage: str, frac: float) -> None:  # the analysis is 2-75% of the bar
        set_progress([str(int(2 + 73 * frac)), f"{model}: {stage}…"])

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
        curve = studio.offload_tradeoff(key, lambda f: set_progress([str(int(95 + 5 * f)), label]))
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


def tradeoff_chart(studio: Studio, context: dict, value: float) -> dict:
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
