"""Regions that are no submodule (`core.native.stretch`, `core.native.replay`): stretches of
a parent's forward run under checkpoint with a replayed recompute. Held to the native
rules: measured peak = the native prediction + the 4-byte seed of loss.backward(), loss,
gradients and buffers `torch.equal` to eager's."""

from __future__ import annotations

import pytest
import torch
from helpers import SEED_BYTES
from native_cases import case as _case
from native_cases import step as _step

import core
from core.errors import PlanMismatch
from core.lowering import lower
from core.runtime.native import native_handle


def _least(problem: core.Problem, method: str) -> int:
    with pytest.raises(core.InfeasibleBudget) as refused:
        core.solve(problem, 1, method=method)
    return refused.value.minimum


def _run_exact(name: str, plan_of) -> tuple[core.Problem, core.Plan]:  # noqa: ANN001
    """Plan `name` with `plan_of(problem)`, run it natively once from eager's state and seed,
    and hold it to eager and to its prediction; returns the problem and the plan."""
    model, args, kwargs, loss_fn, targets = _case(name)
    start = {k: v.clone() for k, v in model.state_dict().items()}
    problem = core.analyze(model, args, kwargs, loss_fn, targets)
    model.load_state_dict(start)
    _, eager_loss, eager_grads = _step(model, model, args, kwargs, loss_fn, targets)
    eager_state = {k: v.clone() for k, v in model.state_dict().items()}
    plan = plan_of(problem)
    predicted = lower(plan).prediction
    model.load_state_dict(start)
    run = core.apply_plan(model, plan, loss_fn=loss_fn, runtime="native")
    handle = native_handle(run)
    assert handle is not None and handle.lowering.stretches
    peak, loss, grads = _step(model, run, args, kwargs, loss_fn, targets)
    assert peak == predicted.peak + SEED_BYTES
    assert torch.equal(loss, eager_loss)
    assert grads.keys() == eager_grads.keys()
    for n, g in eager_grads.items():
        assert torch.equal(grads[n], g), n
    for k, v in model.state_dict().items():  # batch norm's statistics updated once
        assert torch.equal(v, eager_state[k]), k
    handle.remove()
    assert "forward" not in vars(model)
    return problem, plan


@pytest.mark.slow
def test_mixer_blocks_called_from_the_root_are_checkpointed():
    """mixer-tiny's blocks are ModuleDicts the root runs: no submodule is a block. Before
    stretches its native plans peaked at eager's; the native method's least peak is now
    35.2% of store-all (the interpreter's: 27.5%)."""

    def least(problem: core.Problem) -> core.Plan:
        return core.solve(problem, _least(problem, "native"), method="native")

    problem, plan = _run_exact("mixer-tiny", least)
    assert plan.predicted_peak and lower(plan).prediction.peak < 0.36 * problem.store_all_peak


@pytest.mark.slow
def test_unet_skips_are_checkpointed():
    """unet-tiny: the skips cross every cut, so its one big block runs as stretches (with
    batch norm in the stem: the replay writes its statistics into scratch). Before, every
    native plan peaked at eager's 563,140 B; now 73% of store-all."""

    def least(problem: core.Problem) -> core.Plan:
        return core.solve(problem, _least(problem, "native"), method="native")

    problem, plan = _run_exact("unet-tiny", least)
    assert lower(plan).prediction.peak < 0.75 * problem.store_all_peak


@pytest.mark.slow
def test_layers_cut_into_stretches_run_exactly():
    """gpt-tiny's native minimum cuts its layers finer than a layer (37.0% of store-all;
    one checkpointed submodule per layer: 55.6%)."""

    def least(problem: core.Problem) -> core.Plan:
        return core.solve(problem, _least(problem, "native"), method="native")

    problem, plan = _run_exact("gpt-tiny", least)
    low = lower(plan)
    assert not low.regions and low.prediction.peak < 0.38 * problem.store_all_peak
    # the plan of another method keeps its layers whole (torch.compile and FSDP2 see them)
    rockmate = lower(plan.replace(method="rockmate"))
    assert rockmate.regions


def test_a_stretch_refuses_a_changed_model_and_leaves_no_grad_alone():
    """A stretch checks its ops as a layer does: after `eval()` (dropout off) the step is
    refused, naming the stretch. Without autograd (inference) nothing is opened."""
    model, args, kwargs, loss_fn, targets = _case("mixer-tiny")
    problem = core.analyze(model, args, kwargs, loss_fn, targets)
    plan = core.solve(problem, 0.5, method="rockmate")
    torch.manual_seed(0)
    with torch.no_grad():
        want = model(*args)
    core.apply_plan(model, plan, runtime="native")
    assert native_handle(model).lowering.stretches
    torch.manual_seed(0)
    with torch.no_grad():
        assert torch.equal(model(*args), want)
    model.eval()
    with pytest.raises(
        PlanMismatch, match=r"blocks\.0\.norm1 \(pre, call 0\) \.\. .*: op \d+ of the block runs"
    ):
        model(*args).backward()
    native_handle(model).remove()
    assert not any(m._forward_pre_hooks or m._forward_hooks for m in model.modules())
