"""Plans built from a solver's choices: the runs it orders, or a program of its own.

A solver only chooses what runs when; `plan_from_runs` adds the frees (each value freed after
its last read), `store_all_plan` is plain PyTorch. `Plan` itself lives in `core.plan`.
"""

from __future__ import annotations

from collections.abc import Sequence

from core.plan import Plan
from core.problem import Problem
from core.simulator import Instruction, program_from_runs, store_all_program

__all__ = ["plan_from_runs", "plan_of_program", "store_all_plan"]


def plan_from_runs(
    problem: Problem,
    runs: Sequence[int],
    backward_start: int,
    method: str,
    budget: int,
) -> Plan:
    """The plan of a sequence of op runs, each value freed right after its last read before
    it is produced again (`core.simulator.program_from_runs`), so a solver only chooses what
    runs when. `backward_start` counts runs: the first `backward_start` runs are the forward."""
    graph = problem.graph
    program, start = program_from_runs(graph.ops, runs, backward_start, graph.final_values)
    return plan_of_program(problem, program, start, method, budget)


def plan_of_program(
    problem: Problem, program: list[Instruction], backward_start: int, method: str, budget: int
) -> Plan:
    """A plan of `problem` running `program` (its first `backward_start` steps the forward)."""
    return Plan(program, backward_start, method, budget, problem)


def store_all_plan(problem: Problem, method: str = "store_all", budget: int = 0) -> Plan:
    """Plain PyTorch: every op once, in order, each value freed after its last use."""
    program, start = store_all_program(problem.graph)
    return plan_of_program(problem, program, start, method, budget)
