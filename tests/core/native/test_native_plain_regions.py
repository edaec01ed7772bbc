"""A region that saves nothing runs as plain checkpoint once its ops matched the trace:
selective checkpoint's dispatch mode costs Python per op, most of a millisecond step (on the
H200 native plans ran 3.1-3.6x eager). The same call again (autocast state, tensor arguments)
skips the policy; another call is matched op by op again, and refused when its ops differ."""

from __future__ import annotations

import pytest
import torch
from helpers import SEED_BYTES
from native_cases import case, plans, step

import core
import core.native.runtime as runtime
from core.native.lowering import lower

pytestmark = pytest.mark.usefixtures("one_thread")


def test_a_region_saving_nothing_skips_the_policy_once_matched(monkeypatch) -> None:
    model, args, kwargs, loss_fn, targets = case("gpt-tiny")
    problem = core.analyze(model, args, kwargs, loss_fn, targets)
    _, eager_loss, eager_grads = step(model, model, args, kwargs, loss_fn, targets)
    plan = plans(problem)["rockmate_min"]
    regions = lower(plan).regions
    plain = sum(not any(r.save) for r in regions)
    assert plain >= 2  # gpt-tiny's least Rockmate plan: its layers save nothing
    made = []
    real = runtime.create_selective_checkpoint_contexts
    monkeypatch.setattr(
        runtime,
        "create_selective_checkpoint_contexts",
        lambda *a, **kw: made.append(1) or real(*a, **kw),
    )
    run = core.apply_plan(model, plan, loss_fn=loss_fn, runtime="native")
    for k in range(3):
        made.clear()
        peak, loss, grads = step(model, run, args, kwargs, loss_fn, targets)
        assert len(made) == (len(regions) if k == 0 else len(regions) - plain)
        assert peak == lower(plan).prediction.peak + SEED_BYTES
        assert torch.equal(loss, eager_loss)
        assert all(torch.equal(grads[n], eager_grads[n]) for n in eager_grads)
    with torch.autocast("cpu", torch.bfloat16), pytest.raises(core.PlanMismatch):
        step(model, run, args, kwargs, loss_fn, targets)
