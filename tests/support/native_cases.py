"""Cases the native tests share: a model's call, one measured step, the plans every model is
held to."""

from __future__ import annotations

import torch

import core
from core.memory import StorageTracker, step_tensors
from core.schedule import store_all_plan
from sample_models import build


def case(name: str):
    """(model, args, kwargs, loss_fn, targets); HF models without a KV cache, as HF's own
    gradient checkpointing requires (a recompute would append to the cache again)."""
    if name.startswith("hf-"):
        from sample_models import hf_zoo

        c = {**hf_zoo.ZOO, **hf_zoo.DEFAULTS}[name]()
        return c.model, c.args, {**c.kwargs, "use_cache": False}, c.loss_fn, c.targets
    model, inputs = build(name)
    return model, inputs, {}, None, ()


def step(model, run, args, kwargs, loss_fn, targets):
    """One step from zero grads, seed 3, under a storage tracker: (peak, loss, grads)."""
    model.zero_grad(set_to_none=True)
    torch.manual_seed(3)
    tensors = [v for v in kwargs.values() if isinstance(v, torch.Tensor)]
    with StorageTracker(step_tensors(model, (*args, *tensors, *targets))) as tracker:
        if loss_fn is None:
            loss = run(*args, **kwargs)
        elif run is model:
            loss = loss_fn(model(*args, **kwargs), *targets)
        else:
            loss = run(*args, **kwargs, targets=targets)
        loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return tracker.peak, loss.detach(), grads


def plans(problem):
    """store-all, checkpoint_blocks, rockmate at 50% (or its minimum when above) and at its
    minimum."""
    try:
        core.solve(problem, 1, method="rockmate")
        raise AssertionError("a 1-byte budget fits")
    except core.InfeasibleBudget as e:
        least = e.minimum
    half = max(problem.store_all_peak // 2, least)
    return {
        "store_all": store_all_plan(problem),
        "checkpoint_blocks": core.solve(problem, 1.0, method="checkpoint_blocks"),
        "rockmate_50": core.solve(problem, half, method="rockmate"),
        "rockmate_min": core.solve(problem, least, method="rockmate"),
    }
