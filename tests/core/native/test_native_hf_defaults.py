"""Hugging Face GPT-2, Llama and Qwen2 at their defaults (SDPA attention, default dropout,
no padding: `sample_models.hf_zoo.DEFAULTS`), natively and interpreted: loss and gradients
equal eager's bit for bit, measured peak = predicted + 4 B (the seed of backward).

Unpadded, transformers builds no mask and SDPA runs its causal path; under fake tensors it
built one (`is_tracing`), so native plans were refused at the first attention op
(`core.trace.eager_branches`, docs/native.md)."""

from __future__ import annotations

import pytest
import torch
from helpers import SEED_BYTES
from native_cases import plans as _plans
from native_cases import step as _step
from zoo_exact import eager as _eager
from zoo_exact import run_exactly as _run_exactly

import core
from core.errors import PlanMismatch
from core.native.lowering import lower
from core.native.runtime import native_handle
from sample_models.hf_zoo import DEFAULTS

pytestmark = pytest.mark.usefixtures("one_thread")  # bit-identical on 1 thread
NAMES = [n if not n.endswith("-64") else pytest.param(n, marks=pytest.mark.slow) for n in DEFAULTS]


def _call(name: str):
    c = DEFAULTS[name]()
    c.kwargs = {**c.kwargs, "use_cache": False}  # HF's own checkpointing requires it too
    return c


def _plans_with_native(problem: core.Problem) -> dict[str, core.Plan]:
    """The plans every model is held to, and the native method's at 70% (or its least)."""
    out = _plans(problem)
    try:
        out["native"] = core.solve(problem, 0.7, method="native")
    except core.InfeasibleBudget as e:
        out["native"] = core.solve(problem, e.minimum, method="native")
    return out


@pytest.mark.slow
@pytest.mark.parametrize("name", DEFAULTS)
def test_default_attention_native_is_exact(name):
    c = _call(name)
    model, args, kwargs, loss_fn, targets = c.model, c.args, c.kwargs, c.loss_fn, c.targets
    assert model.config._attn_implementation == "sdpa"
    state = {k: v.clone() for k, v in model.state_dict().items()}
    problem = core.analyze(model, args, kwargs, loss_fn, targets)
    _, eager_loss, eager_grads = _step(model, model, args, kwargs, loss_fn, targets)
    recomputing = 0
    for label, plan in _plans_with_native(problem).items():
        model.load_state_dict(state)
        predicted = lower(plan).prediction
        run = core.apply_plan(model, plan, loss_fn=loss_fn, runtime="native")
        handle = native_handle(run)
        recomputing += handle.lowering.recomputed_ops > 0
        peak, loss, grads = _step(model, run, args, kwargs, loss_fn, targets)
        handle.remove()
        print(f"{name} {label}: native predicted {predicted.peak} measured {peak}")
        assert torch.equal(loss, eager_loss), label
        assert grads.keys() == eager_grads.keys()
        for n in eager_grads:
            assert torch.equal(grads[n], eager_grads[n]), f"{label}: {n}"
        assert peak == predicted.peak + SEED_BYTES, label
    assert recomputing >= 3  # checkpointed layers, not all kept whole


@pytest.mark.parametrize("name", NAMES)
def test_default_attention_interpreted_is_exact(name):
    c = _call(name)
    problem = core.analyze(c.model, c.args, c.kwargs, c.loss_fn, c.targets)
    start = {k: v.clone() for k, v in c.model.state_dict().items()}
    eager = _eager(c, start)
    for plan in _plans(problem).values():
        _run_exactly(c, start, plan, eager)


@pytest.mark.slow
def test_default_attention_still_refuses_a_changed_model():
    """The same model in eval mode (no dropout), or with another dropout p, runs other ops
    than traced: refused by name, at the layer and op where they part."""
    c = _call("hf-gpt2-default")
    problem = core.analyze(c.model, c.args, c.kwargs, c.loss_fn, c.targets)
    plan = core.solve(problem, 1.0, method="checkpoint_blocks")
    run = core.apply_plan(c.model, plan, loss_fn=c.loss_fn, runtime="native")
    c.model.eval()
    # the first dropout: the root's (a stretch around transformer.drop, whose moments the
    # boundary probe places since 2026-11-28), else layer 0's
    parted = (
        r"transformer\.drop \(pre, call 0\) \.\. transformer\.drop \(post, call 0\): the "
        r"block ran 0 ops, the trace has 4|transformer\.h\.0: op \d+ of the block runs"
    )
    with pytest.raises(PlanMismatch, match=parted):
        run(*c.args, **c.kwargs, targets=c.targets).backward()
    c.model.train()
    c.model.transformer.h[0].attn.attn_dropout.p = 0.2  # the same ops, other numbers
    with pytest.raises(PlanMismatch, match=r"transformer\.h\.0\.attn\.attn_dropout\.p is 0\.2"):
        run(*c.args, **c.kwargs, targets=c.targets).backward()
    native_handle(run).remove()
