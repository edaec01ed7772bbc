"""POFO's chain dynamic program (issue 13): keep, recompute or offload each block checkpoint.
Against brute force on small abstract chains, against Rotor's table where nothing can be
offloaded, and on CPU: plans that offload run with eager's gradients, device peak =
predicted + 4 and host bytes = predicted."""

from __future__ import annotations

import dataclasses
import math

import pytest
from helpers import assert_runs_exactly, classic_chain, draw_blocks, fresh, step_effects, until_made
from hypothesis import given, settings
from hypothesis import strategies as st

import core
from core.errors import InfeasibleBudget
from core.schedule import plan_of_program
from core.simulator import Link
from core.solvers import pofo
from core.solvers.rotor_table import BlockOption, ChainBlock
from core.solvers.rotor_table import compute_table as rotor_table
from core.validate import check_program

# bandwidths in bytes per time unit: powers of two, so copy times are exact in floats
links = st.builds(Link, st.sampled_from([1.0, 2.0, 4.0]), st.sampled_from([0.5, 1.0, 2.0, 4.0]))


@st.composite
def chains(draw):
    """Random chains of 4 to 6 blocks, as tests/test_solver_properties.chains draws them
    (there 1 to 4: an offload pays only when blocks follow the one whose backward brings the
    checkpoint back, so it needs at least 5), with budgets near Rotor's least."""
    blocks = draw_blocks(draw, draw(st.integers(4, 6)), 2)
    # budgets near Rotor's least feasible one, where an offload can pay
    least = rotor_table(blocks, 60, slots=60).min_slots()
    return blocks, max(1, (least or 30) + draw(st.integers(-1, 4)))


def family(blocks: list[ChainBlock], link: Link) -> list[list[tuple]]:
    """Every schedule of the DP's family, enumerated without a table: Rotor's persistent
    schedules (any option per block, any checkpoint kept or recomputed) where, in addition,
    any checkpoint that a sub-chain may drop can instead be offloaded after its block's
    forward, while plain forwards run whose time covers the copy, and prefetched when the
    backward of the first block after them starts."""
    n = len(blocks)
    fwd = [b.forward_time for b in blocks]

    def option(s: int, t: int, c: int, p: int | None) -> list[list[tuple]]:
        o = blocks[s].options[c]
        head = [] if s == t < n - 1 and not o.needs_forward else [("Fe", s, c)]
        if t == s:
            rests: list[list[tuple]] = [[]]
        else:
            rests = keep(s + 1, t, None) if o.reads_output else free(s + 1, t, None)
        tail = ([("prefetch", p)] if p is not None else []) + [("B", s, c)]
        return [head + r + tail for r in rests]

    def keep(s: int, t: int, p: int | None) -> list[list[tuple]]:
        found = [x for c in range(len(blocks[s].options)) for x in option(s, t, c, p)]
        for j in range(s + 1, t + 1):
            head = [("F", i) for i in range(s, j)]
            found += [head + a + b for a in free(j, t, None) for b in keep(s, j - 1, p)]
        return found

    def free(s: int, t: int, p: int | None) -> list[list[tuple]]:
        found = keep(s, t, p)
        found += [
            x
            for c, o in enumerate(blocks[s].options)
            if not o.reads_input
            for x in option(s, t, c, p)
        ]
        if s > 0 and blocks[s - 1].output > 0:
            for j in range(s + 1, t + 1):
                if blocks[s - 1].output / link.d2h <= sum(fwd[s + 1 : j]):
                    head = [("F", s), ("offload", s)] + [("F", i) for i in range(s + 1, j)]
                    found += [head + a + b for a in free(j, t, s) for b in keep(s, j - 1, p)]
        return found

    return keep(0, n - 1, None)


def walk_schedule(blocks: list[ChainBlock], link: Link, seq: list[tuple], budget: int) -> float:
    """Walk a schedule with items freed after their last read (as in
    test_solver_properties.run_schedule) and a transfer lane: an offload starts when the lane
    is free and the compute so far is done, and its item stays on the device until the first
    step that starts after its copy is done; a prefetch puts its item back on the device at
    once and the first step reading it waits for the copy. Returns the time (compute, stalls,
    the lane's last copy), or inf when a step goes over `budget`. Fails on a step that reads
    something not on the device or recomputes something live."""
    n = len(blocks)
    reads, makes = step_effects(blocks)
    live: dict = {}
    leaving: dict = {}  # item -> (bytes, copy done)
    host: dict = {}
    ready: dict = {}
    b, clock, lane = n - 1, 0.0, 0.0
    for k, step in enumerate(seq):
        kind, j = step[0], step[1]
        if kind == "offload":
            item = ("A", j - 1)
            if item in live:  # else nothing read it again: it was freed
                lane = max(lane, clock) + live[item] / link.d2h
                leaving[item] = (live.pop(item), lane)
                host[item] = leaving[item][0]
            continue
        if kind == "prefetch":
            item = ("A", j - 1)
            if item in host:
                lane = max(lane, clock) + host[item] / link.h2d
                live[item], ready[item] = host.pop(item), lane
            continue
        start = max([clock] + [ready.pop(i) for i in reads(step) if i in ready])
        leaving = {i: v for i, v in leaving.items() if v[1] > start}
        assert reads(step) <= set(live), f"step {k} {step} reads {reads(step) - set(live)}"
        assert not set(makes(step)) & (set(live) | set(host)), f"step {k} recomputes"
        grad = blocks[b + 1].grad if b + 1 < n else 0
        mem = sum(live.values()) + sum(v[0] for v in leaving.values())
        mem += grad + sum(x.permanent for x in blocks[b + 1 :])
        if kind == "B":
            assert j == b, f"step {k}: backward of block {j} before block {b}'s"
            opt = blocks[j].options[step[2]]
            peak, dt = opt.backward_peak, opt.backward_time
            b -= 1
        elif kind == "Fe":
            opt = blocks[j].options[step[2]]
            peak, dt = opt.forward_peak, opt.forward_time
        else:
            peak, dt = blocks[j].forward_peak, blocks[j].forward_time
        if mem + peak > budget:
            return math.inf
        clock = start + dt
        live |= makes(step)
        for item in list(live):
            if not any(item in reads(later) for later in until_made(seq[k + 1 :], item, makes)):
                del live[item]
    assert b == -1, "not every backward ran"
    return max(clock, lane)


@pytest.mark.slow  # a brute force over 80 chains
@settings(max_examples=80, deadline=None)
@given(chains(), links)
def test_pofo_is_optimal_in_its_family(case, link):
    """In Rotor's classic model (every backward reads its input), the table's least time is
    the least time of every schedule in the family (keep, recompute or offload each
    checkpoint), walked step by step with the transfer lane; the table's own schedule fits
    and takes that time."""
    blocks, budget = classic_chain(case[0]), case[1]
    table = pofo.compute_table(blocks, link, budget, slots=budget)
    best = table.best(budget)
    brute = min(walk_schedule(blocks, link, seq, budget) for seq in family(blocks, link))
    assert best == brute
    if best < math.inf:
        assert walk_schedule(blocks, link, pofo.sequence(blocks, table, budget), budget) == best


@settings(max_examples=80, deadline=None)
@given(chains(), links)
def test_pofo_is_sound_and_never_worse_than_rotor(case, link):
    """With droppable inputs the table's schedule still fits and takes no more than the
    table claims (a stall it counts may be shorter), and the table never claims more than
    Rotor's at any memory (it contains Rotor's moves)."""
    blocks, budget = case
    table = pofo.compute_table(blocks, link, budget, slots=budget)
    rotor = rotor_table(blocks, budget, slots=budget)
    for m in range(budget + 1):
        assert table.best(m) <= rotor.best(m)
    best = table.best(budget)
    if best < math.inf:
        walked = walk_schedule(blocks, link, pofo.sequence(blocks, table, budget), budget)
        assert walked <= best


@settings(max_examples=40, deadline=None)
@given(chains())
def test_without_a_usable_link_the_table_is_rotors(case):
    """A link too slow for any copy to fit its window leaves exactly Rotor's table."""
    blocks, budget = case
    table = pofo.compute_table(blocks, Link(1e-9, 1e-9), budget, slots=budget)
    rotor = rotor_table(blocks, budget, slots=budget)
    assert [table.best(m) for m in range(budget + 1)] == [rotor.best(m) for m in range(budget + 1)]


def pinned_case(
    blocks: list[ChainBlock], link: Link, budget: int, rotor: float, pofo_best: float
) -> list[tuple]:
    """A case hypothesis found, checked: Rotor's best, the table's, its schedule walked, and
    the best of the whole family by enumeration; the table's schedule."""
    table = pofo.compute_table(blocks, link, budget, slots=budget)
    seq = pofo.sequence(blocks, table, budget)
    assert rotor_table(blocks, budget, slots=budget).best(budget) == rotor
    assert table.best(budget) == pofo_best
    assert walk_schedule(blocks, link, seq, budget) == pofo_best
    assert min(walk_schedule(blocks, link, s, budget) for s in family(blocks, link)) == pofo_best
    return seq


def test_offloading_a_checkpoint_beats_recomputing_it():
    """Found by hypothesis: five 1-byte blocks, a 4-byte budget. Rotor's best takes 12;
    POFO's 11 offloads block 1's input during block 2's forward and prefetches it during
    block 3's backward instead of recomputing it."""
    plain = BlockOption((), (), 1.0, 1, 0, False, True, 1.0, 0, needs_forward=False)
    keeps = dataclasses.replace(plain, forward_peak=2, kept=1, needs_forward=True)
    blocks = [
        ChainBlock(1, 0, 0, (), 1.0, 1, [dataclasses.replace(plain, reads_input=False)]),
        ChainBlock(1, 0, 0, (), 1.0, 1, [plain]),
        ChainBlock(1, 0, 0, (), 1.0, 1, [plain]),
        ChainBlock(1, 0, 0, (), 1.0, 1, [keeps]),
        ChainBlock(0, 0, 0, (), 1.0, 0, [dataclasses.replace(keeps, forward_peak=1)]),
    ]
    seq = pinned_case(blocks, Link(1.0, 1.0), 4, rotor=12.0, pofo_best=11.0)
    assert seq[:4] == [("Fe", 0, 0), ("F", 1), ("offload", 1), ("F", 2)]
    assert ("prefetch", 1) in seq


def test_a_late_prefetch_stalls_and_the_table_counts_it():
    """Found by hypothesis: block 1's 3-byte input comes back in 1.5 over block 3's 1.0
    backward, so block 1's forward waits 0.5; offloading still beats Rotor's recompute."""
    opt = BlockOption((), (), 1.0, 2, 1, False, True, 1.0, 0)
    first = dataclasses.replace(opt, forward_peak=3, kept=0, reads_input=False)
    blocks = [
        ChainBlock(3, 0, 0, (), 1.0, 3, [dataclasses.replace(first, needs_forward=False)]),
        ChainBlock(1, 0, 0, (), 1.0, 1, [opt]),
        ChainBlock(1, 0, 0, (), 1.0, 1, [opt]),
        ChainBlock(
            1,
            0,
            0,
            (),
            1.0,
            1,
            [
                dataclasses.replace(opt, forward_peak=4, kept=3),
                dataclasses.replace(opt, backward_time=2.0),
            ],
        ),
        ChainBlock(0, 0, 0, (), 1.0, 0, [dataclasses.replace(opt, forward_peak=1)]),
    ]
    seq = pinned_case(blocks, Link(4.0, 2.0), 7, rotor=13.0, pofo_best=12.5)
    at = seq.index(("prefetch", 1))
    assert seq[at + 1] == ("B", 3, 0) and seq[at + 2][:2] == ("Fe", 1)


# ---- on the sample models ------------------------------------------------------------------


def chain_of_options(blocks: list[ChainBlock], s: int, t: int, p: int | None) -> list[tuple]:
    """Sub-chain s..t with every block's first option kept (no recompute inside), block p's
    input prefetched before block s's backward."""
    n = len(blocks)
    last = t < n - 1 and not blocks[t].options[0].needs_forward
    seq = [("Fe", i, 0) for i in range(s, t + 1) if not (i == t and last and s == t)]
    for i in range(t, s - 1, -1):
        seq += [("prefetch", p)] if i == s and p is not None else []
        seq.append(("B", i, 0))
    return seq


def offloading_schedule(blocks: list[ChainBlock]) -> list[tuple]:
    """A schedule of the family that offloads block 1's input: checkpoint block 0's output,
    offload it after block 1's forward, run blocks 3.. with it on the host, prefetch it for
    block 3's backward, then recompute blocks 1-2 and 0 from their inputs."""
    n = len(blocks)
    seq = [("F", 0), ("F", 1), ("offload", 1), ("F", 2)] + chain_of_options(blocks, 3, n - 1, 1)
    return seq + chain_of_options(blocks, 1, 2, None) + chain_of_options(blocks, 0, 0, None)


@pytest.mark.parametrize("name", ["gpt-tiny", "resnet-tiny"])
def test_pofo_programs_that_offload_run_exactly_as_predicted(name):
    """POFO's program builder on a schedule of its family that offloads a checkpoint (the DP
    itself picks none on these two models: their checkpoints are small): eager's gradients,
    device peak = predicted + 4 bytes, host bytes = predicted."""
    model, inputs = fresh(name)
    problem = core.analyze(model, inputs)
    blocks, _ = pofo._prepared(problem)
    program, start = pofo.program_of(problem, blocks, offloading_schedule(blocks))
    plan = plan_of_program(problem, program, start, "pofo", problem.store_all_peak)
    sim = check_program(plan, problem)
    assert [t.kind for t in sim.transfers] == ["offload", "prefetch"]
    assert sim.transfers[0].value == problem.blocks[0].output_value
    assert sim.host_peak == problem.graph.values[problem.blocks[0].output_value].nbytes
    assert_runs_exactly(model, inputs, plan)


@pytest.fixture(scope="module")
def gpt_tiny(analysed):
    return analysed("gpt-tiny")[2]


@pytest.mark.parametrize("fraction", [0.3, 0.35, 0.5, 0.8, 1.0])
def test_pofo_fits_its_budget_and_never_loses_to_rotor_or_rockmate(gpt_tiny, fraction):
    problem = gpt_tiny
    budget = int(fraction * problem.store_all_peak)
    try:
        plan = core.solve(problem, budget, "pofo")
    except InfeasibleBudget as e:
        assert 0 < e.minimum <= problem.store_all_peak and e.minimum > budget
        for method in ("rotor", "rockmate"):
            with pytest.raises(InfeasibleBudget):
                core.solve(problem, budget, method)
        return
    assert plan.predicted_peak <= budget and plan.method == "pofo"
    for method in ("rotor", "rockmate"):
        try:
            other = core.solve(problem, budget, method)
        except InfeasibleBudget:
            continue
        assert plan.predicted_time <= other.predicted_time


@pytest.mark.slow
def test_a_plan_the_dp_offloads_in_runs_exactly_as_predicted():
    """gpt-small-6l with the h100 preset at 25% of its store-all peak: the table's own plan
    offloads a layer's input (measured here: 1 MiB, no stall) and runs with eager's
    gradients, device peak = predicted + 4 bytes, host bytes = predicted."""
    model, inputs = fresh("gpt-small-6l")
    # the CPU step (it runs here) timed as on an H100, link included: device="h100" would
    # trace the H100's step, whose kernels do not run on CPU (docs/gpu.md)
    here = core.analyze(model, inputs, device="cpu")
    h100 = core.costs.DEVICES["h100"]
    times = tuple(core.costs.estimate_times(here.graph, h100))
    costs = core.CostRecord("estimated:h100", times, h100.link)
    problem = core.analyze(model, inputs, device="cpu", costs=costs)
    plan = pofo.table_plan(problem, int(0.25 * problem.store_all_peak))
    sim = check_program(plan, problem)
    assert [t.kind for t in sim.transfers] == ["offload", "prefetch"]
    assert plan.predicted_peak <= 0.25 * problem.store_all_peak
    assert sim.host_peak > 0
    assert_runs_exactly(model, inputs, plan)
