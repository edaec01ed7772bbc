"""What every group of callbacks shares: errors in words, and the plan a PLAN store names."""

from __future__ import annotations

import logging
from typing import Any

from dash.exceptions import PreventUpdate

import core
from app.state import Studio
from core.errors import fmt_bytes

log = logging.getLogger(__name__)

HIDDEN, SHOWN = {"display": "none"}, {"display": "flex"}


def plain_error(err: BaseException) -> str:
    """An exception in words a user can act on."""
    if isinstance(err, core.UnsupportedModel):
        return f"This model cannot be traced: {err}"
    if isinstance(err, core.InfeasibleBudget):
        return f"Impossible budget: {err}"
    if isinstance(err, core.errors.RematError):
        return str(err)
    return f"Something went wrong ({type(err).__name__}): {err}"


def plan_of(studio: Studio, plan_ref: dict | None) -> tuple[Any, Any]:
    """The plan (and problem) a PLAN store names, from the caches; (None, None) when there is
    none or it cannot be made (an infeasible budget is expected; anything else is logged)."""
    if not plan_ref:
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


def shown(studio: Studio, plan_ref: dict | None) -> tuple[Any, Any]:
    """`plan_of`, for a view with nothing to draw without a plan: PreventUpdate then."""
    plan, problem = plan_of(studio, plan_ref)
    if plan is None:
        raise PreventUpdate
    return plan, problem


def fmt(n: float) -> str:
    """Bytes in words (`core.errors.fmt_bytes`)."""
    return fmt_bytes(n)
