"""Plain PyTorch: every op runs once and every activation is kept until its backward."""

from __future__ import annotations

from core.errors import InfeasibleBudget
from core.plan import Plan
from core.problem import Problem
from core.schedule import store_all_plan


def solve(problem: Problem, budget: int) -> Plan:
    if problem.store_all_peak > budget:
        raise InfeasibleBudget(budget, problem.store_all_peak, "store_all")
    return store_all_plan(problem, "store_all", budget)
