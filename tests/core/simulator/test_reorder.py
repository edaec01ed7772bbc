"""Reordering (core.reorder): valid programs, same runs, never a higher peak; exact at runtime."""

import itertools
from collections import Counter

import pytest
import torch
from helpers import fresh, measured_step, recompute_plan, step_graphs
from hypothesis import given, settings
from hypothesis import strategies as st

import core
from core.errors import InfeasibleBudget, InvalidPlan
from core.problem import Problem
from core.reorder import dependencies, reorder, reordered_runs, run_list
from core.schedule import plan_from_runs, store_all_plan


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
        # its minimum: reordering saves 8%
        pytest.param("regnet-tiny", "rockmate", None, marks=pytest.mark.slow),
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
