"""What every group of callbacks shares: errors in words, and the plan a PLAN store names."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

from dash import Input
from dash.exceptions import PreventUpdate

import core
from app import figures, ids
from app.figures.axes import empty_figure
from app.state import STEP_OPTIONS, Studio
from core import block_title, fmt_bytes, op_name

log = logging.getLogger(__name__)

HIDDEN, SHOWN = {"display": "none"}, {"display": "flex"}


def stale_on_switch() -> list[Input]:
    """A background chart's `cancel` inputs: the cancel button, and every control a new
    analysis follows. A model switch then stops the charts of the model before (their solves
    stop at `core.stop_when`'s next poll) instead of sharing the interpreter with the new
    analysis until its first timeline replaces their input."""
    return [
        Input(ids.CANCEL, "n_clicks"),
        Input(ids.MODEL, "value"),
        Input(ids.COSTS, "value"),
        Input(ids.DEVICE, "value"),
        Input(ids.STEP_OPTS, "value"),
    ]


def plain_error(err: BaseException) -> str:
    """An exception in words a user can act on."""
    if isinstance(err, core.UnsupportedModel):
        return f"This model cannot be traced: {err}"
    if isinstance(err, core.InfeasibleBudget):
        return f"Impossible budget: {err}"
    if isinstance(err, core.RematError):
        return str(err)
    return f"Something went wrong ({type(err).__name__}): {err}"


def plan_of(studio: Studio, plan_ref: dict | None) -> tuple[Any, Any]:
    """The plan (and problem) a PLAN store names, from the caches; (None, None) when there is
    none or it cannot be made (an infeasible budget is expected; anything else is logged)."""
    if not plan_ref or not plan_ref.get("key"):  # none, or an imported strategy's
        return None, None
    try:
        plan = studio.plan(plan_ref["key"], plan_ref["method"], plan_ref["budget"])
    except core.InfeasibleBudget as err:
        log.info("no plan for %s: %s", plan_ref, err)
        return None, None
    except Exception:
        log.exception("cannot make the plan %s", plan_ref)
        return None, None
    return plan, studio.problem(plan_ref["key"])


# what a plan view says for an imported strategy (`app.strategies`): it has a timeline and
# numbers, not a plan of ours to draw tensors, addresses, footprints or comparisons from
NOT_OURS = "drawn for our plans: an imported strategy has its timeline and numbers"


def no_plan_words(plan_ref: dict | None) -> str:
    """Why a plan view is empty: no plan fits the budget, or the method is imported."""
    return NOT_OURS if plan_ref and plan_ref.get("strategy") else "no plan at this budget"


def shown(studio: Studio, plan_ref: dict | None) -> tuple[Any, Any]:
    """`plan_of`, for a view with nothing to draw without a plan: PreventUpdate then."""
    plan, problem = plan_of(studio, plan_ref)
    if plan is None:
        raise PreventUpdate
    return plan, problem


def fmt(n: float) -> str:
    """Bytes in words (`core.fmt_bytes`)."""
    return fmt_bytes(n)


# What the content on screen is for. Every view carries the signature of the controls it was
# drawn for (a `data-for` attribute, or a plotly figure's `layout.meta.for`); the page's
# watcher (assets/app.js) compares them with the controls on every frame and shows the busy
# bar while any differs, so no frame shows content under controls it was not drawn for.


def context_sig(
    model: str, costs: str, device: str, method: str, offload: bool, step: Sequence[str] = ()
) -> str:
    """The controls a model's analysis is for: model|device (or "here")|method|on/off, the
    step switches appended to the last ("off+optimizer+chunked")."""
    where = "here" if costs == "measured" else device
    switches = "".join(f"+{o}" for o in STEP_OPTIONS if o in step)
    return "|".join((model, where, method, ("on" if offload else "off") + switches))


def plan_sig(context_for: str, value: float) -> str:
    """The controls a plan's views are for: the analysis's signature and the budget (%)."""
    return f"{context_for}|{float(value):g}"


def stamp(fig: dict, sig: str) -> dict:
    """`fig` with `layout.meta.for` = `sig` (its other meta kept)."""
    layout = fig.setdefault("layout", {})
    meta = layout.get("meta")
    layout["meta"] = {**(meta if isinstance(meta, dict) else {}), "for": sig}
    return fig


def blank(sig: str, text: str, height: int = 300) -> dict:
    """An empty figure saying `text`, for controls with nothing to draw (no plan fits)."""
    fig = empty_figure(height)
    fig["layout"]["annotations"] = [
        {"text": text, "showarrow": False, "xref": "paper", "yref": "paper", "x": 0.5, "y": 0.5}
    ]
    return stamp(fig, sig)


def block_graph(studio: Studio, key: str, expanded: Any = ()) -> list:
    """The block graph's elements for the analysis `key`: layers closed but for `expanded`."""
    problem = studio.problem(key)
    graph = problem.graph
    return figures.graph_elements(
        problem.blocks,
        graph.ops,
        graph.values,
        figures.graph_prefix(key),
        names=[op_name(graph, o.index) for o in graph.ops],
        titles=[block_title(graph, b) for b in problem.blocks],
        expanded=set(expanded),
    )
