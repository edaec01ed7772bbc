"""Remat Studio's engine: trace -> costs -> blocks -> solve -> plan -> simulate / run."""

from core.bind import BoundPlan, bind
from core.costs import DEVICES
from core.errors import (
    BudgetError,
    InfeasibleBudget,
    InvalidPlan,
    PlanFileError,
    PlanMismatch,
    RematError,
    UnsupportedModel,
)
from core.fit import Fitter
from core.frontier import tradeoff
from core.graph_meta import CostRecord, GraphMeta
from core.layout import Arena, arena
from core.lowering import lower
from core.model_call import ModelCall
from core.parallel import ParallelError, ParallelPlan, parallel_plan, parallelize
from core.plan import Plan, SavedPlan, load_plan
from core.problem import Problem, analyze
from core.reorder import reorder
from core.runtime import apply_plan
from core.shapes import ShapeInfeasible, ShapeSpecError
from core.solvers import parse_budget, solve
from core.trace.loss_head import LossHead, chunked_head

__all__ = [
    "DEVICES",
    "Arena",
    "BoundPlan",
    "CostRecord",
    "GraphMeta",
    "SavedPlan",
    "Fitter",
    "BudgetError",
    "InfeasibleBudget",
    "InvalidPlan",
    "LossHead",
    "ModelCall",
    "Plan",
    "PlanFileError",
    "ParallelError",
    "ParallelPlan",
    "PlanMismatch",
    "Problem",
    "RematError",
    "ShapeInfeasible",
    "ShapeSpecError",
    "UnsupportedModel",
    "analyze",
    "apply_plan",
    "arena",
    "bind",
    "chunked_head",
    "load_plan",
    "lower",
    "parallel_plan",
    "parallelize",
    "parse_budget",
    "reorder",
    "solve",
    "tradeoff",
]
