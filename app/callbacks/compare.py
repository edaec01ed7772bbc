"""Compare two plans side by side: the plan on screen (A) and another method or budget (B),
their timelines on one scale, and what differs: peak, extra time, the ops each recomputes."""

from __future__ import annotations

from typing import Any

from dash import Dash, Input, Output, Patch, State, html

import core
from app import figures, ids
from app.callbacks.common import NOT_OURS, blank, plain_error, plan_of, stamp
from app.readback import fate_of_ops
from app.state import METHOD_LABELS, Studio
from core import fmt_bytes, op_name

LISTED = 6  # ops named per difference


# the compare view: written when B's method or budget changes, and with each new plan
COMPARED = {
    "a": Output(ids.COMPARE_A, "figure", allow_duplicate=True),
    "b": Output(ids.COMPARE_B, "figure", allow_duplicate=True),
    "diff": Output(ids.COMPARE_DIFF, "children", allow_duplicate=True),
    "b_is": Output(ids.COMPARE_DIFF, "data-b", allow_duplicate=True),  # what B's panel shows
}


def register(app: Dash, studio: Studio) -> None:
    @app.callback(
        output=COMPARED,
        inputs=[Input(ids.COMPARE_METHOD, "value"), Input(ids.COMPARE_BUDGET, "value")],
        state=[State(ids.PLAN, "data"), State(ids.CONTEXT, "data")],
        prevent_initial_call=True,
    )
    def compare(method_b, pct_b, plan_ref, context):
        """B's method or budget changed: both panels and what differs (a new plan on screen
        comes with its comparison, from `app.callbacks.budget.solve`)."""
        return compare_view(studio, plan_ref, method_b, pct_b, context)


def compare_view(
    studio: Studio,
    plan_ref: dict | None,
    method_b: str | None,
    pct_b: float | None,
    context: dict | None,
    b_shown: str | None = None,
) -> dict[str, Any]:
    """`COMPARED`'s values. A: the plan on screen; B: `method_b` at `pct_b`% (both stamped
    with A's controls: the comparison belongs to the plan on screen). `b_shown`: what B's
    panel on the page shows (its `data-b`); when that is this B already (A's budget moved,
    not B), B's figure is patched (its scale and controls), not sent again."""
    sig = (plan_ref or {}).get("for") or ""
    plan_a, problem = plan_of(studio, plan_ref)
    if plan_a is None or plan_ref is None or not context or not context.get("key"):
        note = blank(
            sig, NOT_OURS if (plan_ref or {}).get("strategy") else "no plan on screen", 260
        )
        return {"a": note, "b": note, "diff": "", "b_is": ""}
    peak = problem.store_all_peak
    pct_b = float(pct_b if pct_b is not None else plan_ref["value"])
    method_b = method_b or plan_ref["method"]
    b_is = f"{plan_ref['key']}|{method_b}|{pct_b:g}"
    same_b = b_shown == b_is
    label_a = f"A · {METHOD_LABELS.get(plan_ref['method'], plan_ref['method'])}"
    label_b = f"B · {METHOD_LABELS.get(method_b, method_b)}"
    a = _timeline(problem, plan_a, plan_ref["budget"], f"{label_a} at {plan_ref['value']:g}%")
    try:
        plan_b = studio.plan(plan_ref["key"], method_b, int(pct_b / 100 * peak))
    except core.InfeasibleBudget as err:  # B's panel and the differences say why
        least = f"{100 * err.minimum / peak:.1f}%" if err.minimum else "–"
        said = (
            f"B has no plan: {METHOD_LABELS.get(method_b, method_b)} needs at least "
            f"{fmt_bytes(err.minimum)} ({least} of the store-all peak), above B's "
            f"{pct_b:g}%. Set B's budget to {least} or more to compare."
        )
        diff = [html.P(said, className="no-b")]
        if same_b:
            return {"a": stamp(a, sig), "b": _restamped(sig), "diff": diff, "b_is": b_is}
        none = blank(sig, "<br>".join(_wrap(plain_error(err), 60)), 270)
        none["layout"]["title"] = {
            "text": f"{label_b} at {pct_b:g}%: no plan",
            "font": {"size": 12},
            "x": 0,
            "xanchor": "left",
        }
        none["layout"]["margin"] = {"l": 10, "r": 10, "t": 46, "b": 10}
        return {"a": stamp(a, sig), "b": none, "diff": diff, "b_is": b_is}
    top = max(plan_a.predicted_peak, plan_b.predicted_peak, plan_ref["budget"])
    scale = [0, 1.1 * top / figures.pick_unit(peak)[1]]  # one scale, so heights compare
    a["layout"]["yaxis"]["range"] = scale
    if same_b:
        b: Any = _restamped(sig)
        b["layout"]["yaxis"]["range"] = scale
    else:
        b = _timeline(problem, plan_b, int(pct_b / 100 * peak), f"{label_b} at {pct_b:g}%")
        b["layout"]["yaxis"]["range"] = scale
        b = stamp(b, sig)
    return {
        "a": stamp(a, sig),
        "b": b,
        "diff": differences(problem, plan_a, plan_b),
        "b_is": b_is,
    }


def _restamped(sig: str) -> Patch:
    """B's figure as it is, stamped for the controls `sig` (its data is not sent again)."""
    patch = Patch()
    patch["layout"]["meta"]["for"] = sig
    return patch


def _wrap(text: str, width: int) -> list[str]:
    """`text` in lines of at most about `width` characters, broken between words."""
    lines: list[str] = []
    for word in text.split():
        if lines and len(lines[-1]) + 1 + len(word) <= width:
            lines[-1] += " " + word
        else:
            lines.append(word)
    return lines


def _timeline(problem: Any, plan: Any, budget: int, title: str) -> dict:
    fig = figures.timeline_figure(
        plan.timeline,
        plan.backward_start,
        budget,
        [b.name for b in problem.blocks],
        unit=figures.pick_unit(problem.store_all_peak),
    )
    layout = fig["layout"]
    layout.update(height=270, showlegend=False, margin={"l": 50, "r": 10, "t": 46, "b": 40})
    layout["title"] = {"text": title, "font": {"size": 12}, "x": 0, "xanchor": "left"}
    return fig


def differences(problem: Any, a: Any, b: Any) -> list:
    """What differs between plans `a` and `b`, in words: numbers, then ops by module."""
    graph = problem.graph
    fa, fb = fate_of_ops(problem, a), fate_of_ops(problem, b)

    def ops(mine: dict, theirs: dict) -> str:
        names = [
            op_name(graph, o).words
            for o, f in mine.items()
            if f == "recomputed" and theirs.get(o) != "recomputed"
        ]
        more = f" and {len(names) - LISTED} more" if len(names) > LISTED else ""
        return "; ".join(names[:LISTED]) + more if names else "none"

    def extra(plan: Any) -> str:
        return f"{100 * (plan.overhead - 1):.1f}%"

    return [
        html.P(
            f"Peak: A {fmt_bytes(a.predicted_peak)}, B {fmt_bytes(b.predicted_peak)}. "
            f"Extra time: A {extra(a)}, B {extra(b)}. Recomputed ops: A {a.recomputed_ops}, "
            f"B {b.recomputed_ops}."
        ),
        html.P(["Only A recomputes: ", html.Span(ops(fa, fb), className="ops-a")]),
        html.P(["Only B recomputes: ", html.Span(ops(fb, fa), className="ops-b")]),
    ]
