"""Analyse the chosen model in the background and show what it gives: intro, graph, limits,
the trade-off chart (with the remat+offload curve when the offload switch is on)."""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any

from dash import Dash, Input, Output, State, html, no_update, set_props
from dash.exceptions import PreventUpdate

import core
from app import figures, ids
from app.callbacks.common import (
    block_graph,
    context_sig,
    fmt,
    plain_error,
    stale_on_switch,
    stamp,
)
from app.explain import link_text
from app.figures.axes import empty_figure
from app.readback import percent, slider_minimum
from app.state import BASELINES, METHOD_LABELS, STEP_OPTIONS, Point, Studio, base_key
from app.strategies import SHORT, STRATEGY_LABELS, is_strategy
from app.words import intro

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
        Input(ids.STEP_OPTS, "value"),
        State(ids.BUDGET, "value"),
        State(ids.CONTEXT, "data"),
        State(ids.LESSON_PENDING, "data"),
        background=True,
        # the busy bar itself is the page's watcher's (assets/app.js): it shows while any
        # view differs from the controls, which covers this job and the drawing after it
        progress=[Output(ids.PROGRESS_BAR, "value"), Output(ids.PROGRESS_TEXT, "children")],
        progress_default=["0", ""],
        cancel=[Input(ids.CANCEL, "n_clicks")],
        interval=250,
    )
    def prepare(set_progress, model, costs, device, method, offload, step, value, shown, lesson):
        """Analyse the model (trace, costs, blocks), the method's and the baselines'
        trade-offs and the plan at the budget to show, in the background; with the offload
        switch on, the remat+offload curve too. Everything the page draws next is cached."""
        keep = wanted_budget(shown, model, value)
        step = list(step or ())
        sig = context_sig(model, costs, device, method, bool(offload), step)
        # a lesson step's budget, for the analysis it set up
        set_to = float(lesson["pct"]) if lesson and lesson.get("for") == sig else None
        try:
            return analyse(
                studio,
                set_progress,
                model,
                costs,
                device,
                method,
                bool(offload),
                keep,
                set_to,
                step,
            )
        except core.Interrupted:
            raise PreventUpdate from None
        except Exception as err:  # shown in the page; the app stays up
            log.exception("analysing %s (%s, %s) failed", model, costs, device)
            return {
                "key": None,
                "model": model,
                "method": method,
                "error": plain_error(err),
                "for": sig,
            }

    @app.callback(
        output={
            "error": Output(ids.ERROR, "children"),
            "error_hidden": Output(ids.ERROR, "hidden"),
            "error_for": Output(ids.ERROR, "data-for"),
            "intro_for": Output(ids.INTRO, "data-for"),
            "graph_for": Output(ids.GRAPH_CARD, "data-for"),
            "methods": Output(ids.METHOD, "options"),
            "low": Output(ids.BUDGET, "min"),
            "marks": Output(ids.BUDGET, "marks"),
            "budget": Output(ids.BUDGET, "value"),
            "intro": Output(ids.INTRO, "children"),
            "graph": Output(ids.GRAPH, "elements"),
            "open": Output(ids.GRAPH_OPEN, "data"),
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
                "error_for": context["for"],
                **dict.fromkeys(
                    ("methods", "low", "marks", "budget", "intro", "graph", "open"), no_update
                ),
                **dict.fromkeys(("intro_for", "graph_for"), no_update),
            }
        if context["method"] != method:
            # not an Output: METHOD is an Input of `prepare`, and a declared cycle
            # (prepare -> CONTEXT -> here -> METHOD -> prepare) made Dash's renderer hold back
            # every later `prepare` request while one ran (a device changed meanwhile was lost)
            set_props(ids.METHOD, {"value": context["method"]})
        return context_view(studio, context, value)

    @app.callback(
        Output(ids.TRADEOFF, "figure"),
        Output(ids.TRADEOFF_NOTE, "children"),
        Input(ids.CONTEXT, "data"),
        State(ids.BUDGET, "value"),
        background=True,
        cancel=stale_on_switch(),
        interval=250,
        prevent_initial_call=True,
    )
    def draw_curves(context, value):
        """The trade-off curves of the analysis on screen, after its first timeline: the
        method's, the baselines' and (offloading on) remat+offload's, one solve per point.
        The chart shows its own busy sign meanwhile (assets/app.js), never the page's; a
        newer analysis replaces this job (Dash ends the old one)."""
        if not context or not context.get("key"):
            raise PreventUpdate
        try:
            first = studio.tradeoff_first(context["key"], solver(context))
            if first is not None:  # drawn now, its own busy sign on until the ILP's points land
                set_props(ids.TRADEOFF, {"figure": curves_view(studio, context, value, first)[0]})
            figure, note = curves_view(studio, context, value)
            if first is not None:
                # the first draw waits in the job's side updates until the page polls: the
                # whole chart replaces it there too, so it never lands after the whole one
                set_props(ids.TRADEOFF, {"figure": figure})
            return figure, note
        except core.Interrupted:
            raise PreventUpdate from None
        except Exception as err:  # shown under the chart; the page stays up
            log.exception("the trade-off curves of %s failed", context["key"])
            return stamp(empty_figure(60), context["for"]), plain_error(err)


def wanted_budget(shown: dict | None, model: str, value: float | None) -> float | None:
    """The budget the user wants kept through a new analysis of the same model: the slider's,
    unless the last analysis moved it out of the way (a method whose least budget is above
    it: store-all's 100%) and the user has not moved it since; then the one before that, so
    switching back to Rockmate brings the budget back."""
    if not shown or shown.get("model") != model:
        return None
    if value is not None and value == shown.get("value") and shown.get("wanted") is not None:
        return float(shown["wanted"])
    return value


def start_value(lo: float, value: float | None) -> float:
    """The slider's position for a range from `lo`%: `value` when in range, else the middle
    (on a 0.5 step), a budget that recomputes."""
    if value is not None and lo <= value <= 100:
        return value
    middle = round((lo + 100) / 4) * 2 if lo < 100 else 100
    return max(lo, min(100, middle))


def context_view(studio: Studio, context: dict, value: float | None) -> dict:
    """What a fresh analysis shows: the methods on offer, the slider's range and the position
    `prepare` chose, the intro and the graph, each stamped with what it is for (the trade-off
    chart follows from `draw_curves`)."""
    lo = context["min_pct"]
    low = context.get("slider_min", lo)
    value = context.get("value", start_value(lo, value))
    sig = context["for"]
    label = METHOD_LABELS.get(solver(context), solver(context)).split(" (")[0]
    marks = {low: f"{low:g}%", 100: "100%"}
    if lo > low:  # the method's own least budget, where it differs from the model's
        marks[lo] = f"{label}: {lo:g}%" if lo < 100 else f"100%: {label}'s only budget"
    return {
        "error": "",
        "error_hidden": True,
        "error_for": sig,
        "intro_for": sig,
        "graph_for": sig,
        "methods": method_options(context),
        "low": low,
        "marks": marks,
        "budget": value,
        "intro": intro(context["model"], studio.describe(context["model"]), context["numbers"])
        + little_to_show(low),
        "graph": block_graph(studio, context["key"]),  # at module level: layers closed
        "open": [],
    }


def method_options(context: dict) -> list[dict]:
    """The method menu: our solvers, then the imported strategies that apply to the model
    (one that does not is listed disabled, its reason in its label's tooltip)."""
    options: list[dict] = [
        {"label": METHOD_LABELS.get(m, m), "value": m} for m in context["methods"]
    ]
    for method, why in (context.get("strategies") or {}).items():
        label = STRATEGY_LABELS[method]
        if why is None:
            options.append({"label": label, "value": method})
        else:
            short = label.split(" (")[0]
            options.append(
                {
                    "label": html.Span(f"{short} (not on this model)", title=why),
                    "value": method,
                    "disabled": True,
                }
            )
    return options


def solver(context: dict) -> str:
    """Our method the chart's curve and the slider's range are for: the menu's, or with an
    imported strategy chosen, the default solver's (`prepare` put it in the context)."""
    return context.get("solver") or context["method"]


def curves_view(
    studio: Studio,
    context: dict,
    value: float | None,
    first: tuple[list[Point], list[int]] | None = None,
) -> tuple[dict, str]:
    """The trade-off chart and its note for the analysis `context` (computed here on a miss:
    seconds to minutes on the small graphs whose rockmate also runs a whole-graph ILP), with
    the imported strategies' predicted points beside the curves. With `first`
    (`Studio.tradeoff_first`), the method's curve is drawn without the budgets still waiting
    for the ILP, its legend says where, and the chart is stamped `FILLING`: not yet for the
    controls, so it keeps its own busy sign (assets/app.js) until the whole curve lands."""
    problem = studio.problem(context["key"])
    value = value if value is not None else context.get("value", 100.0)
    chart = tradeoff_chart(studio, context, value, first)
    key = context["key"]
    autosac = context["method"] == "autosac" or studio.autosac_drawn(key)
    points = studio.strategy_points(key, autosac)
    figures.add_strategy_points(
        chart, strategy_marks(points, problem.store_all_peak), context["method"]
    )
    figure = stamp(chart, context["for"] + (FILLING if first else ""))
    note = tradeoff_note(context, link_text(problem)) + " " + floor_gap(context, problem)
    return figure, note + strategies_note(context, points, autosac)


def strategy_marks(points: Sequence[Any], peak: int) -> list[figures.StrategyMark]:
    """The chart's marks for the imported strategies' points: x their predicted peak as %
    of store-all (not a budget: a fixed plan has none), y their extra time."""
    return [
        figures.StrategyMark(
            p.method,
            STRATEGY_LABELS[p.method].split(" (")[0],
            SHORT[p.method],
            percent(p.peak, peak),
            100 * (p.overhead - 1),
            None if p.budget is None else percent(p.budget, peak),
        )
        for p in points
    ]


def strategies_note(context: dict, points: Sequence[Any], autosac: bool) -> str:
    """What the strategies' points are, and which strategies are not drawn, and why."""
    offered = context.get("strategies") or {}
    if not points and not offered:
        return ""
    said = (
        " Points: the strategies users run today, at their predicted peak and extra time, "
        "predicted by the native simulation: where our curve lies left of or below one, a "
        "plan of ours fits in less memory or runs faster at that peak."
    )
    if offered.get("autosac") is None and not autosac:
        said += (
            " PyTorch auto-SAC solves per budget and first times every op of the step: "
            "choose it in the method menu to draw its points."
        )
    missing = [SHORT[m] for m, why in offered.items() if why is not None]
    if any(p.method == "torchtune" for p in points) and not context.get("offload"):
        said += (
            " torchtune offloads rather than recomputes: turn on offloading to draw the "
            "remat+offload curve beside it."
        )
    if missing:
        said += f" Not on this model: {', '.join(missing)} (see the method menu)."
    return said


# a first draw of the curves, its whole-graph ILP points still to come: stamped as drawn for
# other controls than the page's, so it keeps its own busy sign until the whole curve lands
FILLING = " (filling in)"

LITTLE = 90.0  # a smallest budget this close to 100% leaves nothing to teach


def little_to_show(lo: float) -> list:
    """A warning for models where no plan goes much below plain PyTorch's peak."""
    if lo < LITTLE:
        return []
    return [
        html.P(
            f"Little to show on this model: no plan goes below {lo:g}% of plain PyTorch's "
            "peak (its gradients and temporaries, not its activations, set the peak). "
            "Try gpt-tiny or vit-tiny to see the trade-off.",
            className="message warn little",
        )
    ]


def analyse(
    studio: Studio,
    set_progress: Progress,
    model: str,
    costs: str,
    device: str,
    method: str,
    offload: bool,
    value: float | None = None,
    set_to: float | None = None,
    step: Sequence[str] = (),
) -> dict:
    """The CONTEXT store's data: the analysed problem's key, the methods on offer, the
    budget limits, the budget to show (`set_to` clamped to the range, else `value` when in
    range) and the intro's numbers; the plan drawn first computed here, under the progress
    bar. The trade-off curves are left to `draw_curves`, so the first timeline does not wait
    for them (on gpt-1layer, 40 s of whole-graph ILPs at the curve's lowest budgets)."""
    key = studio.key(model, costs, device, step)

    def bar(start: int, end: int, text: str) -> Callable[[float], None]:
        return lambda frac: set_progress([str(int(start + (end - start) * frac)), text])

    problem = studio.problem(key, lambda stage, frac: bar(2, 85, f"{model}: {stage}…")(frac))
    methods = studio.methods(problem)
    set_progress(["84", f"{model}: which strategies users run apply…"])
    offered = studio.strategies(key)
    imported = is_strategy(method) and offered.get(method) is None
    if method not in methods and not imported:
        method = studio.default_method()
    # an imported strategy has no budget range of its own: the slider spans our solver's
    ours = studio.default_method() if imported else method
    # the slider's range only: the curves are `draw_curves`' job, after the first timeline
    set_progress(["85", f"{model}: the smallest budget {ours} meets…"])
    minimum = studio.minimum(key, ours)
    # an imported strategy runs as its own code does: the offload switch is ours (`solved`
    # says so under the slider)
    offload_method = studio.offload_method if offload and not imported else None
    if offload_method:
        set_progress(["88", f"{model}: the smallest budget with offloading…"])
        minimum = min(minimum, studio.minimum(key, offload_method))
    peak = problem.store_all_peak
    lo = slider_minimum(minimum, peak)
    # the slider spans the model's range (its best method's least budget), whatever the
    # method: store-all's range alone is one point, 100%
    lowest = min(minimum, studio.minimum(key, studio.default_method()))
    start = start_value(lo, value) if set_to is None else max(lo, min(100.0, set_to))
    if imported:  # warm what `solve` draws first; a refusal is its to explain
        doing = "PyTorch auto-SAC times each op" if method == "autosac" else "importing"
        set_progress(["97", f"{model}: {doing}…"])
        try:
            studio.imported(key, method, int(start / 100 * peak))
        except core.Interrupted:
            raise
        except Exception:
            log.info("importing %s on %s failed (shown under the slider)", method, key)
    else:
        set_progress(["97", f"{model}: solving at {start:g}% of the store-all peak…"])
        try:  # warm the plan `solve` draws first; an impossible budget is its to explain
            studio.plan(key, offload_method or method, int(start / 100 * peak))
        except core.InfeasibleBudget:
            pass
    set_progress(["100", f"{model}: drawing…"])
    return {
        "key": key,
        "model": model,
        "method": method,
        "offload": offload_method,
        "methods": methods,
        "strategies": offered,
        "solver": ours,
        "peak": peak,
        "minimum": minimum,
        "min_pct": lo,
        "min_text": f"{lo:g}% ({fmt(minimum)})",
        "slider_min": slider_minimum(lowest, peak),
        "wanted": value if set_to is None else start,
        "numbers": intro_numbers(studio, key, problem, methods),
        "value": start,
        "step": [o for o in STEP_OPTIONS if o in step],
        "for": context_sig(model, costs, device, method, offload, step),
        "error": None,
    }


def intro_numbers(studio: Studio, key: str, problem, methods: list[str]) -> dict:
    """The intro's numbers: the store-all peak and time, and checkpointing every block's."""
    numbers = {
        "store_all_peak": problem.store_all_peak,
        "store_all_time": problem.store_all_time,
        "cost_model": problem.cost_model,
        "n_blocks": len(problem.blocks),
        "attention": problem.attention,  # the kernels assumed for the device, in words
    }
    if key != base_key(key):  # a step switch is on: the plain step's peak beside it
        plain = studio.problem(base_key(key))
        numbers["plain_step_peak"] = plain.store_all_peak
        numbers["plain_floor"] = plain.floor.nbytes
        numbers["floor"] = problem.floor.nbytes
        numbers["updates"] = sum(1 for op in problem.graph.ops if op.update)
    if "checkpoint_blocks" in methods:  # its plan at its smallest budget
        ck = studio.plan(key, "checkpoint_blocks", studio.minimum(key, "checkpoint_blocks"))
        numbers["ckpt_peak"] = ck.predicted_peak
        numbers["ckpt_time"] = ck.predicted_time
    return numbers


def tradeoff_chart(
    studio: Studio,
    context: dict,
    value: float,
    first: tuple[list[Point], list[int]] | None = None,
) -> dict:
    """The remat curves (the method's and the baselines'), and beside them the remat+offload
    curve when the switch is on (`prepare` computed it). With `first`, the method's curve is
    its points so far and its legend names the budgets still left to the whole-graph ILP."""
    key, peak = context["key"], context["peak"]
    curves = {}
    notes: dict[str, list[str]] = {}
    labels = dict(METHOD_LABELS)
    for m in [solver(context), *BASELINES]:
        if m in context["methods"] and m not in curves:
            if first is not None and m == solver(context):
                points, left = first
                lo, hi = percent(min(left), peak), percent(max(left), peak)
                where = f"{lo:.1f}%" if len(left) == 1 else f"{lo:.1f}-{hi:.1f}%"
                labels[m] = f"{labels.get(m, m)} (the whole-graph ILP still solving at {where})"
            else:
                points = studio.tradeoff(key, m)
            curves[m] = [(percent(p.budget, peak), 100 * (p.overhead - 1)) for p in points]
            notes[m] = [found_below(p, peak) for p in points]
    offload = context.get("offload")
    if offload:
        points = studio.offload_tradeoff(key)
        curves[offload] = [(percent(p.budget, peak), 100 * (p.overhead - 1)) for p in points]
    floor = studio.problem(key).floor
    return figures.tradeoff_figure(
        curves,
        labels,
        offload or solver(context),
        value,
        (percent(floor.nbytes, peak), floor.op),
        notes,
    )


def found_below(point: Point, peak: int) -> str:
    """The hover's word on a curve point whose plan was found at a lower budget (the curve
    keeps the fastest plan so far): the slider at this budget shows the plan solved for it."""
    if not point.found_at or point.found_at == point.budget:
        return ""
    return (
        f"<br>the plan found at {percent(point.found_at, peak):.1f}% (it fits here too);"
        "<br>the slider here shows the plan solved for this budget"
    )


def floor_gap(context: dict, problem: core.Problem) -> str:
    """Why the slider stops above the floor's band: the gap between them in words."""
    floor_pct = percent(problem.floor.nbytes, context["peak"])
    label = METHOD_LABELS.get(solver(context), solver(context))
    return (
        f"The slider starts at {context['min_pct']:g}%, the lowest budget {label} meets; the "
        f"grey band ends at the floor, {floor_pct:.1f}%, the inputs and outputs of one op "
        "alone. Between them is what must stay alive beside that op: the parameter gradients "
        "made so far and the values the rest of the backward recomputes from."
    )


def tradeoff_note(context: dict, link: str) -> str:
    """What the trade-off chart's curves are, under it."""
    if context.get("offload"):
        return (
            f"Dashed: {METHOD_LABELS.get(context['offload'], context['offload'])}, beside "
            f"remat alone ({METHOD_LABELS.get(context['method'], context['method'])}); {link}."
        )
    return "Turn on “offload to host memory” to draw the remat+offload curve beside these."
