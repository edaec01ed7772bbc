"""Play, step, jump: the step-through position over the plan's program."""

from __future__ import annotations

from typing import Any

from dash import Dash, Input, Output, State, ctx, no_update

from app import ids
from app.callbacks.common import shown
from app.readback import next_recompute, next_transfer, peak_step
from app.state import Studio

PLAY, PAUSE = "▶ play", "⏸ pause"


# Play, pause and play's ticks run in the page. On the server they raced: Dash keeps only the
# newest request's answer per callback, so a tick sent while the pause was on its way dropped
# the pause's answer and play went on under "pause" (4 of 4 tries under load); and with a
# round trip longer than a tick, every tick's answer was dropped and play stood still.
PLAY_JS = """function (clicks, paused) {
  const nu = window.dash_clientside.no_update;
  if (!clicks) { return [nu, nu]; }
  return paused ? [false, "PAUSE"] : [true, "PLAY"];
}""".replace("PAUSE", PAUSE).replace("PLAY", PLAY)


# Next, back, reset and play's ticks, in the page: three quick clicks on the server each read
# the step before the others' answers landed, so "step 4" was never reached under load (issue
# 36's flake of test_step_through_moves_the_highlight). A tick moves `speed` steps on, a click
# one; both stop at the program's last step (`plan.steps`, the PLAN store's), where play
# pauses; a tick at the end (play pressed there) starts again from the first.
STEP_JS = (
    """function (n, next, back, reset, step, speed, plan) {
  const dc = window.dash_clientside, nu = dc.no_update;
  if (!plan || !plan.steps) { return [nu, nu, nu]; }
  const fired = dc.callback_context.triggered.map(t => t.prop_id.split(".")[0]);
  const last = plan.steps - 1;
  if (fired.includes("RESET")) { return [0, true, "PLAY"]; }
  if (fired.includes("BACK")) { return [Math.max(0, (step || 0) - 1), nu, nu]; }
  const tick = fired.includes("TICKER");
  if (tick && !n) { return [nu, nu, nu]; }
  const at = (step === null || step === undefined) ? null : step;
  if (tick && at !== null && at >= last) { return [0, nu, nu]; }
  const next_ = at === null ? 0 : at + (tick ? (speed || 1) : 1);
  if (next_ >= last) { return [last, true, "PLAY"]; }
  return [next_, nu, nu];
}""".replace("RESET", ids.STEP_RESET)
    .replace("BACK", ids.STEP_BACK)
    .replace("TICKER", ids.TICKER)
    .replace("PLAY", PLAY)
)


def register(app: Dash, studio: Studio) -> None:
    app.clientside_callback(
        STEP_JS,
        Output(ids.STEP, "data", allow_duplicate=True),
        Output(ids.TICKER, "disabled", allow_duplicate=True),
        Output(ids.PLAY, "children", allow_duplicate=True),
        Input(ids.TICKER, "n_intervals"),
        Input(ids.STEP_NEXT, "n_clicks"),
        Input(ids.STEP_BACK, "n_clicks"),
        Input(ids.STEP_RESET, "n_clicks"),
        State(ids.STEP, "data"),
        State(ids.SPEED, "value"),
        State(ids.PLAN, "data"),
        prevent_initial_call=True,
    )
    app.clientside_callback(
        PLAY_JS,
        Output(ids.TICKER, "disabled", allow_duplicate=True),
        Output(ids.PLAY, "children", allow_duplicate=True),
        Input(ids.PLAY, "n_clicks"),
        State(ids.TICKER, "disabled"),
        prevent_initial_call=True,
    )
    app.clientside_callback(  # "next recompute" does something only on a plan with some
        "function (plan) { return !(plan && plan.recomputes > 0); }",
        Output(ids.JUMP_RECOMPUTE, "disabled"),
        Input(ids.PLAN, "data"),
    )

    @app.callback(
        output={
            "step": Output(ids.STEP, "data", allow_duplicate=True),
            "paused": Output(ids.TICKER, "disabled"),
            "play": Output(ids.PLAY, "children"),
        },
        inputs=[
            Input(ids.JUMP_PEAK, "n_clicks"),
            Input(ids.JUMP_RECOMPUTE, "n_clicks"),
            Input(ids.JUMP_TRANSFER, "n_clicks"),
        ],
        state=[State(ids.STEP, "data"), State(ids.PLAN, "data")],
        prevent_initial_call=True,
    )
    def step_through(_peak, _rec, _copy, step, plan_ref):
        plan, _ = shown(studio, plan_ref)
        step, paused, label = move(ctx.triggered_id, plan, step)
        return {"step": step, "paused": paused, "play": label}


def move(trigger: Any, plan: Any, step: int | None) -> tuple:
    """(new step, ticker disabled, play button's label) after the jump `trigger`: to the
    peak, the next recompute or the next copy; a jump stops play. Play and pause, the
    ticks, next, back and reset are the page's (`PLAY_JS`, `STEP_JS`)."""
    if trigger == ids.JUMP_PEAK:
        return peak_step(plan.timeline), True, PLAY
    jump = next_recompute if trigger == ids.JUMP_RECOMPUTE else next_transfer
    target = jump(plan.timeline, step)
    return (no_update if target is None else target), True, PLAY
