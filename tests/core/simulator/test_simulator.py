"""The simulator: free-after-last-read, the checks every program passes, and the live sets and
fates the app reads (against a plain re-walk of the program)."""

from __future__ import annotations

import pytest
from helpers import TOY_OPS, TOY_SIZES

import core
from core.simulator import (
    FREE,
    RUN,
    Dag,
    InvalidPlan,
    StepRuns,
    program_from_runs,
    simulated,
    walk,
    walk_step,
)

OPS, SIZES = TOY_OPS, TOY_SIZES  # x -> a -> b -> loss (tests/helpers.py)
DAG = Dag(OPS, SIZES, final=frozenset({3, 5}))


def test_values_are_freed_after_their_last_read():
    program, start = program_from_runs(OPS, [0, 1, 2, 3, 4], 3, DAG.final)
    assert start == 3
    assert program == [
        (RUN, 0),
        (RUN, 1),
        (RUN, 2),
        (RUN, 3),
        (FREE, 2),  # b: last read by db
        (RUN, 4),
        (FREE, 1),  # a: last read by da
        (FREE, 4),
    ]


def test_a_recomputed_value_is_freed_before_it_is_produced_again():
    option = simulated(DAG, [0, 1, 2, 1, 3, 4])  # b recomputed before db
    assert option.stats.kept == frozenset({1, 3})  # b dropped after the loss read it
    assert option.stats.recomputed_ops == 1
    assert option.time == 8.0  # g runs twice
    assert option.stats.backward_peak == 10 + 1 + 100 + 100  # a, loss, b, db


@pytest.mark.parametrize(
    ("program", "message"),
    [
        ([(RUN, 1)], "reads value 1, which is not live"),
        ([(RUN, 0), (RUN, 0)], "recomputes value 1, still live"),
        ([(RUN, 0), (FREE, 1), (FREE, 1)], "frees value 1, which is not live"),
        ([(RUN, 0), (RUN, 1), (RUN, 2), (FREE, 3)], "frees value 3, an output of the step"),
        ([("spill", 1)], "unknown instruction 'spill'"),
    ],
)
def test_invalid_programs_are_refused(program, message):
    with pytest.raises(InvalidPlan, match=message):
        walk(OPS, program, len(program), SIZES, final=DAG.final)


@pytest.fixture(scope="module")
def gpt_plan(analysed):
    _, _, problem = analysed("gpt-tiny")
    return problem, core.solve(problem, 0.6, "checkpoint_blocks")  # no ILPs: fast


def test_live_sets_and_fates_match_a_rewalk_of_the_program(gpt_plan):
    problem, plan = gpt_plan
    graph, sim = problem.graph, plan.simulate()
    live = {v.index for v in graph.values if v.is_placeholder and v.kind != "tangent"}
    tangents = {v.index for v in graph.values if v.kind == "tangent"}
    assert sim.live_after(-1) == live
    runs: dict[int, int] = {}
    for i, (kind, target) in enumerate(plan.program):
        if kind == RUN:
            live |= set(graph.ops[target].outputs)
            runs[target] = runs.get(target, 0) + 1
        else:
            live.discard(target)
        assert sim.live_after(i) - tangents == live, i
        assert sim.timeline[i].live == sum(
            v.nbytes for v in graph.values if v.index in live and not v.is_placeholder
        )
        if i == plan.backward_start - 1:
            at_backward = set(live)
    fates = sim.fates()
    assert set(fates) == set(graph.forward_ops)
    for o, fate in fates.items():
        if runs[o] > 1:
            assert fate == "recomputed"
        elif at_backward.intersection(graph.ops[o].outputs):
            assert fate == "kept"
        else:
            assert fate == "freed"
    assert {"kept", "recomputed"} <= set(fates.values())


def test_a_plan_with_a_backward_op_in_the_forward_is_refused(gpt_plan):
    problem, plan = gpt_plan
    first_backward = problem.graph.backward_ops[0]
    program = [(RUN, first_backward), *plan.program]
    with pytest.raises(InvalidPlan, match="runs in the forward pass"):
        core.simulator.simulate(problem.graph, problem.block_of_op, program, len(program))


def test_step_runs_gives_the_walks_figures_for_every_chain_schedule(gpt_plan):
    """Rotor's probes read StepRuns instead of walking: on every distinct schedule Rotor and
    Rockmate give gpt-tiny (recomputes, reused values, final outputs) it finds walk_step's
    peak and time exactly, and the store-all order too."""
    from core.solvers.rotor import _prepared, _runs

    problem, _ = gpt_plan
    graph, fast = problem.graph, StepRuns(problem.graph)
    cases = {(tuple(graph.forward_ops + graph.backward_ops), len(graph.forward_ops))}
    for with_options in (False, True):
        _, table = _prepared(problem, with_options)
        for slots in range(table.min_slots(), table.max_slots + 1):
            runs, n_forward = _runs(problem, with_options, slots)
            cases.add((tuple(runs), n_forward))
    recomputing = [c for c in cases if len(c[0]) > len(set(c[0]))]
    assert len(cases) > 20 and len(recomputing) > 10
    for runs, n_forward in cases:
        walked = walk_step(
            graph, *program_from_runs(graph.ops, runs, n_forward, graph.final_values)
        )
        assert fast.figures(runs, n_forward) == (walked.peak, walked.time)
