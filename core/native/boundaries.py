"""Where a region that is no submodule can begin and end: the moments the model's Python
code calls or returns from a submodule (its forward pre-hook and forward hook), the start of
the step and its end, each at a place among the traced forward ops: `boundaries(problem)`.

Between two such moments autograd has finished every op before and started none after, so
checkpoint's saved-tensor hooks and selective policy can be entered and left there. A
moment is named by the module, the hook ("pre" or "post") and which call of that module it
is in the step; its place is the index, among the traced forward op nodes, of the first op
that runs after it. The model is run once under fake tensors and `no_grad` with hooks on
every submodule, and the ops it dispatches are aligned with the trace.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.checkpoint import SAC_IGNORED_OPS

from core.native.match import align, traced_as
from core.problem import Problem, per_problem
from core.trace.call import join_call
from core.trace.device import running_as
from core.trace.eager_branches import eager_branches
from core.trace.nodes import AtenNode

START, END = "start", "end"  # the step's own boundaries (module "")
IGNORED = frozenset(SAC_IGNORED_OPS)


@dataclass(frozen=True)
class Boundary:
    """A moment of the step's forward: `module`'s `hook` ("pre", "post"; or the step's
    "start", "end") at its `call`-th call (0-based), before forward op node `place`."""

    module: str
    hook: str
    call: int
    place: int


@dataclass(frozen=True)
class Boundaries:
    """The traced forward op nodes in order and every moment a region can begin or end."""

    nodes: tuple[int, ...]  # trace node index of each place
    moments: tuple[Boundary, ...]  # in the order they happen
    # places of ops eager did not run as traced in the probe (no stretch may hold them)
    unmatched: frozenset[int] = frozenset()
    # moments after ops the probe did not run only because they are checkpoint's ignored
    # ops (autograd's `detach` of a saved result, which `no_grad` skips): between the op
    # before and the next, which one side of the `detach` does not matter to a stretch
    loose: tuple[Boundary, ...] = ()

    def at(self, place: int) -> list[Boundary]:
        """The moments just before forward op node `place` (the end: `len(nodes)`)."""
        return [b for b in self.moments if b.place == place]


def forward_nodes(nodes: list[AtenNode]) -> list[int]:
    """The traced forward op nodes in execution order (the places moments refer to)."""
    return [n.index for n in nodes if n.role == "op" and n.module is not None]


class _Count(TorchDispatchMode):
    """Counts the ops dispatched, and notes them (as the trace names them)."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[Any] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
        self.ops.append(traced_as(func))
        return func(*args, **(kwargs or {}))


@per_problem
def boundaries(problem: Problem) -> Boundaries:
    """The moments of `problem`'s step a stretch region can begin or end at; only the
    step's start and end for a problem made without a model (a RematError when its model
    was garbage collected: `Problem.live_model`)."""
    trace = problem.graph.trace
    places = forward_nodes(trace.nodes)
    ends = [Boundary("", START, 0, 0), Boundary("", END, 0, len(places))]
    model = problem.live_model("native execution's regions between submodule calls")
    if model is None:
        return Boundaries(tuple(places), tuple(ends))
    events = _probe(model, problem)
    pairs = align(trace, events.ops)
    place_of = {n: i for i, n in enumerate(places)}
    matched = sorted((k, place_of[n]) for k, n in pairs if n in place_of)
    moments = [ends[0]]
    calls: dict[tuple[str, str], int] = {}
    for module, hook, count in events.events:
        nxt = next((p for k, p in matched if k >= count), len(places))
        k = calls.get((module, hook), 0)
        calls[(module, hook)] = k + 1
        moments.append(Boundary(module, hook, k, nxt))
    moments.append(ends[1])
    # a moment just after a traced op the probe did not run as traced (eager's in-place
    # `silu_` where the trace has `silu`) may fall before or after it: not a place to cut
    seen = {p for _, p in matched}
    nodes = trace.nodes
    unsure = set()
    loose = set()  # ... after ops checkpoint ignores only (autograd's `detach` of a result)
    for m in moments:
        q = m.place - 1
        while q >= 0 and nodes[places[q]].target is operator.getitem:
            q -= 1
        if q >= 0 and q not in seen:
            unsure.add(m.place)
            while q >= 0 and (
                nodes[places[q]].target in IGNORED or nodes[places[q]].target is operator.getitem
            ):
                q -= 1
            if q < 0 or q in seen:
                loose.add(m.place)
    skipped = frozenset(
        p
        for p, n in enumerate(places)
        if p not in seen
        and nodes[n].target is not operator.getitem
        and nodes[n].target not in SAC_IGNORED_OPS
    )
    return Boundaries(
        tuple(places),
        tuple(m for m in moments if m.place not in unsure or m.hook in (START, END)),
        skipped,
        tuple(m for m in moments if m.place in unsure and m.place in loose),
    )


@dataclass
class _Events:
    ops: list[Any]
    events: list[tuple[str, str, int]]  # (module, hook, ops dispatched before it)


def _probe(model: nn.Module, problem: Problem) -> _Events:
    """Run the step's forward (and loss) under fake tensors and `no_grad` with a pre-hook
    and a hook on every submodule, counting the ops dispatched at each. The model's
    branches on tensor values are taken as eager takes them (`eager_branches`): else
    transformers builds its attention mask under fake tensors, where eager builds none, and
    the ops after it were aligned with the trace's a mask's length too early."""
    trace = problem.graph.trace
    device = next((p.device for p in model.parameters()), torch.device("cpu"))
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    with mode:
        example = [
            torch.empty(s.shape, dtype=getattr(torch, s.dtype), device=device)
            for s in trace.input_specs
        ]
    args, kwargs, targets = join_call(example, trace.call)
    count = _Count()
    events: list[tuple[str, str, int]] = []
    buffers = [(b, b.clone()) for b in model.buffers()]  # fake mode runs small ops for real
    hooks = []
    for name, sub in model.named_modules():
        if not name:
            continue
        hooks.append(
            sub.register_forward_pre_hook(
                lambda *_, name=name: events.append((name, "pre", len(count.ops)))
            )
        )
        hooks.append(
            sub.register_forward_hook(
                lambda *_, name=name: events.append((name, "post", len(count.ops)))
            )
        )
    try:
        as_traced = running_as(problem.device_model, model, trace.autocast)
        with torch.no_grad(), as_traced, mode, count, eager_branches():
            out = model(*args, **kwargs)
            if problem.loss_fn is not None and trace.call.loss:
                out = problem.loss_fn(out, *targets)
            del out
    finally:
        for hook in hooks:
            hook.remove()
        with torch.no_grad():
            for b, value in buffers:
                b.copy_(value)
    return _Events(count.ops, events)
