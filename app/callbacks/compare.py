"""Compare two plans side by side: the plan on screen (A) and another method or budget (B),
their timelines on one scale, and what differs: peak, extra time, the ops each recomputes."""

from __future__ import annotations

from typing import Any

from dash import Dash, Input, Output, State, html

import core
from app import figures, ids
from app.callbacks.common import blank, plain_error, plan_of, stamp
from app.readback import fate_of_ops
from app.state import METHOD_LABELS, Studio
from core import fmt_bytes, op_name

LISTED = 6  # ops named per difference


def register(app: Dash, studio: Studio) -> None:
    @app.callback(
        output={
            "a": Output(ids.COMPARE_A, "figure"),
            "b": Output(ids.COMPARE_B, "figure"),
            "diff": Output(ids.COMPARE_DIFF, "children"),
        },
        inputs=[
            Input(ids.PLAN, "data"),
            Input(ids.COMPARE_METHOD, "value"),
            Input(ids.COMPARE_BUDGET, "value"),
        ],
        state=[State(ids.CONTEXT, "data")],
        prevent_initial_call=True,
    )
    def compare(plan_ref, method_b, pct_b, context):
        """A: the plan on screen; B: `method_b` at `pct_b`% (both stamped with A's controls:
        the comparison belongs to the plan on screen)."""
        sig = (plan_ref or {}).get("for") or ""
        plan_a, problem = plan_of(studio, plan_ref)
        if plan_a is None or not context or not context.get("key"):
            note = blank(sig, "no plan on screen", 260)
            return {"a": note, "b": note, "diff": ""}
        peak = problem.store_all_peak
        pct_b = float(pct_b if pct_b is not None else plan_ref["value"])
        method_b = method_b or plan_ref["method"]
        label_a = f"A · {METHOD_LABELS.get(plan_ref['method'], plan_ref['method'])}"
        label_b = f"B · {METHOD_LABELS.get(method_b, method_b)}"
        a = _timeline(problem, plan_a, plan_ref["budget"], f"{label_a} at {plan_ref['value']:g}%")
        try:
            plan_b = studio.plan(plan_ref["key"], method_b, int(pct_b / 100 * peak))
        except core.InfeasibleBudget as err:  # B's panel and the differences say why
            least = f"{100 * err.minimum / peak:.1f}%" if err.minimum else "–"
            b = blank(sig, "<br>".join(_wrap(plain_error(err), 60)), 270)
            b["layout"]["title"] = {
                "text": f"{label_b} at {pct_b:g}%: no plan",
                "font": {"size": 12},
                "x": 0,
                "xanchor": "left",
            }
            b["layout"]["margin"] = {"l": 10, "r": 10, "t": 46, "b": 10}
            said = (
                f"B has no plan: {METHOD_LABELS.get(method_b, method_b)} needs at least "
                f"{fmt_bytes(err.minimum)} ({least} of the store-all peak), above B's "
                f"{pct_b:g}%. Set B's budget to {least} or more to compare."
            )
            return {"a": stamp(a, sig), "b": b, "diff": [html.P(said, className="no-b")]}
        top = max(plan_a.predicted_peak, plan_b.predicted_peak, plan_ref["budget"])
        b = _timeline(problem, plan_b, int(pct_b / 100 * peak), f"{label_b} at {pct_b:g}%")
        for fig in (a, b):  # one scale, so heights compare
            fig["layout"]["yaxis"]["range"] = [0, 1.1 * top / figures.pick_unit(peak)[1]]
        return {
            "a": stamp(a, sig),
            "b": stamp(b, sig),
            "diff": differences(problem, plan_a, plan_b),
        }


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
