"""Rockmate (Zhao et al., ICML 2023): each block's options from the block ILP
(`core.solvers.checkmate`), chained by Rotor's dynamic program (`core.solvers.rotor`)."""

from __future__ import annotations

from core.problem import Problem
from core.schedule import Plan
from core.solvers.options import chain, option_notes
from core.solvers.rotor import chain_plan


def solve(problem: Problem, budget: int) -> Plan:
    plan = chain_plan(problem, budget, "rockmate", with_options=True)
    if budget < problem.store_all_peak:  # else no block options were needed
        plan.notes += option_notes(chain(problem, True))
    return plan
