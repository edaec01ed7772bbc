"""Chen et al. (2016): checkpoint every ceil(sqrt(L))-th block boundary of a chain of L blocks;
in the backward, each segment is recomputed from its checkpoint and kept while it is used."""

from __future__ import annotations

import math

from core.plan import Plan
from core.problem import Problem
from core.solvers.checkpoint_blocks import checkpointed_plan


def solve(problem: Problem, budget: int) -> Plan:
    n = len(problem.blocks)
    k = max(1, math.ceil(math.sqrt(n)))
    checkpoints = [b for b in range(n) if (b + 1) % k == 0]
    return checkpointed_plan(problem, checkpoints, "sqrt_n", budget)
