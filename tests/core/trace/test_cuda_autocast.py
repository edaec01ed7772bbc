"""CUDA's autocast traced on CPU tensors (core.trace.cuda_autocast): each weight's cast is an
op of the step, made once per forward and held for the backward, as CUDA eager holds it."""

from __future__ import annotations

import torch
from torch import nn

import core
from core.trace.autocast import Autocast

FP16 = Autocast((("cuda", "float16"),))


class Tied(nn.Module):
    """Two linears, the first one applied twice: its weight is cast once per forward."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(64, 64)
        self.b = nn.Linear(64, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.relu(self.a(torch.relu(self.a(x)))))


def _problem() -> core.Problem:
    torch.manual_seed(0)
    model = Tied().train()
    x, y = torch.randn(16, 64), torch.randint(0, 8, (16,))
    return core.analyze(
        model,
        (x,),
        loss_fn=nn.functional.cross_entropy,
        targets=(y,),
        device="v100",
        autocast=FP16,
    )


def test_each_weight_is_cast_once_in_the_step_and_held_for_the_backward():
    """The fp16 casts of the four parameters are `_to_copy` ops on them in the forward (one
    per parameter, though `a` runs twice), no weight-sized value is a constant made outside
    the step, and the store-all peak holds each cast weight at the backward's start."""
    problem = _problem()
    graph = problem.graph
    casts = [
        op
        for op in graph.ops
        if op.phase == "forward"
        and op.label == "aten._to_copy"
        and graph.values[op.inputs[0]].kind == "param"
    ]
    params = {v.index for v in graph.values if v.kind == "param"}
    assert sorted(graph.values[op.inputs[0]].index for op in casts) == sorted(params)
    fp16_weights = {64 * 64 * 2, 8 * 64 * 2}
    assert not [v for v in graph.values if v.kind == "constant" and v.nbytes in fp16_weights]
    simulation = core.store_all_plan(problem).simulate()
    start = next(i for i, s in enumerate(simulation.timeline) if s.phase == "backward")
    weights = {v for op in casts for v in op.outputs if graph.values[v].nbytes in fp16_weights}
    assert len(weights) == 2 and weights <= simulation.live_after(start - 1)
