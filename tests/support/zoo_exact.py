"""Zoo steps held to eager's bit for bit: the reference step and the check a plan must pass."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from helpers import SEED_BYTES, zoo_step

import core
from core.runtime.module import PlannedModule
from sample_models.hf_zoo import ZooCase


def _step(case: ZooCase, run=None, seed: int = 3) -> tuple[int, torch.Tensor, dict]:
    """One training step from zero grads under a storage tracker: peak, loss, grads."""
    peak, _, loss, grads = zoo_step(case, run, seed)
    return peak, loss, grads


@dataclass
class Eager:
    """What one eager step from the starting state gives: the reference a plan must equal."""

    loss: torch.Tensor
    grads: dict[str, torch.Tensor]
    state: dict[str, torch.Tensor]  # parameters and buffers after the step
    rng: torch.Tensor  # the random stream after the step


def eager(case: ZooCase, start: dict) -> Eager:
    case.model.load_state_dict(start)
    _, loss, grads = _step(case)
    state = {k: v.clone() for k, v in case.model.state_dict().items()}
    return Eager(loss, grads, state, torch.get_rng_state())


def run_exactly(
    case: ZooCase, start: dict, plan: core.Plan, eager: Eager, steps: int = 1, **apply
) -> PlannedModule:
    """Run `plan` (apply_plan's keywords: `apply`) for `steps` steps of one planned module,
    each from the starting state, and hold each to eager's step bit for bit and to its
    predicted peak; returns the planned module (its `host_peak`: the last step's, measured;
    its `plan`: the plan bound to the model)."""
    run = core.apply_plan(case.model, plan, **apply)
    for _ in range(steps):
        case.model.load_state_dict(start)
        peak, loss, grads = _step(case, run)
        assert torch.equal(loss, eager.loss), plan.method
        assert grads.keys() == eager.grads.keys()
        for key, want in eager.grads.items():  # bit-identical: the same ops in the same order
            assert torch.equal(grads[key], want), (plan.method, key)
        for key, value in case.model.state_dict().items():
            assert torch.equal(value, eager.state[key]), key
        assert torch.equal(torch.get_rng_state(), eager.rng)
        assert peak == plan.predicted_peak + SEED_BYTES, plan.method
    return run
