"""Plain PyTorch: every op runs once and every activation is kept until its backward."""

from __future__ import annotations

from core.errors import InfeasibleBudget
from core.problem import Problem
from core.schedule import Plan


def solve(problem: Problem, budget: int) -> Plan:
    base = problem.store_all_plan
    if base.predicted_peak > budget:
        raise InfeasibleBudget(budget, base.predicted_peak, "store_all")
    return Plan(
        list(base.program),
        base.backward_start,
        "store_all",
        budget,
        base.fingerprint,
        problem,
        graph_meta=base.graph_meta,
    )
