"""Rotor (Beaumont et al., 2019/2021): optimal checkpointing of a heterogeneous chain, with
several options per block as in Rockmate, over the problem's chain of blocks. The table and
its recurrence are in `core.solvers.rotor_table`; it is computed once up to twice the
store-all peak and memoised per problem, so a new budget is a few table reads (each
schedule's peak and time found without building its program, `core.simulator.StepRuns`, and
remembered per slot count), then the chosen schedule's program and one simulation.

Method "rotor" gives each block a single option, keeping everything its backward reads.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol, TypeVar

from core.errors import InfeasibleBudget
from core.plan import Plan
from core.problem import Problem, per_problem
from core.schedule import plan_of_program, store_all_plan
from core.simulator import Instruction, StepRuns, program_from_runs
from core.solvers.options import chain, layout
from core.solvers.rotor_table import ChainBlock, Table, compute_table, runs_of, sequence

LOOSEN_PROBES = 10  # table reads spent looking above the chain model's answer


def chain_plan(problem: Problem, budget: int, method: str, with_options: bool) -> Plan:
    """The least-time chain schedule whose simulated peak fits `budget` (never above it)."""
    if problem.store_all_peak <= budget:  # the DP's rounding must not cost time here
        return store_all_plan(problem, method, budget)
    _, table = _prepared(problem, with_options)
    fixed = layout(problem).final_forward + layout(problem).constants
    slots = (budget - fixed) // table.slot
    lowest = table.min_slots()
    tried: set[int] = set()
    while lowest is not None and slots >= lowest and slots not in tried:
        tried.add(slots)
        probe = _probe(problem, with_options, slots)
        if probe.peak <= budget:
            read = lambda n: _probe(problem, with_options, n)  # noqa: E731
            best = loosen(read, table.max_slots, slots, probe, budget)
            return _plan(problem, best, method, budget)
        slots -= max(1, -(-(probe.peak - budget) // table.slot))
    minimum = chain_minimum(problem, with_options)
    if minimum <= budget and lowest is not None:
        return _plan(problem, _probe(problem, with_options, lowest), method, budget)
    raise InfeasibleBudget(budget, minimum, method)


class Probed(Protocol):
    """A schedule read from a table at some slot count: its simulated peak and time."""

    @property
    def peak(self) -> int: ...

    @property
    def time(self) -> float: ...


P = TypeVar("P", bound=Probed)


def loosen(read: Callable[[int], P], max_slots: int, slots: int, probe: P, budget: int) -> P:
    """The chain model over-counts some memory (values it keeps live for a whole stage), so a
    schedule read at a larger slot count may still fit once simulated exactly. Binary search
    the slots above `slots` (`read(slots)` gives a schedule's figures, remembered for later
    budgets) for the fastest schedule whose simulated peak fits."""
    best, lo, hi = probe, slots, max_slots
    for _ in range(LOOSEN_PROBES):
        if hi - lo <= 1:
            break
        mid = (lo + hi) // 2
        trial = read(mid)
        if trial.peak <= budget:
            lo = mid
            if trial.time < best.time:
                best = trial
        else:
            hi = mid
    return best


@per_problem
def chain_minimum(problem: Problem, with_options: bool) -> int:
    """The smallest simulated peak Rotor (`with_options` False) or Rockmate reaches."""
    method = "rockmate" if with_options else "rotor"
    _, table = _prepared(problem, with_options)
    lowest = table.min_slots()
    if lowest is None:
        raise InfeasibleBudget(0, problem.store_all_peak, method)
    return _probe(problem, with_options, lowest).peak


@dataclass(frozen=True)
class _Probe:
    """The chain schedule read from the table at one slot count, walked once: its figures
    only (a program per slot count would hold megabytes on a big model)."""

    with_options: bool
    slots: int
    peak: int
    time: float


@per_problem
def _probe(problem: Problem, with_options: bool, slots: int) -> _Probe:
    """The simulated peak and time of the schedule at `slots` (the figures `walk_step` gives
    its program, found without building it); memoised per problem, so a new budget reads
    only slot counts no earlier budget read."""
    peak, time = _step_runs(problem).figures(*_runs(problem, with_options, slots))
    return _Probe(with_options, slots, peak, time)


@per_problem
def _step_runs(problem: Problem) -> StepRuns:
    """The step's arrays the probes read, built once per problem."""
    return StepRuns(problem.graph)


def _runs(problem: Problem, with_options: bool, slots: int) -> tuple[list[int], int]:
    """The op runs of the chain schedule at `slots` (step constants first, in no block) and
    how many of them are the forward."""
    blocks, table = _prepared(problem, with_options)
    runs, n_forward = runs_of(blocks, sequence(blocks, table, slots))
    first = list(problem.constant_ops)
    return first + runs, len(first) + n_forward


def _program(problem: Problem, with_options: bool, slots: int) -> tuple[list[Instruction], int]:
    """The program of the chain schedule at `slots`."""
    graph = problem.graph
    return program_from_runs(graph.ops, *_runs(problem, with_options, slots), graph.final_values)


def _plan(problem: Problem, probe: _Probe, method: str, budget: int) -> Plan:
    program, start = _program(problem, probe.with_options, probe.slots)
    return plan_of_program(problem, program, start, method, budget)


@per_problem
def _prepared(problem: Problem, with_options: bool) -> tuple[list[ChainBlock], Table]:
    """The chain and its table up to twice the store-all peak, memoised per problem."""
    blocks = chain(problem, with_options)
    return blocks, compute_table(blocks, 2 * problem.store_all_peak)


def solve(problem: Problem, budget: int) -> Plan:
    return chain_plan(problem, budget, "rotor", with_options=False)
