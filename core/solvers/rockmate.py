"""Rockmate (Zhao et al., ICML 2023): each block's options from the block ILP
(`core.solvers.checkmate`), chained by Rotor's dynamic program (`core.solvers.rotor`)."""

from __future__ import annotations

from core.problem import Problem
from core.schedule import Plan
from core.solvers.options import option_notes
from core.solvers.rotor import chain_plan


def solve(problem: Problem, budget: int) -> Plan:
    plan = chain_plan(problem, budget, "rockmate", with_options=True)
    plan.notes += option_notes(problem)  # where a block's option search hit its bound
    return plan
