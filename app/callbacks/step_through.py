"""Play, step, jump: the step-through position over the plan's program."""

from __future__ import annotations

from typing import Any

from dash import Dash, Input, Output, State, ctx, no_update

from app import ids
from app.callbacks.common import shown
from app.readback import next_recompute, next_transfer, peak_step
from app.state import Studio

PLAY, PAUSE = "▶ play", "⏸ pause"


def register(app: Dash, studio: Studio) -> None:
    @app.callback(
        output={
            "step": Output(ids.STEP, "data", allow_duplicate=True),
            "paused": Output(ids.TICKER, "disabled"),
            "play": Output(ids.PLAY, "children"),
        },
        inputs=[
            Input(ids.PLAY, "n_clicks"),
            Input(ids.STEP_NEXT, "n_clicks"),
            Input(ids.STEP_BACK, "n_clicks"),
            Input(ids.STEP_RESET, "n_clicks"),
            Input(ids.JUMP_PEAK, "n_clicks"),
            Input(ids.JUMP_RECOMPUTE, "n_clicks"),
            Input(ids.JUMP_TRANSFER, "n_clicks"),
            Input(ids.TICKER, "n_intervals"),
        ],
        state=[
            State(ids.STEP, "data"),
            State(ids.TICKER, "disabled"),
            State(ids.SPEED, "value"),
            State(ids.PLAN, "data"),
        ],
        prevent_initial_call=True,
    )
    def step_through(
        _play, _next, _back, _reset, _peak, _rec, _copy, _tick, step, paused, speed, plan_ref
    ):
        plan, _ = shown(studio, plan_ref)
        step, paused, label = move(ctx.triggered_id, plan, step, paused, speed)
        return {"step": step, "paused": paused, "play": label}


def move(trigger: Any, plan: Any, step: int | None, paused: bool, speed: int | None) -> tuple:
    """(new step, ticker disabled, play button's label) after the control `trigger`;
    `no_update` where one stays as it is."""
    last = len(plan.program) - 1
    if trigger == ids.PLAY:
        if paused:
            return (0 if step is None or step >= last else step), False, PAUSE
        return no_update, True, PLAY
    if trigger == ids.STEP_RESET:
        return 0, True, PLAY
    if trigger == ids.JUMP_PEAK:
        return peak_step(plan.timeline), True, PLAY
    if trigger in (ids.JUMP_RECOMPUTE, ids.JUMP_TRANSFER):
        jump = next_recompute if trigger == ids.JUMP_RECOMPUTE else next_transfer
        target = jump(plan.timeline, step)
        return (no_update if target is None else target), True, PLAY
    if trigger == ids.STEP_BACK:
        return max(0, (step or 0) - 1), no_update, no_update
    stride = (speed or 1) if trigger == ids.TICKER else 1
    nxt = 0 if step is None else step + stride
    if nxt >= last:
        return last, True, PLAY
    return nxt, no_update, no_update
