"""`analyze`: trace -> costs -> blocks, and the Problem every solver takes."""

from __future__ import annotations

import hashlib
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import cached_property
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from core.blocks import Block, constant_ops, find_blocks
from core.errors import UnsupportedModel
from core.graph import Graph, build_graph
from core.trace import capture

if TYPE_CHECKING:
    from core.schedule import Plan

Progress = Callable[[str, float], None]  # (stage description, fraction done)


@dataclass
class Problem:
    """A traced training step with op costs and its chain of blocks."""

    graph: Graph
    blocks: list[Block]
    block_of_op: list[int]
    cost_model: str  # "estimated:<device>" or "measured:<device>"
    fingerprint: str
    name: str = "model"
    cache: dict = field(default_factory=dict, repr=False)  # solver tables, keyed by solver
    model_ref: weakref.ref | None = field(default=None, repr=False)  # the model analysed
    loss_fn: Callable[..., torch.Tensor] | None = field(default=None, repr=False)

    @cached_property
    def constant_ops(self) -> tuple[int, ...]:
        """Step constants (masks, position ids, rotary tables): in no block, run first."""
        return constant_ops(self.graph)

    @cached_property
    def graph_meta(self) -> dict:
        return graph_meta(self.graph.trace)

    @cached_property
    def store_all_plan(self) -> Plan:
        """Plain PyTorch: every op once, in order, each value freed after its last use."""
        from core.schedule import plan_from_runs

        ops = self.graph.ops
        runs = [o.index for o in ops if o.phase == "forward"] + [
            o.index for o in ops if o.phase == "backward"
        ]
        n_fwd = len(self.graph.forward_ops)
        return plan_from_runs(self, runs, n_fwd, "store_all", 0)

    @property
    def store_all_peak(self) -> int:
        """Bytes: peak of one plain forward+backward beyond parameters and inputs."""
        return self.store_all_plan.predicted_peak

    @property
    def store_all_time(self) -> float:
        return sum(op.time for op in self.graph.ops)

    @cached_property
    def param_bytes(self) -> int:
        return sum(v.nbytes for v in self.graph.values if v.kind in ("param", "state"))

    @cached_property
    def input_bytes(self) -> int:
        return sum(v.nbytes for v in self.graph.values if v.kind == "input")

    def describe_difference(self, plan: Plan) -> str:
        """Say what differs between this problem's graph and the one a plan was made for."""
        meta = plan.graph_meta
        trace = self.graph.trace
        mine = graph_meta(trace)
        for key, what in (
            ("params", "parameters"),
            ("inputs", "input shapes or dtypes"),
            ("state", "buffers"),
        ):
            if key in meta and meta[key] != mine[key]:
                return f"{what} differ: plan has {_diff(meta[key], mine[key])}"
        if meta.get("n_nodes") not in (None, mine["n_nodes"]):
            return (
                f"the traced graph has {mine['n_nodes']} ATen ops, the plan's had {meta['n_nodes']}"
            )
        return "the traced operations differ (same shapes, different model code)"


def analyze(
    model: nn.Module,
    args: Sequence[Any],
    kwargs: dict[str, Any] | None = None,
    loss_fn: Callable[..., torch.Tensor] | None = None,
    targets: Sequence[torch.Tensor] = (),
    *,
    costs: str = "estimated",
    device: str = "cpu",
    name: str = "model",
    progress: Progress | None = None,
) -> Problem:
    """Trace one training step of `model`, time its ops and find its chain of blocks.

    The step is `output = model(*args, **kwargs)`, then `loss = loss_fn(output, *targets)`
    when `loss_fn` is given (a scalar; the planned module then returns it, see apply_plan),
    so the budget covers the loss too (a model computing its own loss, such as Hugging Face's
    given `labels=`: `loss_fn=lambda out: out.loss`). Without `loss_fn`, every differentiable
    output gets a gradient: backpropagating only some makes autograd pass zeros for the
    others, memory the plan does not count.
    Non-tensor arguments (flags, None) are bound as given.
    costs: "estimated" (FLOPs and bytes against the `device` preset, no compute) or
    "measured" (each distinct op timed on real tensors here, 1 thread, median).
    """
    from core import costs as cost_models

    report = progress or (lambda stage, frac: None)
    report("tracing", 0.0)
    if loss_fn is not None and kwargs and "targets" in kwargs:
        raise UnsupportedModel(
            "a keyword input named 'targets' with a loss_fn",
            "",
            "the planned module takes loss_fn's targets as `targets=`: rename the model's "
            "argument, or compute the loss inside the model",
        )
    trace = capture(model, args, kwargs, loss_fn, targets)
    graph = build_graph(trace)
    report("costs", 0.3)
    if costs == "measured":
        cost_models.assign_times(
            graph, "measured", progress=lambda d, n: report("timing ops", 0.3 + 0.6 * d / max(n, 1))
        )
        cost_name = "measured:" + _device_name(model)
    elif costs == "estimated":
        cost_models.assign_times(graph, "estimated", device=device)
        cost_name = "estimated:" + device
    else:
        raise ValueError(f"unknown cost model {costs!r}: use 'estimated' or 'measured'")
    report("blocks", 0.9)
    blocks, block_of_op = find_blocks(graph)
    report("done", 1.0)
    problem = Problem(graph, blocks, block_of_op, cost_name, fingerprint(trace), name)
    problem.model_ref = weakref.ref(model)
    problem.loss_fn = loss_fn
    return problem


def graph_meta(trace) -> dict:
    """What a plan file records about its graph, to say what differs on a mismatch."""
    return {
        "params": [[n, str(s)] for n, s in zip(trace.param_names, trace.param_specs)],
        "state": list(trace.state_names),
        "inputs": [
            [list(s.shape), s.dtype, i in trace.grad_inputs]
            for i, s in enumerate(trace.input_specs)
        ],
        "n_nodes": len(trace.nodes),
        "call": trace.call.to_data(),
    }


def fingerprint(trace) -> str:
    """Hash of the ops, shapes, dtypes, parameter names and shapes of a traced step. How the
    inputs are passed (the "call") is left out: the planned module checks it on every call,
    and plans made before keyword inputs keep their fingerprint."""
    h = hashlib.sha256()
    h.update(repr({k: v for k, v in graph_meta(trace).items() if k != "call"}).encode())
    for n in trace.nodes:
        h.update(repr((n.role, n.label, str(n.target), n.args, n.kwargs, n.specs)).encode())
    return h.hexdigest()[:32]


def _device_name(model: nn.Module) -> str:
    p = next(iter(model.parameters()), None)
    return str(p.device) if p is not None else "cpu"


def _diff(theirs: list, mine: list) -> str:
    for i, (a, b) in enumerate(zip(theirs, mine)):
        if a != b:
            return f"{a} where the model has {b} (entry {i})"
    return f"{len(theirs)} entries where the model has {len(mine)}"
