"""Remat Studio's engine: trace -> costs -> blocks -> solve -> plan -> simulate / run.

Everything the app, the benchmarks and users import is named here (docs/api.md); the
modules behind these names are internal and may move.
"""

from core import strategies
from core.allocator import CUDA_CACHING, Allocator
from core.bind import BoundPlan, bind
from core.blocks import Block
from core.costs import DEVICES, LINK_BYTES, measure_link
from core.errors import (
    BudgetError,
    InfeasibleBudget,
    Interrupted,
    InvalidPlan,
    PlanFileError,
    PlanMismatch,
    RematError,
    UnsupportedModel,
    fmt_bytes,
)
from core.fit import BatchProblems, Fitter
from core.footprint import OPTIMIZER, Footprint, device_memory, footprint, optimizer_bytes
from core.frontier import minimum_budget, tradeoff
from core.graph import Graph, build_graph
from core.graph_meta import CostRecord, GraphMeta
from core.interrupt import stop_when
from core.layout import Arena, arena
from core.memory import StorageTracker, host_copy, step_tensors
from core.model_call import ModelCall
from core.naming import OpName, block_title, op_name
from core.native.lowering import lower
from core.native.runtime import NativeHandle, NativeStep, native_handle
from core.native.simulate import autocast_casts
from core.parallel import ParallelError, ParallelPlan, parallel_plan, parallelize
from core.plan import Plan, SavedPlan, load_plan
from core.problem import Problem, analyze
from core.reorder import reorder
from core.runtime.module import apply_plan
from core.schedule import plan_from_runs, store_all_plan
from core.shapes import ShapeInfeasible, ShapeSpecError
from core.simulator import (
    FREE,
    OFFLOAD,
    PREFETCH,
    RUN,
    Simulation,
    Step,
    Transfer,
    graph_dag,
    walk,
)
from core.simulator.timeline import step_values
from core.solvers import available_methods, parse_budget, solve
from core.solvers.keep_sets import Recompute
from core.solvers.rockmate import WHOLE_GRAPH_MAX_OPS, ilp_pending
from core.trace import Autocast, capture
from core.trace.attention import attention_kernel
from core.trace.loss_head import LossHead, chunked_head

__all__ = [
    # planning
    "DEVICES",
    "Autocast",
    "ModelCall",
    "Problem",
    "analyze",
    "attention_kernel",
    "available_methods",
    "parse_budget",
    "solve",
    "tradeoff",
    "ilp_pending",
    "WHOLE_GRAPH_MAX_OPS",
    "minimum_budget",
    "stop_when",
    "autocast_casts",
    "reorder",
    "lower",
    "LossHead",
    "chunked_head",
    "Fitter",
    "BatchProblems",
    "ParallelPlan",
    "parallel_plan",
    "parallelize",
    "strategies",
    # plans, their files and their binding to a model
    "Plan",
    "SavedPlan",
    "GraphMeta",
    "CostRecord",
    "load_plan",
    "bind",
    "BoundPlan",
    "apply_plan",
    "plan_from_runs",
    "store_all_plan",
    # reading a plan: its graph, program, timeline and names (the app's views)
    "Graph",
    "Block",
    "Recompute",
    "RUN",
    "FREE",
    "OFFLOAD",
    "PREFETCH",
    "Simulation",
    "Step",
    "Transfer",
    "walk",
    "graph_dag",
    "step_values",
    "OpName",
    "op_name",
    "block_title",
    "Arena",
    "arena",
    # memory on a device: footprints, allocators, host links
    "Footprint",
    "footprint",
    "device_memory",
    "optimizer_bytes",
    "OPTIMIZER",
    "Allocator",
    "CUDA_CACHING",
    "LINK_BYTES",
    "measure_link",
    # measuring a real step
    "StorageTracker",
    "step_tensors",
    "host_copy",
    "native_handle",
    "NativeHandle",
    "NativeStep",
    "capture",
    "build_graph",
    "fmt_bytes",
    # errors
    "RematError",
    "BudgetError",
    "InfeasibleBudget",
    "Interrupted",
    "InvalidPlan",
    "PlanFileError",
    "PlanMismatch",
    "ParallelError",
    "ShapeInfeasible",
    "ShapeSpecError",
    "UnsupportedModel",
]
