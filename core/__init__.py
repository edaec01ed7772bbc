"""Remat Studio's engine: trace -> costs -> blocks -> solve -> plan -> simulate / run."""

from core.errors import InfeasibleBudget, PlanFileError, PlanMismatch, UnsupportedModel
from core.frontier import tradeoff
from core.problem import Problem, analyze
from core.runtime import apply_plan
from core.schedule import Plan, load_plan
from core.solvers import parse_budget, solve
from core.trace.model_call import ModelCall

__all__ = [
    "InfeasibleBudget",
    "ModelCall",
    "PlanFileError",
    "PlanMismatch",
    "Plan",
    "Problem",
    "UnsupportedModel",
    "analyze",
    "apply_plan",
    "load_plan",
    "parse_budget",
    "solve",
    "tradeoff",
]
