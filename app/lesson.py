"""A lesson path: store everything -> checkpoint every block -> the solver -> offload -> the
floor. Each step sets the controls (model, method, offloading, budget) and the view to look
at, asks a question the student answers from the page, and reveals an answer computed from
the same cached plans the page draws (`app.state.Studio`): the answer's numbers are the
page's.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from app.readback import percent, slider_minimum
from app.reasons import peak_reason
from app.state import METHOD_LABELS, Studio
from core import InfeasibleBudget, fmt_bytes

MODEL = "gpt-tiny"  # a model whose curve has a shape: its blocks trade well
KEY_PARTS = ("estimated", "cpu")


@dataclass(frozen=True)
class Step:
    title: str
    method: str
    offload: bool
    budget: Callable[[Studio, str], float]  # % of the store-all peak, from the cached curves
    view: str  # the component to look at
    question: str
    answer: Callable[[Studio, str, float], str]


def _plan(studio: Studio, key: str, method: str, pct: float):
    problem = studio.problem(key)
    return studio.plan(key, method, int(pct / 100 * problem.store_all_peak))


def _extra(plan) -> str:
    return f"{100 * (plan.overhead - 1):.1f}%"


def _ckpt_pct(studio: Studio, key: str) -> float:
    """Checkpointing every block's peak, in % on the slider's 0.5 steps (rounded up)."""
    problem = studio.problem(key)
    peak = _plan(studio, key, "checkpoint_blocks", 100).predicted_peak
    return min(100.0, -(-percent(peak, problem.store_all_peak) * 2 // 1) / 2)


def _answer_store_all(studio: Studio, key: str, pct: float) -> str:
    plan = _plan(studio, key, "store_all", pct)
    return peak_reason(studio.problem(key), plan) + (
        f" Plain PyTorch's step holds {fmt_bytes(plan.predicted_peak)} at its peak."
    )


def _answer_ckpt(studio: Studio, key: str, pct: float) -> str:
    problem = studio.problem(key)
    plan = _plan(studio, key, "checkpoint_blocks", pct)
    saved = 100 - percent(plan.predicted_peak, problem.store_all_peak)
    return (
        f"The peak falls to {fmt_bytes(plan.predicted_peak)}, {saved:.0f}% below plain "
        f"PyTorch's, for {_extra(plan)} extra time: each block keeps only its input and runs "
        "its forward again in the backward, every op of it, cheap or not."
    )


def _answer_solver(studio: Studio, key: str, pct: float) -> str:
    solver = _plan(studio, key, "rockmate", pct)
    ckpt = _plan(studio, key, "checkpoint_blocks", 100)
    return (
        f"At {pct:g}%, {METHOD_LABELS['rockmate']} costs {_extra(solver)} extra time against "
        f"{_extra(ckpt)} for checkpointing every block, at no higher a peak: it recomputes "
        "only the ops that are cheap per byte freed and keeps the expensive ones (step "
        "through: each keep and recompute says what it was compared with)."
    )


def _answer_offload(studio: Studio, key: str, pct: float) -> str:
    problem = studio.problem(key)
    peak = problem.store_all_peak
    # as the slider shows them (0.5% steps), so step 5's lowest budget is this number
    remat = slider_minimum(studio.minimum(key, "rockmate"), peak)
    low = slider_minimum(studio.minimum(key, studio.offload_method), peak)
    return (
        f"Recomputation alone stops at {remat:g}% of the store-all peak; with offloading the "
        f"curve goes down to {low:g}%: activations parked in host memory cost no device "
        "memory, and their copies hide behind compute unless one comes back late (a stall)."
    )


def _answer_floor(studio: Studio, key: str, pct: float) -> str:
    problem = studio.problem(key)
    floor = problem.floor
    at = percent(floor.nbytes, problem.store_all_peak)
    # the step's budget is the lowest the slider allows with offloading: named from the
    # solver's minimum, not from the slider's value, which may not be clamped to it yet
    pct = slider_minimum(studio.minimum(key, studio.offload_method), problem.store_all_peak)
    return (
        f"One op, {floor.op} ({floor.label}), needs {fmt_bytes(floor.nbytes)} at once: "
        f"its inputs and outputs, {at:.1f}% of the store-all peak. No plan, recomputing or "
        "offloading, can hold less while that op runs: that is the floor. The lowest budget "
        f"here, {pct:g}%, is {pct - at:.1f} points above it: beside that op, what must stay "
        "alive then (the parameter gradients made so far, and the values the rest of the "
        "backward recomputes from) also needs room."
    )


def _lowest(studio: Studio, key: str) -> float:
    return 0.0  # below every minimum: the page clamps it to the slider's lowest budget


STEPS: tuple[Step, ...] = (
    Step(
        "Store everything",
        "store_all",
        False,
        lambda studio, key: 100.0,
        "timeline",
        "This is plain PyTorch. Press “to the peak”: where in the training step is memory "
        "highest, and what is alive there?",
        _answer_store_all,
    ),
    Step(
        "Checkpoint every block",
        "checkpoint_blocks",
        False,
        lambda studio, key: 100.0,
        "timeline",
        "Each block now keeps only its input. How much lower is the peak, and how much extra "
        "time does that cost? (the numbers under the budget)",
        _answer_ckpt,
    ),
    Step(
        "The solver",
        "rockmate",
        False,
        _ckpt_pct,
        "tradeoff",
        "The budget is now checkpointing's peak. Does the solver's plan cost more or less "
        "extra time than checkpointing every block, and why?",
        _answer_solver,
    ),
    Step(
        "Offload",
        "rockmate",
        True,
        _ckpt_pct,
        "tradeoff",
        "Offloading is on: look at the dashed curve. How far below recomputation's lowest "
        "budget can it go?",
        _answer_offload,
    ),
    Step(
        "The floor",
        "rockmate",
        True,
        _lowest,
        "tradeoff",
        "The budget is at its lowest. Why can no plan go lower? (the shaded band names an op)",
        _answer_floor,
    ),
)


def lesson_key(studio: Studio) -> str:
    return studio.key(MODEL, *KEY_PARTS)


def step_budget(studio: Studio, n: int) -> float:
    """Step `n`'s budget in %, or 0 for the lowest the slider allows."""
    try:
        return STEPS[n].budget(studio, lesson_key(studio))
    except InfeasibleBudget:
        return 0.0
