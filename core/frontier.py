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


# Methods whose InfeasibleBudget reports only the smallest peak one search reached (the greedy
# offload pass starts from a ladder above the budget asked: at 1 byte it reaches nothing):
# their minimum is bisected instead.
SEARCHED_MINIMUM = ("offload",)
# bisection stops when the bracket is this fraction of the store-all peak
SEARCH_TOLERANCE = 0.01


def minimum_budget(problem: Problem, method: str = "rockmate") -> int:
    """The smallest budget (bytes) `method` can meet on this problem (for SEARCHED_MINIMUM
    methods, the smallest a bisection finds)."""
    return _minimum(problem, method)[0]


def _minimum(problem: Problem, method: str) -> tuple[int, Plan | None]:
    """`minimum_budget`, with the plan solved at that budget when finding it solved one."""
    if method == "rockmate":
        return rockmate.minimum(problem), None
    if method == "rotor":
        return chain_minimum(problem, False), None
    if method in SEARCHED_MINIMUM:
        return _bisected_minimum(problem, method)
    try:
        return solve(problem, 1, method).predicted_peak, None
    except InfeasibleBudget as e:
        return e.minimum, None


def _bisected_minimum(problem: Problem, method: str) -> tuple[int, Plan | None]:
    """The smallest budget at which `method` was found to fit, bisecting between 0 and the
    store-all peak (where every method fits) to SEARCH_TOLERANCE of it, and its plan (None
    when that is the store-all peak, never solved here). It returns a budget that was solved,
    not a plan's peak: a search started lower may not find that plan.
    Feasibility need not be monotone, so this is the smallest found, not a proven minimum."""
    lo, hi = 0, problem.store_all_peak
    found: Plan | None = None
    step = max(int(problem.store_all_peak * SEARCH_TOLERANCE), 1)
    while hi - lo > step:
        mid = (lo + hi) // 2
        try:
            found = solve(problem, mid, method)
            hi = mid
        except InfeasibleBudget:
            lo = mid
    return hi, found


def tradeoff(
    problem: Problem,
    method: str = "rockmate",
    points: int = 24,
    progress: Callable[[float], None] | None = None,
) -> list[TradeoffPoint]:
    """Evenly spaced budgets from the method's minimum to the store-all peak; at each, the
    fastest plan found at or below it, so the predicted time never rises with the budget.
    `progress(fraction)` is called before each solve (it may raise to cancel)."""
    if progress:
        progress(0.0)
    low, at_low = _minimum(problem, method)
    high = problem.store_all_peak
    budgets = sorted({low + (high - low) * i // max(points - 1, 1) for i in range(points)})
    out: list[TradeoffPoint] = []
    best: Plan | None = None
    for n, b in enumerate(budgets):
        if progress:
            progress((n + 1) / (len(budgets) + 1))
        if b == low and at_low is not None:  # the minimum's search solved this one
            plan: Plan | None = at_low
        else:
            try:
                plan = solve(problem, b, method)
            except InfeasibleBudget:
                plan = None
        if plan is not None and (best is None or plan.predicted_time < best.predicted_time):
            best = plan
        if best is not None:
            out.append(TradeoffPoint(b, best.predicted_peak, best.overhead))
    return out
