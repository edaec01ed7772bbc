"""How long the model's Python code holds each forward value, and which values each
submodule is called with: `python_lifetimes`.

Autograd holds what it saves; everything else lives while Python holds a reference (a local
variable, an argument, a list). Under native execution a checkpointed layer's values are not
held by autograd, so the layer's Python code decides when they are freed, in the forward and
in the recompute: Hugging Face's attention keeps `query_states` after the rotary embedding
made a new one. The joint trace cannot say (autograd holds every saved value there), so the
model's forward is run once more under fake tensors and `no_grad`, and each new storage's
death is recorded against the op running when Python dropped it. A checkpointed submodule's
frame holds every tensor the submodule is called with (its args and kwargs, read or not:
Llama's layers get `position_ids` and never read it), so the probe records those too.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from core.native.match import align, traced_as
from core.trace.call import fake_call
from core.trace.device import CPU, DeviceModel, running_as
from core.trace.eager_branches import eager_branches
from core.trace.nodes import Trace

Made = tuple[int, int]  # a storage: the op (or traced node) that made it, its output's place


class _Deaths(TorchDispatchMode):
    """Every op dispatched, and for each new storage the op after which it was freed. A
    storage is named by the op that made it and its place among the op's tensor outputs
    (batch norm's output outlives the statistics it returns beside it)."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[Any] = []
        self.died: dict[Made, int] = {}  # a storage -> the last op before it died
        self._seen: set[int] = set()
        self.made: dict[int, Made] = {}  # live storage -> the op and output that made it
        self.passed: dict[str, set[Made]] = {}  # submodule -> the storages of its call

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
        out = func(*args, **(kwargs or {}))
        k = len(self.ops)
        self.ops.append(traced_as(func))
        tensors = [t for t in tree_leaves(out) if isinstance(t, torch.Tensor)]
        for i, t in enumerate(tensors):
            storage = t.untyped_storage()
            if storage._cdata not in self._seen:
                self._seen.add(storage._cdata)
                self.made[storage._cdata] = (k, i)
                weakref.finalize(storage, self._dead, storage._cdata, (k, i))
        return out

    def _dead(self, key: int, made: Made) -> None:
        self._seen.discard(key)
        self.made.pop(key, None)
        self.died.setdefault(made, len(self.ops) - 1)

    def called(self, name: str, args: Any, kwargs: Any) -> None:
        """Submodule `name` is called with `args` and `kwargs`: record the storages of
        their tensors."""
        mine = self.passed.setdefault(name, set())
        for t in tree_leaves((args, kwargs)):
            if isinstance(t, torch.Tensor):
                k = self.made.get(t.untyped_storage()._cdata)
                if k is not None:
                    mine.add(k)


@dataclass(frozen=True)
class Lifetimes:
    """What the model's Python code holds, in traced forward nodes, a storage named by the
    node making it and its place among the node's tensor outputs: `dropped` maps a storage
    to the node after which Python drops it (absent: outlives the forward); `passed` maps
    a submodule's path to the storages it is called with."""

    dropped: dict[Made, int]
    passed: dict[str, frozenset[Made]]


def python_lifetimes(
    model: nn.Module,
    trace: Trace,
    loss_fn: Callable[..., torch.Tensor] | None = None,
    device_model: DeviceModel = CPU,
) -> Lifetimes:
    """When the model's Python code drops each storage and what each submodule is called
    with: the model called as traced, on fake inputs shaped as traced, without autograd,
    as on the device the trace was made for (`running_as`: its autocast, attention and
    dropout; then `loss_fn` when the trace has one)."""
    device = next((p.device for p in model.parameters()), torch.device("cpu"))
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    inputs = [(s.shape, s.dtype, False) for s in trace.input_specs]
    args, kwargs, targets = fake_call(inputs, trace.call, device, mode)
    deaths = _Deaths()
    # fake mode runs ops on small real CPU tensors for real (batch-norm's step count):
    # the probe must leave the model's buffers as it found them
    buffers = [(b, b.clone()) for b in model.buffers()]
    hooks = [
        sub.register_forward_pre_hook(
            lambda _m, a, kw, name=name: deaths.called(name, a, kw), with_kwargs=True
        )
        for name, sub in model.named_modules()
    ]
    try:
        as_traced = running_as(device_model, model, trace.autocast)
        with torch.no_grad(), as_traced, mode, deaths, eager_branches():
            out = model(*args, **kwargs)
            if loss_fn is not None and trace.call.loss:
                out = loss_fn(out, *targets)
            dropped = len(deaths.ops)
            deaths.ops.append(None)  # what dies from here on outlives the forward
            del out
    finally:
        for hook in hooks:
            hook.remove()
        with torch.no_grad():
            for b, value in buffers:
                b.copy_(value)
    matched = align(trace, deaths.ops)
    at: list[int] = []  # probe op -> last traced node matched at or before it
    last = -1
    node_of = dict(matched)
    for k in range(len(deaths.ops)):
        last = node_of.get(k, last)
        at.append(last)
    died = {
        (node_of[k], i): at[last]
        for (k, i), last in deaths.died.items()
        if k in node_of and last < dropped and at[last] >= 0
    }
    passed = {
        name: frozenset((node_of[k], i) for k, i in made if k in node_of)
        for name, made in deaths.passed.items()
    }
    return Lifetimes(died, passed)
