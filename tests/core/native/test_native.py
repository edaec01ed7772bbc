"""Native execution (`apply_plan(..., runtime="native")`): the plan as selective checkpoint on
the model's own layers. Gradients and loss bit-equal to eager; measured peak never above
eager's, below it for a recomputing plan (the gap to the prediction is reported, not
asserted: docs/native.md); torch.compile and FSDP2 compose."""

from __future__ import annotations

import os

import pytest
import torch
import torch.multiprocessing as mp
from helpers import gloo_worker, rendezvous
from native_cases import case as _case
from native_cases import plans as _plans
from native_cases import step as _step

import core
from core.errors import PlanMismatch
from core.memory import StorageTracker, step_tensors
from core.native.runtime import native_handle
from core.schedule import store_all_plan
from sample_models import build


def _check_model(name: str) -> None:
    model, args, kwargs, loss_fn, targets = _case(name)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    problem = core.analyze(model, args, kwargs, loss_fn, targets)
    eager_peak, eager_loss, eager_grads = _step(model, model, args, kwargs, loss_fn, targets)
    for label, plan in _plans(problem).items():
        model.load_state_dict(state)
        run = core.apply_plan(model, plan, loss_fn=loss_fn, runtime="native")
        handle = native_handle(run)
        peak, loss, grads = _step(model, run, args, kwargs, loss_fn, targets)
        print(
            f"{name} {label}: predicted {plan.predicted_peak} native {peak} eager {eager_peak} "
            f"regions {len(handle.lowering.regions)} notes {len(handle.notes)}"
        )
        assert torch.equal(loss, eager_loss), label
        assert grads.keys() == eager_grads.keys()
        for n in eager_grads:
            assert torch.equal(grads[n], eager_grads[n]), f"{label}: {n}"
        assert peak <= eager_peak, label
        if handle.lowering.regions or handle.lowering.stretches:
            assert peak < eager_peak, label
        else:  # nothing recomputed: eager itself
            assert peak == eager_peak and label == "store_all"
        handle.remove()
        assert native_handle(model) is None and "forward" not in vars(model)


@pytest.mark.parametrize("name", ["gpt-tiny", "hf-gpt2", "hf-llama"])
def test_native_gradients_equal_eager_and_peak_below(name):
    _check_model(name)


@pytest.mark.slow
def test_native_gpt_small_6l():
    _check_model("gpt-small-6l")


def test_native_wraps_the_layers_and_is_reversible():
    model, inputs = build("gpt-tiny")
    plan = core.solve(core.analyze(model, inputs), 1.0, method="checkpoint_blocks")
    run = core.apply_plan(model, plan, runtime="native")
    assert run is model  # the plan's loss is the model's own: the user's module itself
    handle = native_handle(model)
    assert [r.module for r in handle.lowering.regions][:2] == [
        "transformer.h.0",
        "transformer.h.1",
    ]
    # the embeddings' dropout is recomputed by the plan but is no layer's forward: a
    # stretch of the root's forward runs it (core/native/stretch.py)
    stretches = handle.lowering.stretches
    assert stretches and stretches[0].label.startswith("transformer.wte (post, call 0) ..")
    with pytest.raises(PlanMismatch, match="already applied"):
        core.apply_plan(model, plan, runtime="native")
    handle.remove()
    assert "forward" not in vars(model.transformer.h[0]) and "forward" not in vars(model)
    assert not model.transformer.wte._forward_hooks


def test_native_refuses_a_run_that_does_not_line_up():
    model, inputs = build("gpt-tiny")
    plan = core.solve(core.analyze(model, inputs), 1.0, method="checkpoint_blocks")
    core.apply_plan(model, plan, runtime="native")
    model.eval()  # dropout off: the layers run other ops than traced
    with pytest.raises(
        PlanMismatch, match=r"transformer\.drop \(pre, call 0\) .. .*: the block ran 0 ops"
    ):
        model(*inputs).backward()


def test_native_refuses_unknown_runtimes():
    model, inputs = build("gpt-tiny")
    problem = core.analyze(model, inputs)
    plan = store_all_plan(problem)
    with pytest.raises(ValueError, match="unknown runtime"):
        core.apply_plan(model, plan, runtime="fast")


@pytest.mark.slow
@pytest.mark.parametrize("method,budget", [("checkpoint_blocks", 1.0), ("rockmate", 0.5)])
def test_native_compiles_without_graph_breaks(method, budget):
    import torch._dynamo as dynamo

    model, inputs = build("gpt-tiny")
    state = {k: v.clone() for k, v in model.state_dict().items()}
    plan = core.solve(core.analyze(model, inputs), budget, method=method)
    _, eager_loss, eager_grads = _step(model, model, inputs, {}, None, ())
    model.load_state_dict(state)
    run = core.apply_plan(model, plan, runtime="native")
    dynamo.reset()
    explained = dynamo.explain(run)(*inputs)
    assert explained.graph_break_count == 0 and explained.graph_count == 1
    dynamo.reset()
    compiled = torch.compile(run, backend="aot_eager")
    model.zero_grad(set_to_none=True)
    torch.manual_seed(3)
    loss = compiled(*inputs)
    loss.backward()
    assert torch.equal(loss.detach(), eager_loss)
    for n, p in model.named_parameters():
        assert torch.equal(p.grad, eager_grads[n]), n
    dynamo.reset()


@gloo_worker
def _fsdp_worker(rank: int, world: int, out_dir: str) -> None:
    from torch.distributed.fsdp import fully_shard

    plain, inputs = build("gpt-tiny")
    planned, _ = build("gpt-tiny")
    inputs = tuple(t.roll(rank, 0) for t in inputs)  # each rank its own batch
    plan = core.solve(core.analyze(planned, inputs), 0.5, method="rockmate")
    core.apply_plan(planned, plan, runtime="native")
    for model in (plain, planned):
        for layer in model.transformer.h:
            fully_shard(layer)
        fully_shard(model)
    peaks = []
    for model in (plain, planned):
        torch.manual_seed(100 + rank)
        with StorageTracker(step_tensors(model, inputs)) as tracker:
            model(*inputs).backward()
        peaks.append(tracker.peak)
    grads = {n: p.grad.full_tensor() for n, p in plain.named_parameters()}
    for n, p in planned.named_parameters():
        assert p.grad is not None, n
        assert torch.equal(p.grad.full_tensor(), grads[n]), n
    with open(os.path.join(out_dir, f"ok{rank}"), "w") as f:
        f.write(f"{peaks[0]} {peaks[1]} {plan.predicted_peak}")


@pytest.mark.slow
def test_native_fsdp2_gradients_equal_fsdp2_eager(tmp_path):
    mp.spawn(_fsdp_worker, args=(2, rendezvous(), str(tmp_path)), nprocs=2, join=True)
    for rank in (0, 1):
        eager, native, predicted = map(int, (tmp_path / f"ok{rank}").read_text().split())
        print(f"rank {rank}: FSDP2 eager {eager} native {native} predicted {predicted}")
        assert native < eager
