""" "Measure here": run the plan's real training step on this machine under the storage tracker
and read the live bytes back per program step, to draw over the predicted timeline.

The series comes from the real run: `core.StorageTracker` counts every storage the
step allocates while it lives, and each ATen call it sees is matched, in order, to the program
step whose op it runs (calls the program does not list, such as autograd's seed of
`loss.backward()`, stay with the step they fall in). The peak is the tracker's own.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import core
from core import ModelCall, StorageTracker, step_tensors

LOOKAHEAD = 16  # ATen calls searched for a program op's node before it counts as skipped


@dataclass(frozen=True)
class Measured:
    live: list[int]  # bytes alive after each program step, from the real run
    peak: int  # the tracker's peak over the whole step
    matched: int  # program nodes matched to a real ATen call
    nodes: int  # program nodes in all


class _Recorder(StorageTracker):
    """A storage tracker that also keeps (op, live bytes before, live bytes after) per call."""

    def __init__(self, existing) -> None:
        super().__init__(existing)
        self.events: list[tuple[Any, int, int]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        before = self.live
        out = super().__torch_dispatch__(func, types, args, kwargs)
        self.events.append((func, before, self.live))
        return out


def measure_plan(call: ModelCall, plan) -> Measured:
    """One training step of `core.apply_plan(call.model, plan)`, called as `call` says,
    measured."""
    wrapped = core.apply_plan(call.model, plan, call.loss_fn)
    call.model.zero_grad(set_to_none=True)
    with _Recorder(step_tensors(call.model, call.tensors())) as rec:
        out = call.run(wrapped)
        loss = out if out.dim() == 0 else out.sum()
        loss.backward()
    del out, loss
    return _per_step(rec.events, plan, rec.live, rec.peak)


def _per_step(events: list[tuple[Any, int, int]], plan, final: int, peak: int) -> Measured:
    graph = plan.problem.graph
    nodes = graph.trace.nodes
    live: list[int] = []
    e, current, matched, total = 0, events[0][1] if events else 0, 0, 0

    def match(node_ids) -> None:
        """Advance past the real calls of these trace nodes, in order."""
        nonlocal e, current, matched, total
        for n in node_ids:
            total += 1
            want = nodes[n].target
            end = min(e + LOOKAHEAD, len(events))
            j = next((k for k in range(e, end) if events[k][0] == want), None)
            if j is not None:
                current, e, matched = events[j][2], j + 1, matched + 1

    match(graph.prologue)  # views of parameters and inputs, before the first step
    for i, (kind, target) in enumerate(plan.program):
        if i == plan.backward_start:
            match(graph.tangent_prologue)
        if kind == "run":
            match(graph.ops[target].nodes)
            live.append(current)
        else:  # frees happen after their run: live before the next call, or at the end
            live.append(events[e][1] if e < len(events) else final)
    return Measured(live, peak, matched, total)
