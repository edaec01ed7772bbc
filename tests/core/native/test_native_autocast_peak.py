"""Native plans under bf16 autocast (the forward under `torch.autocast`, the backward after
it, as users write it): loss and every gradient equal eager autocast's bit for bit, and the
measured peak is the native simulation's: its forward peak, or its backward peak + the 4 B
seed of backward, whichever is higher.

Autocast caches the bf16 cast of each parameter until the outermost autocast exits (the
forward's end; a checkpoint recompute re-enters autocast and frees its casts as it stops):
the simulation held them only while the graph read them, 59,652 B short on gpt-tiny's
Rockmate plan at 50% (`core.native.simulate.autocast_casts`)."""

from __future__ import annotations

import pytest
import torch
from helpers import SEED_BYTES
from native_cases import case as _case
from native_cases import plans as _plans
from native_cases import step as _step

import core
from core.native.lowering import lower, python_held
from core.native.runtime import native_handle
from core.native.simulate import Checkpointed, native_program

pytestmark = pytest.mark.usefixtures("one_thread")  # bit-identical on 1 thread
BF16 = ("cpu", torch.bfloat16)


def _expected_peak(problem: core.Problem, plan: core.Plan) -> int:
    """What the storage tracker measures: the walk's forward peak, or its backward peak
    with the seed of backward (which the walk does not size)."""
    low, held = lower(plan), python_held(problem)
    regions = [
        Checkpointed(r.forward_nodes, r.cached, held.passed.get(r.module, frozenset()))
        for r in low.regions
    ] + [
        Checkpointed(frozenset(s.nodes), s.cached, frozenset(), dict(s.replay_drops))
        for s in low.stretches
    ]
    assert not low.offloads  # the walk below has no offloads
    walked = native_program(problem.graph, regions, held.dropped, frozenset(), problem.link).walk(
        problem.graph
    )
    assert walked.peak == low.prediction.peak
    return max(walked.forward_peak, walked.backward_peak + SEED_BYTES)


def _autocast_step(model, run, args, kwargs, loss_fn, targets):  # noqa: ANN001, ANN202
    """`native_cases.step` with the forward under bf16 autocast and the backward after."""

    class Forward(torch.nn.Module):
        def forward(self, *a, **kw):  # noqa: ANN001, ANN202
            with torch.autocast(*BF16):
                if loss_fn is None:
                    return run(*a, **kw)
                if run is model:
                    return loss_fn(model(*a, **kw), *targets)
                return run(*a, **kw, targets=targets)

    return _step(model, Forward(), args, kwargs, None, ())


def _check(name: str) -> core.Problem:
    model, args, kwargs, loss_fn, targets = _case(name)
    return _check_case(name, model, args, kwargs, loss_fn, targets)


def _check_case(name, model, args, kwargs, loss_fn, targets):  # noqa: ANN001, ANN201
    state = {k: v.clone() for k, v in model.state_dict().items()}
    with torch.autocast(*BF16):
        problem = core.analyze(model, args, kwargs, loss_fn, targets)
    _, eager_loss, eager_grads = _autocast_step(model, model, args, kwargs, loss_fn, targets)
    plans = _plans(problem)
    plans["native"] = core.solve(problem, 0.7, method="native")
    for label, plan in plans.items():
        model.load_state_dict(state)
        want = _expected_peak(problem, plan)
        run = core.apply_plan(model, plan, loss_fn=loss_fn, runtime="native")
        peak, loss, grads = _autocast_step(model, run, args, kwargs, loss_fn, targets)
        handle = native_handle(run)
        assert handle is not None
        handle.remove()
        print(f"{name} {label}: native predicted {lower(plan).prediction.peak} measured {peak}")
        assert torch.equal(loss, eager_loss), label
        for n in eager_grads:
            assert torch.equal(grads[n], eager_grads[n]), f"{label}: {n}"
        assert peak == want, label
    return problem


def test_native_autocast_peak_is_predicted_gpt_tiny():
    _check("gpt-tiny")


@pytest.mark.slow
@pytest.mark.parametrize("name", ["hf-gpt2-default", "hf-llama-default"])
def test_native_autocast_peak_is_predicted_hf(name):
    """The native method's own plan too: its prediction held the bf16 logits only until
    their float cast, where the loss's frame holds them until the loss returns (the Python
    lifetimes probe did not align the loss's ops with the trace's)."""
    _check(name)


@pytest.mark.slow
def test_a_dead_cast_eager_makes_is_counted():
    """Llama with attention dropout and a padded row (`remat bench --validate`'s CPU
    model): CPU autocast's math attention casts its dropped-out probabilities to bf16 and
    uses the float32 ones; the graph drops the cast, eager makes it and frees it when the
    attention returns. In layer 0's recompute it was on the peak, 65,536 B above the
    prediction (docs/native.md): native execution now counts such transients."""
    from bench.validate import _hf

    c = _hf("llama", 64, 2, 64, 2)(torch.device("cpu"))
    problem = _check_case("hf-llama-dropout", c.model, c.args, c.kwargs, c.loss_fn, c.targets)
    dead = [t for t in problem.graph.transients if t.label == "aten._to_copy"]
    assert [sum(problem.graph.values[v].nbytes for v in t.outputs) for t in dead] == [65536] * 2
