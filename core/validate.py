"""Check a plan's program against the graph it will run on, before anything runs it.

A plan may come from a file someone edited, so nothing in it is trusted: every index is
checked against the graph, the program is walked by the simulator (which refuses a value read
before it exists, a double free, a backward op in the forward pass, random ops out of their
traced order, ...), and the peak the simulator finds, not the one the file records, must fit
the plan's budget. `core.bind` calls `check_program`; the runtime meets only checked programs.
"""

from __future__ import annotations

from core.errors import InvalidPlan, fmt_bytes
from core.native.lowering import runs_at_peak
from core.plan import Plan
from core.problem import Problem
from core.simulator import FREE, OFFLOAD, PREFETCH, RUN, Simulation


def check_program(plan: Plan, problem: Problem) -> Simulation:
    """The simulation of `plan` on `problem`, or InvalidPlan naming the step and the reason.

    Valid means: every instruction names an op or value of this graph; the forward part ends
    with every model output live (the runtime hands them to autograd); the simulator accepts
    the program; and its simulated peak fits `plan.budget` (a plan whose every FREE was
    removed still computes the right gradients, but at a peak its budget does not allow);
    for the "native" method's plans, native execution's peak (`runs_at_peak`).
    A budget of 0 means none was asked (the store-all plan a problem builds for itself).
    """
    graph = problem.graph
    program, start = plan.program, plan.backward_start
    if not isinstance(program, list) or not program:
        raise InvalidPlan("the program is empty: make the plan again")
    values = (len(graph.values), "value")
    bounds = {RUN: (len(graph.ops), "op"), FREE: values, OFFLOAD: values, PREFETCH: values}
    for i, ins in enumerate(program):
        if not isinstance(ins, (tuple, list)) or len(ins) != 2 or ins[0] not in bounds:
            raise InvalidPlan(
                f"step {i}: {str(ins)[:60]} is not a (run|free|offload|prefetch, index) instruction"
            )
        kind, target = ins
        limit, what = bounds[kind]
        if type(target) is not int or not 0 <= target < limit:
            raise InvalidPlan(
                f"step {i}: {kind} {target!r} names no {what} of this graph "
                f"({limit} {what}s): the plan was edited or made for another model"
            )
    if type(start) is not int or not 0 < start < len(program):
        raise InvalidPlan(
            f"backward_start {start!r} is not inside the program (1..{len(program) - 1}): "
            "the forward and the backward pass both need instructions"
        )
    if program[start][0] != RUN:
        raise InvalidPlan(
            f"step {start}: the backward pass must start with a run, not a {program[start][0]}"
        )
    simulation = plan.simulate()
    _check_outputs_live(plan, problem)
    peak = simulation.peak if plan.method != "native" else runs_at_peak(plan)
    if plan.budget and peak > plan.budget:
        what = "program's simulated" if plan.method != "native" else "native execution's"
        raise InvalidPlan(
            f"the {what} peak is {fmt_bytes(peak)} ({peak} bytes), above the plan's budget "
            f"of {fmt_bytes(plan.budget)} ({plan.budget} bytes): it frees less than its budget "
            "needs (an edited file?); make the plan again"
        )
    return simulation


def _check_outputs_live(plan: Plan, problem: Problem) -> None:
    """The forward part must leave every model output live: the simulator accepts a program
    that computes them only in the backward, but autograd needs them when the forward ends."""
    graph = problem.graph
    nodes = graph.trace.nodes
    outputs = {nodes[n].storages[0] for n in graph.trace.outputs}
    produced = {v: 0 for v in outputs}
    for kind, target in plan.program[: plan.backward_start]:
        if kind == RUN:
            for v in graph.ops[target].outputs:
                if v in produced:
                    produced[v] += 1
        elif target in produced and kind in (FREE, OFFLOAD):
            produced[target] -= 1
        elif target in produced:  # a prefetch
            produced[target] += 1
    for v, count in produced.items():
        if count < 1 and not graph.values[v].is_placeholder:
            raise InvalidPlan(
                f"the forward part (steps 0..{plan.backward_start - 1}) does not leave the model "
                f"output {graph.values[v].name} live: backward_start is misplaced"
            )
