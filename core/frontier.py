"""The memory/time frontier of a method: its smallest feasible budget, and its fastest plan at
evenly spaced budgets up to the store-all peak (`core.tradeoff`, the app's trade-off chart)."""

from __future__ import annotations

from dataclasses import dataclass

from core.errors import InfeasibleBudget
from core.problem import Problem
from core.schedule import Plan
from core.solvers import rockmate, solve
from core.solvers.rotor import chain_minimum


@dataclass(frozen=True)
class TradeoffPoint:
    budget: int  # bytes asked
    predicted_peak: int  # bytes the chosen plan peaks at (never above budget)
    overhead: float  # predicted time over store-all time


def minimum_budget(problem: Problem, method: str = "rockmate") -> int:
    """The smallest budget (bytes) `method` can meet on this problem."""
    if method == "rockmate":
        return rockmate.minimum(problem)
    if method == "rotor":
        return chain_minimum(problem, False)
    try:
        return solve(problem, 1, method).predicted_peak
    except InfeasibleBudget as e:
        return e.minimum


def tradeoff(problem: Problem, method: str = "rockmate", points: int = 24) -> list[TradeoffPoint]:
    """Evenly spaced budgets from the method's minimum to the store-all peak; at each, the
    fastest plan found at or below it, so the predicted time never rises with the budget."""
    low, high = minimum_budget(problem, method), problem.store_all_peak
    budgets = sorted({low + (high - low) * i // max(points - 1, 1) for i in range(points)})
    out: list[TradeoffPoint] = []
    best: Plan | None = None
    for b in budgets:
        try:
            plan = solve(problem, b, method)
        except InfeasibleBudget:
            plan = None
        if plan is not None and (best is None or plan.predicted_time < best.predicted_time):
            best = plan
        if best is not None:
            out.append(TradeoffPoint(b, best.predicted_peak, best.overhead))
    return out
