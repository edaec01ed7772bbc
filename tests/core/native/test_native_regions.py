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
from core.native.lowering import lower
from core.native.runtime import native_handle


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


def _native_at(fraction: float):  # noqa: ANN202
    def plan_of(problem: core.Problem) -> core.Plan:
        plan = core.solve(problem, fraction, method="native")
        assert lower(plan).prediction.peak <= fraction * problem.store_all_peak
        return plan

    return plan_of


@pytest.mark.slow
def test_mixer_blocks_called_from_the_root_are_checkpointed():
    """mixer-tiny's blocks are ModuleDicts the root runs: no submodule is a block. Before
    stretches its native plans peaked at eager's; its native minimum is now 35.2% of
    store-all (docs/native.md), and half of store-all is met exactly."""
    _run_exact("mixer-tiny", _native_at(0.5))


@pytest.mark.slow
def test_mixer_at_forty_percent_is_exact():
    """The native plan at 40% of store-all: an earlier cut of it (six stretches) measured
    4,100 B above its prediction (docs/native.md); the cut chosen now is exact."""
    _run_exact("mixer-tiny", _native_at(0.4))


@pytest.mark.slow
def test_unet_skips_are_checkpointed():
    """unet-tiny: the skips cross every cut, so its one big block runs as stretches (with
    batch norm in the stem: the replay writes its statistics into scratch). Before, every
    native plan peaked at eager's 563,140 B; its native minimum is now 73.2% of store-all."""
    _run_exact("unet-tiny", _native_at(0.8))


@pytest.mark.slow
def test_layers_cut_into_stretches_run_exactly():
    """gpt-tiny at 40% of store-all: below what one checkpointed submodule per layer
    reaches natively (55.6%), so the native method cuts its layers into stretches."""
    _, plan = _run_exact("gpt-tiny", _native_at(0.4))
    assert not lower(plan).regions
    # a plan of another method keeps its layers whole (torch.compile and FSDP2 see them)
    assert lower(plan.replace(method="rockmate")).regions


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


@pytest.mark.parametrize(
    ("name", "ratio"),
    [
        # before the search of cuts: 1.50x (85.8% of store-all against 57.4%); before
        # nested stretches and loose moments: 1.25x
        ("mlp-batch", 1.07),
        # before: 1.45x (87.5% against 60.2%); before the second search: 1.21x
        ("regnet-tiny", 1.2),
        # before: 1.15x predicted (68.5% against 59.5%); the skips cross every cut
        pytest.param("unet-tiny", 1.085, marks=pytest.mark.slow),
        # before: 1.37x; its least measured 18,564 B above the prediction until a replayed
        # stretch stopped holding a saved op's outputs (and the recompute's graph) once
        # they were handed back
        pytest.param("hf-bert", 1.046, marks=pytest.mark.slow),
    ],
)
def test_native_least_against_the_interpreters(name: str, ratio: float):
    """The native method's least peak, with its cuts and nested stretches searched by the
    native simulation (`core.native.lowering._searched_cuts`), run natively: measured =
    predicted + 4 B, gradients equal to eager's, and within `ratio` of the interpreter's
    least (Rockmate's minimum): mlp-batch 1,119,788 B against 1,055,788 B (1.061x; a
    stretch nested in the first one), regnet-tiny 190,636 B against 159,020 B (1.199x),
    unet-tiny 357,456 B against 330,448 B (1.082x), hf-bert 130,692 B against 125,060 B
    (1.045x). What is left is checkpoint's own: a stretch's recompute holds all it made
    until its nodes run (docs/native.md)."""

    def least(problem: core.Problem, method: str) -> int:
        with pytest.raises(core.InfeasibleBudget) as refused:
            core.solve(problem, 1, method=method)
        return refused.value.minimum

    reached: dict[str, int] = {}

    def plan_of(problem: core.Problem) -> core.Plan:
        reached["interpreted"] = least(problem, "rockmate")
        reached["native"] = least(problem, "native")
        return core.solve(problem, reached["native"], method="native")

    _, plan = _run_exact(name, plan_of)
    assert lower(plan).prediction.peak == reached["native"]
    assert reached["native"] <= ratio * reached["interpreted"]
