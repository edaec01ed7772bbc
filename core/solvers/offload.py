"""Offload, a first version: Rockmate's recompute choices, then a greedy pass that
parks activations in host memory.

For a budget B, each base budget of a ladder from B up to the store-all peak gets Rockmate's
plan (the chain program; `core.solvers.rotor.chain_plan`). While that plan's peak is above B,
the values its forward leaves for the backward are tried largest first: each is offloaded
right after its last forward use and prefetched before its first backward reader, early
enough that the compute before the reader covers its copy back times a lead (`LEADS`). Of a
value's tries, the one with the lowest simulated peak, then time, is kept if it lowers the
peak (the simulator times the transfer lane, so queued copies and stalls count).
The fastest plan that fits B wins; a base budget that already fits is one of the candidates,
so this solver is never slower than Rockmate where Rockmate fits.

For speed, the pass from a base program (which does not depend on B until it stops) runs once
per problem, as far as the budgets asked so far need, shared by every budget, base budget and
trade-off point that starts from that program; each try is figured by
`core.simulator.TransferProbe` (numpy) instead of walked, and only the winner is simulated.

Not POFO's dynamic program: the offload choices are not part of the chain's optimisation.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass, replace

from core.errors import InfeasibleBudget
from core.plan import Plan
from core.problem import Problem, per_problem
from core.simulator import OFFLOAD, PREFETCH, RUN, Instruction, TransferProbe, walk_step
from core.solvers.rotor import chain_plan

# base budgets, as multiples of the budget asked (11 points beat 6: docs/tuning.md)
LADDER = (1.0, 1.05, 1.1, 1.2, 1.3, 1.45, 1.6, 1.8, 2.0, 2.5, 3.0)
# how early a prefetch is issued, in copy times: prefetches queue on one lane, so the copy
# time alone is too late (the leads measured: docs/tuning.md)
LEADS = (1.0, 2.0, 4.0, 8.0, 16.0)
MIN_BYTES = 1024  # smaller values are not worth a transfer (torchtune skips them too)
# an InfeasibleBudget's minimum is bisected until the bracket is this fraction of the
# store-all peak
SEARCH_TOLERANCE = 0.01


def solve(problem: Problem, budget: int) -> Plan:
    found, _ = _search(problem, budget)
    if found is None:
        raise InfeasibleBudget(budget, _minimum(problem, budget), "offload")
    plan, reached = found  # only the winner is simulated as a plan
    if reached.program == plan.program:
        return plan
    return replace(plan, program=list(reached.program), backward_start=reached.start)


def _search(problem: Problem, budget: int) -> tuple[tuple[Plan, _Reached] | None, int]:
    """The fastest (base plan, program the greedy pass reached) that fits `budget`, or None;
    and the smallest peak the ladder reached."""
    best: tuple[Plan, _Reached] | None = None
    smallest = problem.store_all_peak
    for factor in LADDER:
        base = min(int(budget * factor), problem.store_all_peak)
        try:
            plan = chain_plan(problem, base, "offload", with_options=True)
        except InfeasibleBudget:
            continue
        # offloads and prefetches added, largest kept value first, each kept when it lowers
        # the simulated peak, until the peak fits or no value is left to try
        reached = _greedy(problem, tuple(plan.program), plan.backward_start).reach(problem, budget)
        smallest = min(smallest, reached.peak)
        if reached.peak <= budget and (best is None or reached.time < best[1].time):
            best = plan, reached
        if base == problem.store_all_peak:
            break
    return best, smallest


def _minimum(problem: Problem, refused: int) -> int:
    """A budget that solves, for an InfeasibleBudget at `refused`: the smallest found.

    The smallest peak a search reached is not one: a search at that budget starts from other
    base budgets, whose greedy passes may stop higher. So the minimum is bisected (once per
    problem, from 0) and is a budget that was solved; where feasibility is not monotone and
    `refused` is above it, the bisection starts from `refused` instead.
    """
    low = _bisected(problem, 0)
    if low > refused:
        return low
    return _bisected(problem, refused) if refused < problem.store_all_peak else refused


@per_problem
def _bisected(problem: Problem, refused: int) -> int:
    """The smallest budget above `refused` found to solve: a bisection up to the store-all
    peak (which always solves) to SEARCH_TOLERANCE of it, then the smallest peak the last
    refused search reached, when that solves and is lower."""
    lo, hi = refused, problem.store_all_peak
    reached = hi
    step = max(int(problem.store_all_peak * SEARCH_TOLERANCE), 1)
    while hi - lo > step:
        mid = (lo + hi) // 2
        found, smallest = _search(problem, mid)
        if found is not None:
            hi = mid
        else:
            lo, reached = mid, smallest
    if lo < reached < hi and _search(problem, reached)[0] is not None:
        return reached
    return hi


@dataclass
class _Reached:
    """A program the greedy pass reached, with its simulated peak and time."""

    program: list[Instruction]
    start: int
    peak: int
    time: float


class _Greedy:
    """The greedy pass from one program, run only as far as the budgets asked need: the pass
    does not depend on the budget until it stops (at the first program that fits), so every
    budget, base budget and trade-off point that starts from the same program shares it.
    Each candidate's tries are figured by `TransferProbe` (held to `walk_step` in tests).
    It holds no reference to the problem (the per-problem memo would keep it alive)."""

    def __init__(self, problem: Problem, program: tuple[Instruction, ...], start: int) -> None:
        graph = problem.graph
        walked = walk_step(graph, program, start, problem.link)
        self.reached = [_Reached(list(program), start, walked.peak, walked.time)]
        self.candidates = sorted(
            (
                v
                for v in walked.kept
                if graph.values[v].kind == "activation"
                and graph.values[v].nbytes >= MIN_BYTES
                and v not in graph.final_values
            ),
            key=lambda v: (-graph.values[v].nbytes, v),
        )
        self.tried = 0  # candidates tried so far
        self.probe: TransferProbe | None = None  # of the last program reached
        self.lock = threading.Lock()

    def reach(self, problem: Problem, budget: int) -> _Reached:
        """The program the pass stops at for `budget`: the first that fits, or its last."""
        with self.lock:  # the app solves one problem from several threads
            best = self.reached[-1]
            while best.peak > budget and self.tried < len(self.candidates):
                if self.step(problem, self.candidates[self.tried]):
                    best = self.reached[-1]
                self.tried += 1
            return next((r for r in self.reached if r.peak <= budget), best)  # peaks fall

    def step(self, problem: Problem, v: int) -> bool:
        """Try offloading v at each lead; keep the try with the lowest peak, then time, if it
        lowers the peak. Whether one was kept."""
        best = self.reached[-1]
        place = _placement(problem, best.program, best.start, v)
        if place is None:
            return False
        last, reader = place
        if self.probe is None:
            self.probe = TransferProbe(problem.graph, best.program, best.start, problem.link)
        found: tuple[int, int, float] | None = None  # (prefetch step, peak, time)
        tried: set[int] = set()
        for lead in LEADS:
            at = _prefetch_step(problem, best.program, v, last, reader, lead)
            if at in tried:  # the same program as a shorter lead's
                continue
            tried.add(at)
            peak, time = self.probe.figures(v, last, at, reader)
            if peak < best.peak and (found is None or (peak, time) < found[1:]):
                found = at, peak, time
        if found is None:
            return False
        program, start = _inserted(best.program, best.start, v, last, found[0])
        self.reached.append(_Reached(program, start, found[1], found[2]))
        self.probe = self.probe.inserted(v, last, found[0], reader)
        return True


@per_problem
def _greedy(problem: Problem, program: tuple[Instruction, ...], start: int) -> _Greedy:
    """The greedy pass from `program` (memoised per problem: see `_Greedy`)."""
    return _Greedy(problem, program, start)


def with_transfer(
    problem: Problem, program: list[Instruction], start: int, v: int, lead: float = 1.0
) -> tuple[list[Instruction], int] | None:
    """`program` with `offload v` after v's last forward use and `prefetch v` before its first
    backward reader, early enough for the copy when compute allows; None when the backward
    never reads v."""
    place = _placement(problem, program, start, v)
    if place is None:
        return None
    last, reader = place
    return _inserted(
        program, start, v, last, _prefetch_step(problem, program, v, last, reader, lead)
    )


def _placement(
    problem: Problem, program: Sequence[Instruction], start: int, v: int
) -> tuple[int, int] | None:
    """(v's last forward use, its first backward reader) in `program`; None when the backward
    never reads v."""
    ops = problem.graph.ops
    last = max(
        i
        for i, (kind, o) in enumerate(program[:start])
        if kind == RUN and (v in ops[o].inputs or v in ops[o].outputs)
    )
    reader = next(
        (
            i
            for i in range(start, len(program))
            if program[i][0] == RUN and v in ops[program[i][1]].inputs
        ),
        None,
    )
    return None if reader is None else (last, reader)


def _prefetch_step(
    problem: Problem, program: Sequence[Instruction], v: int, last: int, reader: int, lead: float
) -> int:
    """The step v's prefetch goes before: the compute from there to `reader` covers its copy
    back times `lead`, or right after `last` when it cannot."""
    ops = problem.graph.ops
    need = lead * problem.graph.values[v].nbytes / problem.link.h2d
    at, covered = reader, 0.0
    while at > last + 1 and covered < need:
        at -= 1
        if program[at][0] == RUN:
            covered += ops[program[at][1]].time
    return at


def _inserted(
    program: Sequence[Instruction], start: int, v: int, last: int, at: int
) -> tuple[list[Instruction], int]:
    """`program` with `offload v` after step `last` and `prefetch v` before step `at`."""
    out = list(program[: last + 1]) + [(OFFLOAD, v)] + list(program[last + 1 : at])
    out += [(PREFETCH, v)] + list(program[at:])
    return out, start + 1 + (at <= start)
