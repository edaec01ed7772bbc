"""A native plan (`apply_plan(..., runtime="native")`) composed with what users run: inductor
(no graph break, gradients bit-equal to compiled eager's), bf16 autocast (bit-equal to eager
autocast), and Hugging Face models, whose key/value cache a recompute would update twice
(refused by name: call with use_cache=False)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
from torch import nn

import core
from core.errors import PlanMismatch
from core.native.kv_cache import kv_cache_guard
from core.native.runtime import native_handle
from sample_models import build, hf_zoo

BF16 = ("cpu", torch.bfloat16)


@pytest.fixture(autouse=True)
def _one_thread() -> Iterator[None]:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _half_plan(problem: core.Problem) -> core.Plan:
    """Rockmate at half the store-all peak, or at its minimum when that is above."""
    try:
        return core.solve(problem, problem.store_all_peak // 2, method="rockmate")
    except core.InfeasibleBudget as e:
        return core.solve(problem, e.minimum, method="rockmate")


def _grads(model: nn.Module, step) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """(loss, grads) of one step from zero grads and seed 3."""
    model.zero_grad(set_to_none=True)
    torch.manual_seed(3)
    loss = step()
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


def _assert_equal(got, want) -> None:
    assert torch.equal(got[0], want[0])
    assert got[1].keys() == want[1].keys()
    for name in want[1]:
        assert torch.equal(got[1][name], want[1][name]), name


# ---------------------------------------------------------------------------------------------
# inductor


@pytest.mark.slow  # two inductor compiles of forward and backward (~30 s on one core)
def test_native_plan_under_inductor_has_no_graph_break_and_exact_gradients():
    """The native-planned gpt-tiny is one graph under dynamo; compiled with inductor its
    gradients are bit-equal to compiled eager's (inductor's fused reductions round otherwise
    than eager's kernels: against plain eager they are close, not equal)."""
    import torch._dynamo as dynamo
    import torch._inductor.config as inductor_config

    model, inputs = build("gpt-tiny")
    state = {k: v.clone() for k, v in model.state_dict().items()}
    plan = _half_plan(core.analyze(model, inputs))
    with inductor_config.patch(fallback_random=True):  # inductor draws dropout as eager does
        eager = _grads(model, lambda: model(*inputs))
        dynamo.reset()
        compiled_eager = torch.compile(model, backend="inductor")
        model.load_state_dict(state)
        reference = _grads(model, lambda: compiled_eager(*inputs))
        dynamo.reset()
        model.load_state_dict(state)
        run = core.apply_plan(model, plan, runtime="native")
        assert native_handle(model).lowering.regions
        explained = dynamo.explain(run)(*inputs)
        assert explained.graph_break_count == 0 and explained.graph_count == 1
        dynamo.reset()
        compiled = torch.compile(run, backend="inductor")
        model.load_state_dict(state)
        got = _grads(model, lambda: compiled(*inputs))
        dynamo.reset()
    _assert_equal(got, reference)
    for name, want in eager[1].items():
        torch.testing.assert_close(got[1][name], want)


# ---------------------------------------------------------------------------------------------
# autocast


def _case(name: str) -> hf_zoo.ZooCase:
    if name.startswith("hf-"):
        c = hf_zoo.ZOO[name]()
        return hf_zoo.ZooCase(
            c.model, c.args, {**c.kwargs, "use_cache": False}, c.loss_fn, c.targets, c.layers
        )
    model, inputs = build(name)
    return hf_zoo.ZooCase(model, inputs, {}, None, (), 2)  # type: ignore[arg-type]


def _call(case: hf_zoo.ZooCase, run: nn.Module) -> torch.Tensor:
    if case.loss_fn is None:
        return run(*case.args, **case.kwargs)
    if run is case.model:
        return case.loss_fn(run(*case.args, **case.kwargs), *case.targets)
    return run(*case.args, **case.kwargs, targets=case.targets)


@pytest.mark.parametrize("name", ["gpt-tiny", "hf-llama"])
def test_native_plan_under_bf16_autocast_equals_eager_autocast(name):
    """Analysed under bf16 autocast, applied natively, run under it: loss and every gradient
    bit-equal to eager autocast's (autocast's casts are ops of the traced layers; the policy
    sees them in the same order)."""
    case = _case(name)
    state = {k: v.clone() for k, v in case.model.state_dict().items()}
    with torch.autocast(*BF16):
        problem = core.analyze(case.model, case.args, case.kwargs, case.loss_fn, case.targets)
    plans = [core.solve(problem, 1.0, method="checkpoint_blocks"), _half_plan(problem)]

    def under_autocast(run):
        with torch.autocast(*BF16):
            return _call(case, run)

    eager = _grads(case.model, lambda: under_autocast(case.model))
    assert eager[0].dtype == torch.float32
    for plan in plans:
        case.model.load_state_dict(state)
        run = core.apply_plan(case.model, plan, loss_fn=case.loss_fn, runtime="native")
        assert native_handle(run).lowering.regions
        _assert_equal(_grads(case.model, lambda run=run: under_autocast(run)), eager)
        native_handle(run).remove()


def test_native_fp32_plan_under_autocast_is_refused():
    """A plan analysed without autocast, run under it: the layers run autocast's casts the
    trace lacks, refused by name rather than run other than planned."""
    model, inputs = build("gpt-tiny")
    plan = core.solve(core.analyze(model, inputs), 1.0, method="checkpoint_blocks")
    core.apply_plan(model, plan, runtime="native")
    with torch.autocast(*BF16), pytest.raises(PlanMismatch, match="autocast"):
        model(*inputs)


# ---------------------------------------------------------------------------------------------
# Hugging Face's key/value cache


@pytest.mark.parametrize("name", ["hf-gpt2", "hf-llama"])  # cache by position, by keyword
def test_native_refuses_a_kv_cache_and_runs_without(name):
    """config.use_cache is on by default: a native plan's layer called with the cache is
    refused, naming use_cache=False, before its recompute would append to the cache twice
    (without the check: a shape error in the backward). Analysed and called with
    use_cache=False, gradients equal eager's; without gradients (generation), the cache
    passes."""
    c = hf_zoo.ZOO[name]()
    state = {k: v.clone() for k, v in c.model.state_dict().items()}
    assert c.model.config.use_cache
    problem = core.analyze(c.model, c.args, c.kwargs, c.loss_fn, c.targets)
    with_cache = core.solve(problem, 1.0, method="checkpoint_blocks")
    run = core.apply_plan(c.model, with_cache, loss_fn=c.loss_fn, runtime="native")
    assert native_handle(run).lowering.regions
    with pytest.raises(PlanMismatch, match=r"key/value cache .*use_cache=False"):
        run(*c.args, **c.kwargs, targets=c.targets)
    with torch.no_grad():
        run(*c.args, **c.kwargs, targets=c.targets)
    native_handle(run).remove()

    kwargs = {**c.kwargs, "use_cache": False}
    c.model.load_state_dict(state)
    eager = _grads(c.model, lambda: c.loss_fn(c.model(*c.args, **kwargs), *c.targets))
    problem = core.analyze(c.model, c.args, kwargs, c.loss_fn, c.targets)
    plan = core.solve(problem, 1.0, method="checkpoint_blocks")
    run = core.apply_plan(c.model, plan, loss_fn=c.loss_fn, runtime="native")
    c.model.load_state_dict(state)
    _assert_equal(_grads(c.model, lambda: run(*c.args, **kwargs, targets=c.targets)), eager)


class _Layer(nn.Module):
    def forward(self, x, cache=None, *, past_key_values=None):
        return x


def test_kv_cache_guard_reads_positions_keywords_and_readers():
    layer = _Layer()
    guard = kv_cache_guard("layer", layer.forward)
    x, cache = torch.ones(1), object()
    guard((x,), {})
    guard((x, None), {"past_key_values": None})
    with pytest.raises(PlanMismatch, match="`cache`"):
        guard((x, cache), {})
    with pytest.raises(PlanMismatch, match="`past_key_values`"):
        guard((x,), {"past_key_values": cache})
    layer._can_checkpoint_with_cache = True  # HF: a layer that only reads the cache
    kv_cache_guard("layer", layer.forward)((x, cache), {})
