"""Will it fit: plain PyTorch's and the plan's whole training footprint (`core.footprint`)
against the device preset's memory, for the plan on screen."""

from __future__ import annotations

from dash import Dash, Input, Output

from app import ids
from app.callbacks.memory import plan_view
from app.figures.fit import fit_figure
from app.state import Studio
from app.words import COST_WORDS
from core import footprint


def register(app: Dash, studio: Studio) -> None:
    @app.callback(
        Output(ids.FIT, "figure"),
        Input(ids.PLAN, "data"),
        prevent_initial_call=True,
    )
    def draw_fit(plan_ref):
        def draw(plan, problem):
            device = plan_ref["key"].split("|")[2]
            plain = studio.plan(plan_ref["key"], "store_all", problem.store_all_peak)
            rows = [
                ("plain PyTorch", footprint(problem, plain, device)),
                ("this plan", footprint(problem, plan, device)),
            ]
            return fit_figure(rows, device_words(device))

        return plan_view(studio, plan_ref, draw)


def device_words(device: str) -> str:
    """Whose memory the line is: "an A100's memory", "this machine's memory"."""
    if device in ("here", "cpu"):
        return "this machine's memory"
    return f"{COST_WORDS.get(device, device)}'s memory"
