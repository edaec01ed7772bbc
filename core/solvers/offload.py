"""Offload (issue 13), a first version: Rockmate's recompute choices, then a greedy pass that
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

Not POFO's dynamic program: the offload choices are not part of the chain's optimisation.
"""

from __future__ import annotations

from dataclasses import replace

from core.errors import InfeasibleBudget
from core.problem import Problem
from core.schedule import Plan
from core.simulator import OFFLOAD, PREFETCH, RUN, Instruction, walk_step
from core.solvers.rotor import chain_plan

# base budgets, as multiples of the budget asked (11 points: gpt-small-6l, h100 preset,
# smallest peak at <= 1.10x went from 0.507 with 6 points to 0.499)
LADDER = (1.0, 1.05, 1.1, 1.2, 1.3, 1.45, 1.6, 1.8, 2.0, 2.5, 3.0)
# how early a prefetch is issued: its copy's time at the link's rate, times each lead (there,
# lead 1 only: 0.499; 1 and 2: 0.382; 1, 2 and 4: 0.278; up to 8: 0.214 at 1.084x; up to 16:
# 0.214 at 1.074x; up to 64: no better). Prefetches queue on one lane, so the copy time alone
# is too late.
LEADS = (1.0, 2.0, 4.0, 8.0, 16.0)
MIN_BYTES = 1024  # smaller values are not worth a transfer (torchtune skips them too)


def solve(problem: Problem, budget: int) -> Plan:
    best: Plan | None = None
    smallest = problem.store_all_peak
    for factor in LADDER:
        base = min(int(budget * factor), problem.store_all_peak)
        try:
            plan = chain_plan(problem, base, "offload", with_options=True)
        except InfeasibleBudget:
            continue
        plan = offload_greedily(problem, plan, budget)
        smallest = min(smallest, plan.predicted_peak)
        if plan.predicted_peak <= budget and (
            best is None or plan.predicted_time < best.predicted_time
        ):
            best = plan
        if base == problem.store_all_peak:
            break
    if best is None:  # the smallest peak the search reached: a guide, searches from other
        raise InfeasibleBudget(budget, smallest, "offload")  # base budgets may differ
    return best


def offload_greedily(problem: Problem, plan: Plan, budget: int) -> Plan:
    """`plan` with offloads and prefetches added, largest kept value first, each kept when it
    lowers the simulated peak, until the peak fits `budget` or no value is left to try."""
    graph, link = problem.graph, problem.link
    program, start = list(plan.program), plan.backward_start
    best = walk_step(graph, program, start, link)
    candidates = sorted(
        (
            v
            for v in best.kept
            if graph.values[v].kind == "activation"
            and graph.values[v].nbytes >= MIN_BYTES
            and v not in graph.final_values
        ),
        key=lambda v: (-graph.values[v].nbytes, v),
    )
    for v in candidates:
        if best.peak <= budget:
            break
        found = None
        for lead in LEADS:
            trial = with_transfer(problem, program, start, v, lead)
            if trial is None:
                break
            walked = walk_step(graph, trial[0], trial[1], link)
            if walked.peak < best.peak and (
                found is None or (walked.peak, walked.time) < (found[1].peak, found[1].time)
            ):
                found = trial, walked
        if found is not None:
            (program, start), best = found
    if program == plan.program:
        return plan
    return replace(plan, program=program, backward_start=start, _sim=None)


def with_transfer(
    problem: Problem, program: list[Instruction], start: int, v: int, lead: float = 1.0
) -> tuple[list[Instruction], int] | None:
    """`program` with `offload v` after v's last forward use and `prefetch v` before its first
    backward reader, early enough for the copy when compute allows; None when the backward
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
    if reader is None:
        return None
    need = lead * problem.graph.values[v].nbytes / problem.link.h2d
    at, covered = reader, 0.0
    while at > last + 1 and covered < need:
        at -= 1
        if program[at][0] == RUN:
            covered += ops[program[at][1]].time
    out = program[: last + 1] + [(OFFLOAD, v)] + program[last + 1 : at]
    out += [(PREFETCH, v)] + program[at:]
    return out, start + 1 + (at <= start)
