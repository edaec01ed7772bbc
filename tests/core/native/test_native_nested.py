"""Nested stretches (`core.native.replay`, `core.native.simulate`): a stretch inside another,
both beginning at one moment, as PyTorch's non-reentrant checkpoint nests (its inputs saved
to its parent, its ops' saved tensors to itself). Held to the native rules on covers chosen
by hand: measured peak = the native prediction + the 4-byte seed of loss.backward(), loss and
gradients `torch.equal` to eager's, dropout included."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from helpers import SEED_BYTES
from native_cases import step

import core
from core.native.lowering import _program, lower
from core.native.runtime import NativeHandle, native_handle
from core.native.stretch import Cutting
from core.plan import Prediction
from core.schedule import store_all_plan
from sample_models.mlp import MLP, MLPConfig


def _mlp(dropout: float) -> tuple[torch.nn.Module, tuple[torch.Tensor, torch.Tensor]]:
    torch.manual_seed(0)
    model = MLP(MLPConfig(in_features=32, width=32, n_layer=6, num_classes=10, dropout=dropout))
    return model, (torch.randn(64, 32), torch.randint(0, 10, (64,)))


def _run_cover(dropout: float, pick) -> int:  # noqa: ANN001
    """Run the MLP natively with the stretches `pick(places)` gives (cuts, nests), every
    forward op recomputed; returns how many stretches are nested."""
    model, args = _mlp(dropout)
    start = {k: v.clone() for k, v in model.state_dict().items()}
    problem = core.analyze(model, args)
    model.load_state_dict(start)
    _, eager_loss, eager_grads = step(model, model, args, {}, None, ())
    blocks = [b.index for b in problem.blocks]
    graph = problem.graph
    cutting = Cutting.of(problem, blocks, set(), set(graph.forward_ops), [], loose=True)
    cuts, nests = pick(cutting.places)
    cover = cutting.cover(frozenset(cuts), cutting.joined, frozenset(nests))
    _, native = _program(problem, [], cover, set(), [])
    walked = native.walk(graph)
    plan = store_all_plan(problem)
    lowering = dataclasses.replace(
        lower(plan),
        stretches=cover.stretches,
        prediction=Prediction(walked.peak, walked.time, 1.0),
    )
    model.load_state_dict(start)
    NativeHandle(model, plan, lowering)
    peak, loss, grads = step(model, model, args, {}, None, ())
    assert peak == walked.peak + SEED_BYTES
    assert torch.equal(loss, eager_loss)
    assert grads.keys() == eager_grads.keys()
    for n, g in eager_grads.items():
        assert torch.equal(grads[n], g), n
    handle = native_handle(model)
    assert handle is not None
    handle.remove()
    return sum(s.parent is not None for s in cover.stretches)


@pytest.mark.parametrize("dropout", [0.0, 0.2])
def test_a_prefix_nested_in_a_stretch(dropout: float):
    """One stretch over the layers with two nested in it, each beginning where it does:
    the parent's recompute runs through its children (fresh checkpoints holding nothing)
    to the saved tensors of its own ops after them, and each child recomputes when its own
    nodes unpack."""
    nested = _run_cover(dropout, lambda p: ({p[0], p[-1]}, {p[len(p) // 3], p[len(p) // 2]}))
    assert nested == 2


def test_stretches_side_by_side_each_with_one_nested():
    """Two stretches, the second's child ending inside it; dropout in both."""

    def pick(p):  # noqa: ANN001, ANN202
        mid = len(p) // 2
        return {p[0], p[mid], p[-1]}, {p[mid // 2], p[mid + (len(p) - mid) // 2]}

    assert _run_cover(0.2, pick) == 2
