"""The memory/time frontier of a method: its smallest feasible budget, and its fastest plan at
evenly spaced budgets up to the store-all peak (`core.tradeoff`, the app's trade-off chart)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from core.errors import InfeasibleBudget
from core.plan import Plan
from core.problem import Problem
from core.solvers import rockmate, solve
from core.solvers.rotor import chain_minimum


@dataclass(frozen=True)
class TradeoffPoint:
    budget: int  # bytes asked
    predicted_peak: int  # bytes the chosen plan peaks at (never above budget)
    overhead: float  # predicted time over store-all time
    # the budget whose solve found that plan: a lower one when its plan beat this budget's
    # own (`solve` at `budget` then returns a slower plan than the curve shows)
    found_at: int = 0


def minimum_budget(problem: Problem, method: str = "rockmate") -> int:
    """The smallest budget (bytes) `method` can meet on this problem: a budget that solves
    (for the greedy offload method, the smallest its bisection finds)."""
    if method == "rockmate":
        return rockmate.minimum(problem)
    if method == "rotor":
        return chain_minimum(problem, False)
    try:
        return solve(problem, 1, method).predicted_peak
    except InfeasibleBudget as e:  # every method's minimum is a budget that solves
        return e.minimum


def tradeoff(
    problem: Problem,
    method: str = "rockmate",
    points: int = 24,
    progress: Callable[[float], None] | None = None,
    skip: Callable[[int], bool] | None = None,
) -> list[TradeoffPoint]:
    """Evenly spaced budgets from the method's minimum to the store-all peak; at each, the
    fastest plan found at or below it, so the predicted time never rises with the budget.
    `progress(fraction)` is called before each solve (it may raise to cancel); a budget where
    `skip(budget)` is true is left out, unsolved (a first draw without the slow points)."""
    if progress:
        progress(0.0)
    low = minimum_budget(problem, method)
    high = problem.store_all_peak
    budgets = sorted({low + (high - low) * i // max(points - 1, 1) for i in range(points)})
    out: list[TradeoffPoint] = []
    best: Plan | None = None
    found_at = 0
    for n, b in enumerate(budgets):
        if progress:
            progress((n + 1) / (len(budgets) + 1))
        if skip is not None and skip(b):
            continue
        try:
            plan: Plan | None = solve(problem, b, method)
        except InfeasibleBudget:
            plan = None
        if plan is not None and (best is None or plan.predicted_time < best.predicted_time):
            best, found_at = plan, b
        if best is not None:
            out.append(TradeoffPoint(b, best.predicted_peak, best.overhead, found_at))
    return out
