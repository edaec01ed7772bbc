"""Eager's ATen ops matched to the trace's: the one place that says how an op eager
dispatches is named in the trace (`traced_as`), and how a run of eager ops is aligned with
the traced forward (`align`). The runtime's policy, the offload finder and the probes of
`core.native.lifetimes` and `core.native.boundaries` all match through here.
"""

from __future__ import annotations

import operator
from typing import Any

import torch

from core.graph import first_backward_node
from core.trace.nodes import Trace

# make_fx records `lift_fresh` (a tensor made from Python data) as `lift_fresh_copy`
# (torch/fx/experimental/proxy_tensor.py): eager dispatch shows the former
TRACED_AS: dict[Any, Any] = {
    torch.ops.aten.lift_fresh.default: torch.ops.aten.lift_fresh_copy.default
}
WINDOW = 64  # probe ops a traced node may be ahead of its match (metadata queries)


def traced_as(op: Any) -> Any:
    """The op the trace records where eager dispatches `op`."""
    return TRACED_AS.get(op, op)


def align(trace: Trace, ops: list[Any]) -> list[tuple[int, int]]:
    """(probe op, traced forward node) pairs running the same ATen op, in order: each traced
    node matched to the next probe op with its target (`ops` named by `traced_as`; the probe
    runs ops the trace does not record, such as fake-tensor metadata queries). The forward
    is the model's ops and the loss's (ops outside every module before the backward)."""
    pairs: list[tuple[int, int]] = []
    k = 0
    backward = first_backward_node(trace)
    for n in trace.nodes:
        if n.role != "op" or n.target is operator.getitem:
            continue
        if n.module is None and n.index >= backward:
            continue
        j, end = k, min(len(ops), k + WINDOW)
        while j < end and ops[j] != n.target:
            j += 1
        if j == end:
            continue  # recorded by the trace only (autograd's detach of a saved value)
        pairs.append((j, n.index))
        k = j + 1
    return pairs
