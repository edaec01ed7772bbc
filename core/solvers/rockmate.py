"""Rockmate (Zhao et al., ICML 2023): each block's options from the block ILP
(`core.solvers.checkmate`), chained by Rotor's dynamic program (`core.solvers.rotor`). A
graph whose forward is small enough is also nested as one block (`core.solvers.nested`): its
schedules compete with the chain's, the fastest plan that fits wins."""

from __future__ import annotations

from core.errors import InfeasibleBudget
from core.problem import Problem
from core.schedule import Plan
from core.solvers.nested import whole_graph_plan, whole_graph_schedules
from core.solvers.options import chain, option_notes
from core.solvers.rotor import chain_minimum, chain_plan


def solve(problem: Problem, budget: int) -> Plan:
    try:
        plan: Plan | None = chain_plan(problem, budget, "rockmate", with_options=True)
    except InfeasibleBudget:
        plan = None
    if plan is not None and budget < problem.store_all_peak:  # else no options were needed
        plan.notes += option_notes(chain(problem, True))
    whole = whole_graph_plan(problem, budget) if budget < problem.store_all_peak else None
    if whole is not None and (plan is None or whole.predicted_time < plan.predicted_time):
        plan = whole
    if plan is None:
        raise InfeasibleBudget(budget, minimum(problem), "rockmate")
    return plan


def minimum(problem: Problem) -> int:
    """The smallest simulated peak of the chain's plans and the whole graph's schedules."""
    peaks = [s.predicted_peak for s in whole_graph_schedules(problem)]
    return min([chain_minimum(problem, True), *peaks])
