"""Will it fit: plain PyTorch's and the plan's whole training footprint (`core.footprint`)
against the device preset's memory, for the plan on screen, drawn and said in words with the
attention kernels the analysis assumed for that device."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from dash import Output

from app import ids
from app.architectures import is_architecture
from app.callbacks.memory import plan_view
from app.figures.fit import fit_figure
from app.state import METHOD_LABELS, Studio
from app.words import COST_WORDS
from core import fmt_bytes, footprint

# drawn by the slider's `paint` request (app/callbacks/budget.py) beside the plan's other
# views: following the PLAN store, it came one round trip after them
FIT_VIEW = {
    "fit": Output(ids.FIT, "figure"),
    "fit_text": Output(ids.FIT_TEXT, "children"),
    "arch_fit": Output(ids.ARCH_FIT, "children"),
    "arch_fit_for": Output(ids.ARCH_FIT, "data-for"),
}


def fit_view(studio: Studio, plan_ref: dict) -> dict[str, Any]:
    """`FIT_VIEW`'s values for the plan `plan_ref` names: plain PyTorch's and the plan's
    footprints against the device's memory, drawn and in words (beside the architectures
    menu too, when the plan is one of its models); a blank saying why when there is none."""
    said: list[str] = []

    def draw(plan, problem):
        device = plan_ref["key"].split("|")[2]
        plain = studio.plan(plan_ref["key"], "store_all", problem.store_all_peak)
        rows = [
            ("plain PyTorch", footprint(problem, plain, device)),
            ("this plan", footprint(problem, plan, device)),
        ]
        label = METHOD_LABELS.get(plan.method, plan.method).split(" (")[0]
        pct = 100 * plan.budget / problem.store_all_peak
        said.append(fit_words(rows, f"{label} at {pct:.0f}%", device, problem.attention))
        return fit_figure(rows, device_words(device))

    figure = plan_view(studio, plan_ref, draw)
    words = " ".join(said)
    menu = words if is_architecture((plan_ref.get("key") or "").split("|")[0]) else ""
    return {"fit": figure, "fit_text": words, "arch_fit": menu, "arch_fit_for": plan_ref["for"]}


def fit_words(rows: Sequence[tuple[str, Any]], plan_label: str, device: str, attention: str) -> str:
    """The answer in words: each footprint against the device's memory, fits or not, and the
    attention kernels assumed ("" when the step has no attention call)."""
    (_, plain), (_, ours) = rows
    where = "this machine" if device in ("here", "cpu") else COST_WORDS.get(device, device)

    def verdict(f: Any) -> str:
        if f.fits:
            return f"{fmt_bytes(f.total)}: fits, {fmt_bytes(f.capacity - f.total)} to spare"
        return f"{fmt_bytes(f.total)}: does not fit, {fmt_bytes(f.total - f.capacity)} over"

    text = (
        f"On {where} ({fmt_bytes(plain.capacity)}): plain PyTorch needs {verdict(plain)}; "
        f"{plan_label} needs {verdict(ours)}."
    )
    return text + (f" Planned with {attention}." if attention else "")


def device_words(device: str) -> str:
    """Whose memory the line is: "an A100's memory", "this machine's memory"."""
    if device in ("here", "cpu"):
        return "this machine's memory"
    return f"{COST_WORDS.get(device, device)}'s memory"
