"""Offloading (issue 13): the two-lane simulator, programs refused, plan files, the CPU runtime
(gradients, device peak = predicted + 4, host bytes = predicted) and the greedy solver."""

from __future__ import annotations

import pytest
import torch
from helpers import (
    SEED_BYTES,
    TOY_FINAL,
    TOY_OPS,
    TOY_SIZES,
    assert_same_grads,
    check_runs_as_predicted,
    forced,
    fresh,
    measured_step,
)

import core
from app import cli
from core.costs import DEVICES, host_link, measure_link
from core.errors import InfeasibleBudget, PlanFileError
from core.frontier import minimum_budget
from core.plan import Plan, SavedPlan
from core.runtime.module import PlannedModule
from core.schedule import store_all_plan
from core.simulator import (
    FREE,
    OFFLOAD,
    PREFETCH,
    RUN,
    DagOp,
    InvalidPlan,
    Link,
    TransferProbe,
    program_from_runs,
    walk,
    walk_step,
)
from core.solvers import offload as offload_solver
from core.solvers.offload import with_transfer
from core.validate import check_program
from sample_models import SMALL

OPS, SIZES = TOY_OPS, TOY_SIZES  # x -> a -> b -> loss (tests/helpers.py)
FINAL = TOY_FINAL
LINK = Link(d2h=10.0, h2d=5.0)  # bytes/s: a (10 bytes) goes out in 1 s, comes back in 2 s


def offload_a() -> list:
    """Offload a after b's run (its last forward read); prefetch it right before da."""
    return [(RUN, 0), (RUN, 1), (OFFLOAD, 1), (RUN, 2)] + [
        (RUN, 3),
        (FREE, 2),
        (PREFETCH, 1),
        (RUN, 4),
        (FREE, 1),
        (FREE, 4),
    ]


def test_offload_frees_the_device_when_the_copy_is_done_and_a_late_prefetch_stalls():
    program = offload_a()
    walked = walk(OPS, program, 4, SIZES, final=FINAL, record=True, link=LINK)
    # a's copy out runs 3..4 s (after b), so a leaves the device before db (step 4)
    assert [c[0] for c in walked.columns] == [10, 110, 110, 111, 201, 101, 111, 121, 111, 11]
    assert walked.peak == 201  # without the offload: a, b, loss, db = 211
    # prefetch issued after db (5 s), done at 7 s: da waits 2 s
    assert walked.stall == 2.0
    assert walked.time == 6.0 + 2.0
    assert walked.host == [0, 0, 10, 10, 10, 10, 10, 0, 0, 0]  # host copy dropped at da
    assert walked.host_peak == 10
    out, back = walked.transfers
    assert (out.kind, out.start, out.end, out.release) == (OFFLOAD, 3.0, 4.0, 4)
    assert (back.kind, back.start, back.end, back.release) == (PREFETCH, 5.0, 7.0, 7)


def test_an_early_prefetch_costs_no_time():
    """Issued before db (at 4 s, when loss is done), a's copy back overlaps db (4..5 s)."""
    program = [(RUN, 0), (RUN, 1), (OFFLOAD, 1), (RUN, 2), (PREFETCH, 1), (RUN, 3)]
    program += [(FREE, 2), (RUN, 4), (FREE, 1), (FREE, 4)]
    slow = walk(OPS, program, 5, SIZES, final=FINAL, link=LINK)
    fast = walk(OPS, program, 5, SIZES, final=FINAL, link=Link(d2h=100.0, h2d=100.0))
    assert slow.stall == 1.0  # done at 6 s, da ready to run at 5 s
    assert fast.stall == 0.0 and fast.time == 6.0


def test_the_copy_out_holds_the_device_until_it_is_done():
    """On a slow link a's copy is still running when loss runs: a stays on the device."""
    program = offload_a()
    walked = walk(OPS, program, 4, SIZES, final=FINAL, record=True, link=Link(0.5, 5.0))
    assert walked.columns[3][0] == 111  # a (copy done at 23 s), b, loss
    assert walked.columns[4][0] == 211  # and db
    assert walked.transfers[0].release == 7  # before da, which waits for the copy back (25 s)
    assert walked.columns[6][0] == 111 + 10  # meanwhile a is on the device twice
    assert walked.columns[7][0] == 121


@pytest.mark.parametrize(
    ("program", "message"),
    [
        ([(RUN, 0), (PREFETCH, 1)], "step 1: prefetches value 1, which was never offloaded"),
        ([(RUN, 0), (OFFLOAD, 1), (RUN, 1)], "step 2: op 1 reads value 1, which is not live, "),
        ([(RUN, 0), (OFFLOAD, 1), (FREE, 1)], "step 2: frees value 1, which is not live, it is"),
        ([(RUN, 0), (OFFLOAD, 1), (OFFLOAD, 1)], "step 2: offloads value 1, which is not live"),
        (
            [(RUN, 0), (OFFLOAD, 1), (PREFETCH, 1), (PREFETCH, 1)],
            "step 3: prefetches value 1, which was prefetched already",
        ),
        ([(RUN, 0), (OFFLOAD, 1), (RUN, 0)], "step 2: op 0 recomputes value 1, parked on the"),
        ([(RUN, 0), (RUN, 1), (RUN, 2), (OFFLOAD, 3)], "offloads value 3, an output of the"),
        ([(OFFLOAD, 0)], "step 0: offloads value 0, which is not live on the device"),
    ],
)
def test_invalid_transfers_are_refused(program, message):
    with pytest.raises(InvalidPlan, match=message):
        walk(OPS, program, len(program), SIZES, initial=[0], final=FINAL, link=LINK)


def test_a_transfer_needs_a_link():
    with pytest.raises(InvalidPlan, match="step 1: a offload needs a host link"):
        walk(OPS, [(RUN, 0), (OFFLOAD, 1)], 2, SIZES, final=FINAL)


def test_device_presets_carry_host_links_with_sources():
    assert DEVICES["h100"].link == Link(d2h=52.8e9, h2d=35e9)  # nvbandwidth #24
    assert DEVICES["a100"].link == Link(d2h=25e9, h2d=25e9)  # PCIe 4 x16
    assert host_link("estimated:h100") == DEVICES["h100"].link
    assert host_link("measured:cpu") == DEVICES["cpu"].link  # one memory: the preset
    assert host_link("estimated:tpu-unknown") == Link(25e9, 25e9)
    with pytest.raises(ValueError, match="positive"):
        Link(0.0, 1.0)


def test_the_link_is_measured_where_costs_are_measured(capsys):
    """On an accelerator a problem with measured costs copies at the link measured there; the
    measurement itself runs here on CPU (a memcpy), and asking for a missing device is an
    error that says what to do."""
    link = measure_link("cpu", nbytes=1 << 20, repeats=3)
    # bytes per second, not GB/s or seconds: 10 MB/s (a memcpy on a loaded core) to 10 TB/s
    assert 1e7 < link.d2h < 1e13 and 1e7 < link.h2d < 1e13
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="no CUDA device here"):
            host_link("measured:cuda:0")
    with pytest.raises(ValueError, match="not a torch device"):
        measure_link("gpu0")
    assert cli.main(["link", "--device", "cpu"]) == 0
    assert "GB/s" in capsys.readouterr().out
    assert cli.main(["link", "--device", "nope"]) == 2
    assert "error: 'nope' is not a torch device" in capsys.readouterr().err


# --------------------------------------------------------------------------- traced steps


@pytest.mark.parametrize("name", SMALL)
def test_offloaded_store_all_plans_run_exactly_as_predicted(name):
    check_runs_as_predicted(name, "store_all", 3)


@pytest.mark.parametrize("name", ["gpt-tiny", "resnet-tiny"])
def test_offload_on_top_of_recomputation_runs_exactly_as_predicted(name):
    check_runs_as_predicted(name, "checkpoint_blocks", 2)


@pytest.fixture(scope="module")
def gpt(analysed):
    return analysed("gpt-tiny")


def test_the_offload_minimum_is_bisected_and_met(gpt):
    """The greedy solver's InfeasibleBudget only reports where one search got, so its minimum
    (the app's curve, the bench's "min" row) is bisected, to 1% of the store-all peak: a
    budget that was solved, so asking for it again succeeds."""
    _, _, problem = gpt
    low = minimum_budget(problem, "offload")
    tolerance = problem.store_all_peak // 100
    assert low <= minimum_budget(problem, "rockmate") + tolerance
    assert low < problem.store_all_peak // 2  # gpt-tiny: about 30% of store-all here
    assert core.solve(problem, low, "offload").predicted_peak <= low


def test_the_solver_offloads_instead_of_recomputing(gpt):
    model, inputs, problem = gpt
    rockmate = core.solve(problem, 0.5, "rockmate")
    plan = core.solve(problem, 0.5, "offload")
    assert plan.predicted_peak <= 0.5 * problem.store_all_peak
    assert plan.predicted_time <= rockmate.predicted_time
    assert plan.predicted_host_bytes > 0
    assert "offloaded" in plan.simulate().fates().values()
    _, _, eager_grads = measured_step(model, inputs, seed=5)
    run = core.apply_plan(model, plan)
    peak, _, grads = measured_step(model, inputs, seed=5, run=run)
    assert_same_grads(grads, eager_grads)
    assert peak == plan.predicted_peak + SEED_BYTES
    assert run.host_peak == plan.predicted_host_bytes


@pytest.mark.parametrize("fraction", [0.35, 0.6, 0.8, 1.0])
def test_the_solver_fits_its_budget_and_never_loses_to_rockmate(gpt, fraction):
    _, _, problem = gpt
    try:
        plan = core.solve(problem, fraction, "offload")
    except InfeasibleBudget as e:
        assert e.args  # the floor is named; rockmate cannot do better than offload's base
        with pytest.raises(InfeasibleBudget):
            core.solve(problem, fraction, "rockmate")
        return
    assert plan.predicted_peak <= fraction * problem.store_all_peak
    try:
        rockmate = core.solve(problem, fraction, "rockmate")
    except InfeasibleBudget:
        return
    assert plan.predicted_time <= rockmate.predicted_time


def test_invalid_offload_programs_are_refused_naming_the_step(gpt):
    _, _, problem = gpt
    plan = forced(problem, store_all_plan(problem), 1)
    i = next(i for i, (kind, _) in enumerate(plan.program) if kind == PREFETCH)
    value = plan.program[i][1]
    name = problem.graph.values[value].name
    no_prefetch = Plan(
        plan.program[:i] + plan.program[i + 1 :], plan.backward_start, "x", 0, problem
    )
    with pytest.raises(InvalidPlan, match=rf"step \d+: .* reads {name}, which is not live, parked"):
        check_program(no_prefetch, problem)
    j = next(i for i, (kind, _) in enumerate(plan.program) if kind == OFFLOAD)
    no_offload = Plan(
        plan.program[:j] + plan.program[j + 1 :], plan.backward_start - 1, "x", 0, problem
    )
    with pytest.raises(InvalidPlan, match=rf"step {i - 1}: prefetches {name}, which was never"):
        check_program(no_offload, problem)
    param = problem.graph.values[0]
    params = Plan([(OFFLOAD, 0), *plan.program], plan.backward_start + 1, "x", 0, problem)
    with pytest.raises(InvalidPlan, match=f"step 0: offloads {param.name}, which is not a live"):
        check_program(params, problem)


def test_offload_plans_round_trip_through_plan_files(tmp_path, gpt):
    _, _, problem = gpt
    plan = core.solve(problem, 0.5, "offload")
    plan.save(tmp_path / "plan.pkl")
    loaded = core.load_plan(tmp_path / "plan.pkl").on(problem)
    assert loaded.program == plan.program
    assert loaded.predicted_host_bytes == plan.predicted_host_bytes
    data = plan.to_data()
    data["program"][3] = ["spill", 0]
    with pytest.raises(PlanFileError, match=r"program step 3.*run\|free\|offload\|prefetch"):
        SavedPlan.from_data(data)


def test_offload_plans_on_other_devices_are_refused_not_run(gpt):
    model, _, problem = gpt
    plan = forced(problem, store_all_plan(problem), 1)
    meta = fresh("gpt-tiny")[0].to("meta")
    with pytest.raises(NotImplementedError, match="run on CPU and CUDA, not on meta"):
        PlannedModule(meta, problem.graph, plan)


def test_retain_graph_backward_twice_with_offloads(gpt):
    model, inputs, problem = gpt
    plan = forced(problem, store_all_plan(problem), 2)
    run = core.apply_plan(model, plan)
    model.zero_grad(set_to_none=True)
    torch.manual_seed(1)
    loss = run(*inputs)
    loss.backward(retain_graph=True)
    once = {n: p.grad.clone() for n, p in model.named_parameters()}
    loss.backward()
    for n, p in model.named_parameters():
        torch.testing.assert_close(p.grad, 2 * once[n], msg=n)


def test_arena_lifetimes_follow_transfers(gpt):
    """Each step, the storages the arena places live add up to the simulator's live bytes:
    an offloaded copy lives until its copy out is done, a prefetch allocates a new one."""
    from core.layout import arena

    _, _, problem = gpt
    plan = core.solve(problem, 0.5, "offload")
    sim, layout = plan.simulate(), arena(plan)
    for step in sim.timeline:
        placed = sum(p.size for p in layout.placements if p.first <= step.index <= p.last)
        assert placed == step.live, step
    assert layout.size >= sim.peak


# --------------------------------------------------------------------------- random programs


def reference(ops, program, sizes, link):
    """The two-lane model re-derived in two passes, as a check on `walk`: first every
    instruction's times, then each storage copy's lifetime in steps from those times."""
    clock = lane = stall = 0.0
    starts: dict[int, float] = {}  # run step -> start
    copy_end: dict[int, float] = {}  # transfer step -> copy done
    ready: dict[int, float] = {}
    for i, (kind, target) in enumerate(program):
        if kind == RUN:
            start = max([clock] + [ready.pop(v) for v in ops[target].inputs if v in ready])
            stall += start - clock
            starts[i], clock = start, start + ops[target].time
        elif kind in (OFFLOAD, PREFETCH):
            rate = link.d2h if kind == OFFLOAD else link.h2d
            lane = copy_end[i] = max(lane, clock) + sizes[target] / rate
            if kind == PREFETCH:
                ready[target] = lane

    def done_by(i: int) -> int:  # the first run starting once copy i is done
        return next((j for j in sorted(starts) if j > i and starts[j] >= copy_end[i]), None)

    device = [0] * len(program)
    host = [0] * len(program)
    born: dict[int, int] = {}

    def add(counts, v, first, last):  # bytes of v live after steps first..last-1
        for s in range(first, len(program) if last is None else last):
            counts[s] += sizes[v]

    for i, (kind, target) in enumerate(program):
        if kind == RUN:
            for v in ops[target].outputs:
                born[v] = i
        elif kind == FREE:
            add(device, target, born.pop(target), i)
        elif kind == OFFLOAD:
            add(device, target, born.pop(target), done_by(i))
            host_from = i
        else:
            prefetch = i
            add(host, target, host_from, done_by(prefetch))
            born[target] = i
    for v, first in born.items():
        add(device, v, first, None)
    return max(clock, lane), stall, device, host


@pytest.mark.parametrize("seed", range(40))
def test_walk_agrees_with_a_two_pass_reference_on_random_programs(seed):
    """A chain of n layers, its store-all program, one random activation offloaded at a random
    point after its last forward read and prefetched at a random point before its reader."""
    import random

    rnd = random.Random(seed)
    n = rnd.randint(2, 5)
    ops = [DagOp((i,), (i + 1,), rnd.uniform(0.5, 2), False) for i in range(n)]  # a_1..a_n
    ops.append(DagOp((n,), (n + 1,), 1.0, True))  # g_n
    for i in range(n - 1, 0, -1):  # g_i reads a_i and g_{i+1}
        ops.append(DagOp((i, n + 1 + (n - i - 1)), (n + 1 + (n - i),), rnd.uniform(0.5, 2), True))
    sizes = {v: rnd.randint(1, 50) for v in range(1, 2 * n + 1)}
    final = frozenset({2 * n})
    program, start = program_from_runs(ops, list(range(len(ops))), n, final)
    v = rnd.randint(1, n - 1)  # a_v, read by g_v
    last = program.index((RUN, v))  # a_v's last forward read: layer v + 1
    reader = program.index((RUN, len(ops) - v))
    off = rnd.randint(last + 1, start)
    pre = rnd.randint(off + 1, reader + 1)
    program = program[:off] + [(OFFLOAD, v)] + program[off : pre - 1] + [(PREFETCH, v)]
    program += program_from_runs(ops, list(range(len(ops))), n, final)[0][pre - 1 :]
    start += 1 + (pre - 1 <= start)
    link = Link(rnd.uniform(5, 100), rnd.uniform(5, 100))
    walked = walk(ops, program, start, sizes, final=final, record=True, link=link)
    time, stall, device, host = reference(ops, program, sizes, link)
    assert walked.time == pytest.approx(time) and walked.stall == pytest.approx(stall)
    assert [c[0] for c in walked.columns] == device
    assert walked.host == host
    assert walked.peak == max(device[:start] + device[start:])


@pytest.mark.parametrize("seed", range(20))
def test_host_slots_never_overlap_while_parked(seed):
    """Random offload/prefetch spans: two copies parked at the same time get disjoint bytes of
    the pool; copies parked last-in first-out (a forward then its backward) pack tightly."""
    import random

    from core.simulator import Transfer, host_layout

    rnd = random.Random(seed)
    sizes = {v: rnd.randint(1, 100) for v in range(8)}
    events = []  # (step, kind, value): each value out once, back later (or never)
    step = 0
    for v in rnd.sample(range(8), 8):
        events.append((step, OFFLOAD, v))
        step += rnd.randint(1, 3)
    for v in rnd.sample(range(8), rnd.randint(0, 8)):
        events.append((step, PREFETCH, v))
        step += rnd.randint(1, 3)
    transfers = [Transfer(k, v, s, 0.0, 0.0, s + 1 if k == PREFETCH else -1) for s, k, v in events]
    slots = host_layout(transfers, sizes, step)
    span = {v: [s, step] for s, k, v in events if k == OFFLOAD}
    for s, k, v in events:
        if k == PREFETCH:
            span[v][1] = s + 1
    where = {v: slots[s] for s, k, v in events if k == OFFLOAD}
    for a in range(8):
        for b in range(a):
            if span[a][0] < span[b][1] and span[b][0] < span[a][1]:  # parked together
                assert where[a] + sizes[a] <= where[b] or where[b] + sizes[b] <= where[a]
    stack = [Transfer(OFFLOAD, v, v, 0.0, 0.0, -1) for v in range(8)]
    stack += [Transfer(PREFETCH, v, 20 - v, 0.0, 0.0, 21 - v) for v in reversed(range(8))]
    lifo = host_layout(stack, sizes, 30)
    assert max(lifo[v] + sizes[v] for v in range(8)) == sum(sizes.values())


def test_every_subset_of_offloads_runs_exactly_as_predicted(gpt):
    """All 15 non-empty subsets of gpt-tiny's 4 largest kept activations, offloaded in turn
    (their transfers interleave differently on the lane): each runs at its predicted peak."""
    from itertools import combinations

    model, inputs, problem = gpt
    base = store_all_plan(problem)
    graph = problem.graph
    kept = base.simulate().live_after(base.backward_start - 1)
    top = sorted(
        (v for v in kept if graph.values[v].kind == "activation"),
        key=lambda v: (-graph.values[v].nbytes, v),
    )[:4]
    _, _, eager_grads = measured_step(model, inputs, seed=2)
    for k in range(1, 5):
        for chosen in combinations(top, k):
            program, start = list(base.program), base.backward_start
            for v in chosen:
                trial = with_transfer(problem, program, start, v, lead=2.0)
                assert trial is not None
                program, start = trial
            plan = Plan(program, start, "subset", 0, problem)
            run = core.apply_plan(model, plan)
            peak, _, grads = measured_step(model, inputs, seed=2, run=run)
            assert_same_grads(grads, eager_grads)
            assert peak == plan.predicted_peak + SEED_BYTES, chosen
            assert run.host_peak == plan.predicted_host_bytes, chosen


def test_a_value_offloaded_twice_while_its_first_copies_are_still_running():
    """a goes out, comes back and goes out again before the first copies are done: the
    device and host copies are released oldest first, as the reference says."""
    program = [(RUN, 0), (RUN, 1), (OFFLOAD, 1), (PREFETCH, 1), (OFFLOAD, 1), (RUN, 2)]
    program += [(RUN, 3), (FREE, 2), (PREFETCH, 1), (RUN, 4), (FREE, 1), (FREE, 4)]
    link = Link(d2h=4.0, h2d=8.0)
    walked = walk(OPS, program, 6, SIZES, final=FINAL, record=True, link=link)
    time, stall, device, host = reference(OPS, program, SIZES, link)
    assert walked.time == pytest.approx(time) and walked.stall == pytest.approx(stall)
    assert [c[0] for c in walked.columns] == device
    assert walked.host == host
    assert max(host) == 20  # both copies parked at once


def test_a_value_offloaded_twice_runs_as_predicted(gpt):
    model, inputs, problem = gpt
    plan = forced(problem, store_all_plan(problem), 1)
    i = next(i for i, (kind, _) in enumerate(plan.program) if kind == PREFETCH)
    v = plan.program[i][1]
    program = plan.program[: i + 1] + [(OFFLOAD, v), (PREFETCH, v)] + plan.program[i + 1 :]
    start = plan.backward_start + 2 * (i < plan.backward_start)
    twice = Plan(program, start, "twice", 0, problem)
    sim = check_program(twice, problem)
    assert len(sim.transfers) == 4
    _, _, eager_grads = measured_step(model, inputs, seed=4)
    run = core.apply_plan(model, twice)
    peak, _, grads = measured_step(model, inputs, seed=4, run=run)
    assert_same_grads(grads, eager_grads)
    assert peak == twice.predicted_peak + SEED_BYTES
    assert run.host_peak == twice.predicted_host_bytes == sim.host_peak


@pytest.mark.slow
def test_a_solved_vit_plan_offloads_and_runs_as_predicted():
    model, inputs = fresh("vit-tiny")
    problem = core.analyze(model, inputs)
    plan = core.solve(problem, 0.75, "offload")
    assert plan.predicted_host_bytes > 0
    assert plan.predicted_time <= core.solve(problem, 0.75, "rockmate").predicted_time
    _, _, eager_grads = measured_step(model, inputs, seed=6)
    run = core.apply_plan(model, plan)
    peak, _, grads = measured_step(model, inputs, seed=6, run=run)
    assert_same_grads(grads, eager_grads)
    assert peak == plan.predicted_peak + SEED_BYTES
    assert run.host_peak == plan.predicted_host_bytes


@pytest.mark.parametrize(
    "name, device", [("gpt-tiny", "cpu"), pytest.param("gpt-tiny", "h100", marks=pytest.mark.slow)]
)
def test_the_greedy_pass_figures_every_try_as_the_walk_does(name, device, monkeypatch):
    """The greedy pass ranks its tries by `TransferProbe`'s figures, not by walking them: on
    every program it evaluates (below its floor, so every base budget tries every candidate),
    the probe's peak and time are walk_step's exactly, stalls and queued copies included."""
    model, inputs = fresh(name)
    problem = core.analyze(model, inputs, device=device)
    programs: dict[int, tuple[list, int]] = {}  # id(probe) -> the program it figures
    probes: list[TransferProbe] = []  # alive, so ids stay theirs
    made, inserted = TransferProbe.__init__, TransferProbe.inserted
    walks = []

    def init(self, graph, program, start, link):
        made(self, graph, program, start, link)
        programs[id(self)] = list(program), start
        probes.append(self)

    def insert(self, v, last, at, reader):
        out = inserted(self, v, last, at, reader)
        programs[id(out)] = offload_solver._inserted(*programs[id(self)], v, last, at)
        probes.append(out)
        walked = walk_step(problem.graph, *programs[id(out)], problem.link)
        assert out._figures() == (walked.peak, walked.time)
        walks.append(walked)
        return out

    monkeypatch.setattr(TransferProbe, "__init__", init)
    monkeypatch.setattr(TransferProbe, "inserted", insert)
    with pytest.raises(InfeasibleBudget):
        core.solve(problem, 0.2, "offload")
    assert len(walks) > 200
    assert any(w.stall > 0 for w in walks)  # runs waited for prefetches
    assert any(len(w.transfers) > 20 for w in walks)


@pytest.fixture(scope="module")
def gpt_h100(analysed):
    return analysed("gpt-tiny", "h100")[2]


@pytest.mark.parametrize("seed", range(10))
def test_the_transfer_probe_agrees_with_the_walk_on_random_transfers(gpt_h100, seed):
    """Random kept activations of gpt-tiny's store-all program (h100 preset: copies queue and
    stall), each offloaded at a random step after its last forward use and prefetched at a
    random step up to its first backward reader, one after another: after each, the probe's
    peak and time are walk_step's exactly."""
    import random

    rnd = random.Random(seed)
    problem = gpt_h100
    graph = problem.graph
    program, start = store_all_plan(problem).program, store_all_plan(problem).backward_start
    probe = TransferProbe(graph, program, start, problem.link)
    kept = walk_step(graph, program, start, problem.link).kept
    values = sorted(v for v in kept if graph.values[v].kind == "activation")
    for v in rnd.sample(values, min(12, len(values))):
        place = offload_solver._placement(problem, program, start, v)
        if place is None:
            continue
        last, reader = place
        off = rnd.randint(last, start - 1)
        at = rnd.randint(off + 1, reader)
        figures = probe.figures(v, off, at, reader)
        probe = probe.inserted(v, off, at, reader)
        program, start = offload_solver._inserted(program, start, v, off, at)
        walked = walk_step(graph, program, start, problem.link)
        assert figures == (walked.peak, walked.time)
