"""Rotor (Beaumont et al., 2019/2021): optimal checkpointing of a heterogeneous chain, with
several options per block as in Rockmate, over the problem's chain of blocks. The table and
its recurrence are in `core.solvers.rotor_table`; it is computed once up to twice the
store-all peak and memoised per problem, so a new budget is a table read, the program and
one simulation.

Method "rotor" gives each block a single option, keeping everything its backward reads.
"""

from __future__ import annotations

from core.errors import InfeasibleBudget
from core.problem import Problem, per_problem
from core.schedule import Plan, plan_from_runs, store_all_plan
from core.solvers.options import chain, layout
from core.solvers.rotor_table import ChainBlock, Table, compute_table, runs_of, sequence

LOOSEN_PROBES = 10  # table reads spent looking above the chain model's answer


def chain_plan(problem: Problem, budget: int, method: str, with_options: bool) -> Plan:
    """The least-time chain schedule whose simulated peak fits `budget` (never above it)."""
    if problem.store_all_peak <= budget:  # the DP's rounding must not cost time here
        return store_all_plan(problem, method, budget)
    blocks, table = _prepared(problem, with_options)
    fixed = layout(problem).final_forward + layout(problem).constants
    slots = (budget - fixed) // table.slot
    lowest = table.min_slots()
    tried: set[int] = set()
    while lowest is not None and slots >= lowest and slots not in tried:
        tried.add(slots)
        plan = _plan_at(problem, blocks, table, slots, method, budget)
        if plan.predicted_peak <= budget:
            return _loosen(problem, blocks, table, slots, plan, method, budget)
        slots -= max(1, -(-(plan.predicted_peak - budget) // table.slot))
    minimum = chain_minimum(problem, with_options)
    if minimum <= budget and lowest is not None:
        return _plan_at(problem, blocks, table, lowest, method, budget)
    raise InfeasibleBudget(budget, minimum, method)


def _loosen(
    problem: Problem,
    blocks: list[ChainBlock],
    table: Table,
    slots: int,
    plan: Plan,
    method: str,
    budget: int,
) -> Plan:
    """The chain model over-counts some memory (values it keeps live for a whole stage), so a
    plan read at a larger slot count may still fit once simulated exactly. Binary search the
    slots above `slots` for the fastest plan whose simulated peak fits (a few table reads)."""
    best, lo, hi = plan, slots, table.max_slots
    for _ in range(LOOSEN_PROBES):
        if hi - lo <= 1:
            break
        mid = (lo + hi) // 2
        trial = _plan_at(problem, blocks, table, mid, method, budget)
        if trial.predicted_peak <= budget:
            lo = mid
            if trial.predicted_time < best.predicted_time:
                best = trial
        else:
            hi = mid
    return best


@per_problem
def chain_minimum(problem: Problem, with_options: bool) -> int:
    """The smallest simulated peak Rotor (`with_options` False) or Rockmate reaches."""
    method = "rockmate" if with_options else "rotor"
    blocks, table = _prepared(problem, with_options)
    lowest = table.min_slots()
    if lowest is None:
        raise InfeasibleBudget(0, problem.store_all_peak, method)
    return _plan_at(problem, blocks, table, lowest, method, 0).predicted_peak


def _plan_at(
    problem: Problem, blocks: list[ChainBlock], table: Table, slots: int, method: str, budget: int
) -> Plan:
    runs, n_forward = runs_of(blocks, sequence(blocks, table, slots))
    first = list(problem.constant_ops)  # step constants: in no block, computed first
    return plan_from_runs(problem, first + runs, len(first) + n_forward, method, budget)


@per_problem
def _prepared(problem: Problem, with_options: bool) -> tuple[list[ChainBlock], Table]:
    """The chain and its table up to twice the store-all peak, memoised per problem."""
    blocks = chain(problem, with_options)
    return blocks, compute_table(blocks, 2 * problem.store_all_peak)


def solve(problem: Problem, budget: int) -> Plan:
    return chain_plan(problem, budget, "rotor", with_options=False)
