"""The lesson path (`app.lesson`): start, back and next set the controls and the budget, the
view scrolls to what the question is about, and reveal answers from the plan on screen."""

from __future__ import annotations

from dash import Dash, Input, Output, State, ctx, no_update
from dash.exceptions import PreventUpdate

from app import ids
from app.callbacks.common import context_sig
from app.lesson import KEY_PARTS, MODEL, STEPS, lesson_key, step_budget
from app.state import Studio

SCROLL_JS = """function (n) {
  if (n === null || n === undefined) { return window.dash_clientside.no_update; }
  const view = document.getElementById(VIEWS[n]);
  if (view) { view.scrollIntoView({block: "center"}); }
  return VIEWS[n];
}"""


def register(app: Dash, studio: Studio) -> None:
    @app.callback(
        output={
            "step": Output(ids.LESSON, "data"),
            "model": Output(ids.MODEL, "value", allow_duplicate=True),
            "costs": Output(ids.COSTS, "value", allow_duplicate=True),
            "device": Output(ids.DEVICE, "value", allow_duplicate=True),
            "method": Output(ids.METHOD, "value", allow_duplicate=True),
            "offload": Output(ids.OFFLOAD, "value", allow_duplicate=True),
            "budget": Output(ids.BUDGET, "value", allow_duplicate=True),
            "pending": Output(ids.LESSON_PENDING, "data"),
            "title": Output(ids.LESSON_TITLE, "children"),
            "question": Output(ids.LESSON_QUESTION, "children"),
            "answer": Output(ids.LESSON_ANSWER, "children"),
            "hidden": Output(ids.LESSON_ANSWER, "hidden"),
            "back": Output(ids.LESSON_BACK, "disabled"),
            "next": Output(ids.LESSON_NEXT, "disabled"),
            "reveal": Output(ids.LESSON_REVEAL, "disabled"),
        },
        inputs=[
            Input(ids.LESSON_START, "n_clicks"),
            Input(ids.LESSON_BACK, "n_clicks"),
            Input(ids.LESSON_NEXT, "n_clicks"),
        ],
        state=[State(ids.LESSON, "data"), State(ids.CONTEXT, "data")],
        prevent_initial_call=True,
    )
    def go(_start, _back, _next, n, context):
        """Move to a lesson step and set the page's controls for it."""
        if ctx.triggered_id == ids.LESSON_START or n is None:
            n = 0
        elif ctx.triggered_id == ids.LESSON_NEXT:
            n = min(len(STEPS) - 1, n + 1)
        else:
            n = max(0, n - 1)
        step = STEPS[n]
        pct = step_budget(studio, n)
        sig = context_sig(MODEL, *KEY_PARTS, step.method, step.offload)
        here = context and context.get("for") == sig and context.get("key")
        return {
            "step": n,
            "model": MODEL,
            "costs": KEY_PARTS[0],
            "device": KEY_PARTS[1],
            "method": step.method,
            "offload": ["on"] if step.offload else [],
            # the page already shows this analysis: set the budget now; else `prepare`
            # takes it from the pending store once the analysis lands
            "budget": max(context["min_pct"], min(100.0, pct)) if here else no_update,
            "pending": {"for": sig, "pct": pct},
            "title": f"{n + 1}/{len(STEPS)} · {step.title}",
            "question": step.question,
            "answer": "",
            "hidden": True,
            "back": n == 0,
            "next": n == len(STEPS) - 1,
            "reveal": False,
        }

    @app.callback(
        Output(ids.LESSON_ANSWER, "children", allow_duplicate=True),
        Output(ids.LESSON_ANSWER, "hidden", allow_duplicate=True),
        Input(ids.LESSON_REVEAL, "n_clicks"),
        State(ids.LESSON, "data"),
        State(ids.PLAN, "data"),
        prevent_initial_call=True,
    )
    def reveal(_clicks, n, plan_ref):
        """The step's answer, from the plan on screen (its budget)."""
        if n is None or not plan_ref or "value" not in plan_ref:
            raise PreventUpdate
        return STEPS[n].answer(studio, lesson_key(studio), plan_ref["value"]), False

    views = "[" + ", ".join(f'"{s.view}"' for s in STEPS) + "]"
    app.clientside_callback(
        SCROLL_JS.replace("VIEWS", views),
        Output(ids.LESSON_VIEW, "data"),
        Input(ids.LESSON, "data"),
        prevent_initial_call=True,
    )
