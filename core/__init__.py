"""Remat Studio's engine: trace -> costs -> blocks -> solve -> plan -> simulate / run."""

from core.errors import InfeasibleBudget, PlanFileError, PlanMismatch, UnsupportedModel
from core.problem import Problem, analyze
from core.schedule import Plan
from core.solvers import parse_budget, solve

__all__ = [
    "InfeasibleBudget",
    "PlanFileError",
    "PlanMismatch",
    "Plan",
    "Problem",
    "UnsupportedModel",
    "analyze",
    "parse_budget",
    "solve",
]
