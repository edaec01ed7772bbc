"""Checkpoint every block: keep only each block's input; recompute the block in its backward.

The last block keeps its activations: its backward starts right after its forward, so
recomputing it would save nothing.
"""

from __future__ import annotations

from core.errors import InfeasibleBudget
from core.plan import Plan
from core.problem import Problem
from core.schedule import plan_from_runs
from core.simulator import graph_dag
from core.solvers.keep_sets import Recompute


def checkpointed_plan(problem: Problem, checkpoints: list[int], method: str, budget: int) -> Plan:
    """Keep the outputs of blocks in `checkpoints` and all of the last block; recompute the rest."""
    blocks = problem.blocks
    keep = {blocks[b].output_value for b in checkpoints if blocks[b].output_value is not None}
    keep |= {v for o in blocks[-1].forward_ops for v in problem.graph.ops[o].outputs}
    dag = graph_dag(problem.graph)
    kept = frozenset(v for v in keep if v in dag.sizes)
    runs = [dag.order[i] for i in Recompute(dag).runs(kept)]
    plan = plan_from_runs(problem, runs, dag.n_forward, method, budget)
    if plan.predicted_peak > budget:
        raise InfeasibleBudget(budget, plan.predicted_peak, method)
    return plan


def solve(problem: Problem, budget: int) -> Plan:
    return checkpointed_plan(problem, list(range(len(problem.blocks))), "checkpoint_blocks", budget)
