"""Reordering (core.reorder): valid programs, same runs, never a higher peak; exact at runtime."""

import itertools
from collections import Counter

import pytest
import torch
from helpers import fresh, measured_step
from hypothesis import given, settings
from hypothesis import strategies as st

import core
from core.errors import InfeasibleBudget, InvalidPlan
from core.graph import Graph, Op, Value
from core.problem import Problem
from core.reorder import dependencies, reorder, reordered_runs, run_list
from core.schedule import plan_from_runs, store_all_plan
from core.simulator import simulate, store_all_program

# ---- random step graphs -------------------------------------------------------------------


@st.composite
def step_graphs(draw, max_forward: int = 6, max_backward: int = 7) -> Problem:
    """A random forward DAG over activations (some ops random, one maybe a state update) and a
    backward DAG reading them, the tangent and each other, ending in parameter gradients."""
    values = [
        Value(0, "w", 4, "param"),
        Value(1, "x", 4, "input"),
        Value(2, "dy", 1, "tangent"),
        Value(3, "stat", 4, "state"),
    ]
    ops: list[Op] = []

    def add_op(phase: str, reads: list[int], kinds: list[str], **flags) -> None:
        outs = []
        for kind in kinds:
            outs.append(len(values))
            values.append(Value(len(values), f"v{len(values)}", draw(st.integers(0, 9)), kind))
        ops.append(
            Op(
                len(ops),
                f"op{len(ops)}",
                "aten.x",
                (),
                tuple(sorted(set(reads))),
                tuple(outs),
                phase,
                **flags,
            )
        )

    n_fwd = draw(st.integers(1, max_forward))
    for i in range(n_fwd):
        pool = [0, 1] + [v.index for v in values if v.kind == "activation"]
        reads = draw(st.lists(st.sampled_from(pool), min_size=1, max_size=3))
        state = i == 0 and draw(st.booleans())
        add_op(
            "forward",
            reads + ([3] if state else []),
            ["activation"] * (1 if i == n_fwd - 1 else draw(st.integers(1, 2))),
            random=not state and draw(st.booleans()),
            state_update=state,
        )
    output = len(values) - 1  # the last forward op's one value is the model output
    n_bwd = draw(st.integers(1, max_backward))
    for _ in range(n_bwd):
        pool = [2] + [v.index for v in values if v.kind in ("activation", "temporary")]
        reads = draw(st.lists(st.sampled_from(pool), min_size=1, max_size=3))
        add_op("backward", reads, [draw(st.sampled_from(["temporary", "gradient"]))])
    values[-1].kind = "gradient"
    for op in ops:
        for v in op.outputs:
            values[v].producer = op.index
        for v in op.inputs:
            values[v].consumers += (op.index,)
    final = {output} | {v.index for v in values if v.kind == "gradient"}
    graph = Graph(None, ops, values, (), (), frozenset(final))
    for op in ops:
        op.time = float(draw(st.integers(1, 3)))
    block_of_op = [0] * len(ops)
    store_all = simulate(graph, block_of_op, *store_all_program(graph))
    total = sum(op.time for op in ops)
    return Problem(graph, [], block_of_op, "synthetic", "synthetic", {}, store_all.peak, total)


def runs_keeping(problem: Problem, keep: set[int]) -> tuple[list[int], int]:
    """Forward once keeping `keep`; each backward op recomputes what it reads just before."""
    graph = problem.graph
    ops, values = graph.ops, graph.values
    runs = list(graph.forward_ops)
    available = set(keep) | set(graph.final_values)
    available |= {v.index for v in values if v.producer is None}

    def ensure(v: int) -> None:
        if v in available:
            return
        producer = ops[values[v].producer]
        for u in producer.inputs:
            ensure(u)
        runs.append(producer.index)
        available.update(producer.outputs)

    for o in graph.backward_ops:
        for v in ops[o].inputs:
            ensure(v)
        runs.append(o)
        available.update(ops[o].outputs)
    return runs, len(graph.forward_ops)


def recompute_plan(problem: Problem, keep_bits: list[bool]):
    """A plan that keeps some forward values and recomputes the rest in the backward."""
    acts = [v.index for v in problem.graph.values if v.kind == "activation"]
    keep = {v for v, k in zip(acts, keep_bits) if k}
    runs, n_forward = runs_keeping(problem, keep)
    return plan_from_runs(problem, runs, n_forward, "test", 0)


def first_sticky_runs(problem: Problem, plan) -> list[int]:
    ops = problem.graph.ops
    seen: list[int] = []
    for o in run_list(plan)[0]:
        if (ops[o].random or ops[o].state_update) and o not in seen:
            seen.append(o)
    return seen


@settings(max_examples=150, deadline=None)
@given(step_graphs(), st.lists(st.booleans(), min_size=12, max_size=12))
def test_reordered_programs_are_valid_keep_runs_and_never_raise_the_peak(problem, keep_bits):
    for plan in (store_all_plan(problem), recompute_plan(problem, keep_bits)):
        new = reorder(plan)
        assert new.predicted_peak <= plan.predicted_peak  # simulated: a valid program
        runs, n_fwd = run_list(plan)
        new_runs, new_fwd = run_list(new)
        assert n_fwd == new_fwd
        assert Counter(runs[:n_fwd]) == Counter(new_runs[:n_fwd])  # nothing crosses the boundary
        assert Counter(runs[n_fwd:]) == Counter(new_runs[n_fwd:])
        assert new.predicted_time == pytest.approx(plan.predicted_time, rel=1e-12)
        assert first_sticky_runs(problem, new) == first_sticky_runs(problem, plan)


def allowed(deps, order: tuple[int, ...]) -> bool:
    where = {p: i for i, p in enumerate(order)}
    return all(where[q] < where[p] for p in order for q in deps.before[p])


@settings(max_examples=60, deadline=None)
@given(step_graphs(max_forward=4, max_backward=4))
def test_dependencies_allow_exactly_the_valid_orders_and_reorder_is_near_brute_force(problem):
    """Every order of each pass, tried: the dependencies allow exactly those the simulator
    accepts (store-all: each op once; no op reads model state), and the reordered peak lies
    between the best of them and the original."""
    plan = store_all_plan(problem)
    runs, n_fwd = run_list(plan)
    deps = dependencies(problem, runs, n_fwd)
    reads_state = any(3 in op.inputs for op in problem.graph.ops)
    best = plan.predicted_peak
    for fwd in itertools.permutations(range(n_fwd)):
        for bwd in itertools.permutations(range(n_fwd, len(runs))):
            order = fwd + bwd
            try:
                trial = plan_from_runs(problem, [runs[p] for p in order], n_fwd, "t", 0)
                peak = trial.predicted_peak
            except InvalidPlan:
                assert not allowed(deps, order)
                continue
            if not reads_state:
                assert allowed(deps, order), order
            if allowed(deps, order):
                best = min(best, peak)
    assert best <= reorder(plan).predicted_peak <= plan.predicted_peak


# ---- real models ----------------------------------------------------------------------------


def _reordered(problem, method: str, budget):
    if budget is None:  # the method's minimum
        with pytest.raises(InfeasibleBudget) as info:
            core.solve(problem, 1, method=method)
        budget = info.value.minimum
    plan = core.solve(problem, budget, method=method)
    new = reorder(plan)
    assert new.predicted_peak < plan.predicted_peak, "the test needs a plan reordering improves"
    return plan, new


@pytest.mark.parametrize(
    ("name", "method", "budget"),
    [
        ("vit-tiny", "store_all", 1.0),
        ("gpt-tiny", "rotor", 0.6),
        ("vit-tiny", "checkpoint_blocks", 1.0),
        ("regnet-tiny", "rockmate", None),  # its minimum: reordering saves 8%
    ],
)
def test_reordered_plans_run_with_eager_gradients_and_the_predicted_peak(name, method, budget):
    model, inputs = fresh(name)
    problem = core.analyze(model, inputs)
    plan, new = _reordered(problem, method, budget)
    assert new.predicted_time == pytest.approx(plan.predicted_time, rel=1e-12)
    start_state = {k: v.clone() for k, v in model.state_dict().items()}
    _, eager_loss, eager_grads = measured_step(model, inputs, seed=5)
    eager_rng = torch.get_rng_state()
    model.load_state_dict(start_state)
    peak, loss, grads = measured_step(model, inputs, seed=5, run=core.apply_plan(model, new))
    assert loss == eager_loss
    assert grads.keys() == eager_grads.keys()
    for key in grads:  # bit-equal, not merely close
        assert torch.equal(grads[key], eager_grads[key]), key
    assert torch.equal(torch.get_rng_state(), eager_rng)
    assert peak == new.predicted_peak + 4  # the scalar seed of loss.backward()


def test_batch_norm_statistics_update_once_under_a_reordered_program():
    """Any order the greedy makes (here: one that differs, whatever its peak) runs exactly."""
    model, inputs = fresh("resnet-tiny")
    problem = core.analyze(model, inputs)
    base = core.solve(problem, 1.0, method="checkpoint_blocks")
    runs, n_forward = run_list(base)
    moved = [r for r in reordered_runs(problem, runs, n_forward) if r != runs]
    assert moved, "the test needs an order that differs from the plan's"
    plan = plan_from_runs(problem, moved[0], n_forward, "reordered", 0)
    start = {k: v.clone() for k, v in model.state_dict().items()}
    _, _, eager_grads = measured_step(model, inputs)
    want = {k: v.clone() for k, v in model.state_dict().items()}
    model.load_state_dict(start)
    peak, _, grads = measured_step(model, inputs, run=core.apply_plan(model, plan))
    for key, value in model.state_dict().items():
        assert torch.equal(value, want[key]), key
    for key in grads:
        assert torch.equal(grads[key], eager_grads[key]), key
    assert peak == plan.predicted_peak + 4


def test_solve_with_reorder_fits_recomputes_no_more_and_reports_its_own_minimum():
    model, inputs = fresh("vit-tiny")
    problem = core.analyze(model, inputs)
    plain = core.solve(problem, 0.82, method="rotor")
    both = core.solve(problem, 0.82, method="rotor", reorder=True)
    assert both.predicted_peak <= int(0.82 * problem.store_all_peak)
    assert both.predicted_time < plain.predicted_time  # it planned for more, recomputes less
    with pytest.raises(InfeasibleBudget) as plain_min:
        core.solve(problem, 1, method="rotor")
    with pytest.raises(InfeasibleBudget) as reordered_min:
        core.solve(problem, 1, method="rotor", reorder=True)
    assert "reordered" in str(reordered_min.value)
    assert reordered_min.value.minimum < plain_min.value.minimum
    at_min = core.solve(problem, reordered_min.value.minimum, method="rotor", reorder=True)
    assert at_min.predicted_peak <= reordered_min.value.minimum
    store_all = core.solve(problem, 1.0, method="store_all", reorder=True)
    assert store_all.predicted_peak < problem.store_all_peak
    assert store_all.recomputed_ops == 0
