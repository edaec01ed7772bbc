"""A plan's program walked on its traced step: the memory timeline the app draws and a plan's
`simulate()` returns, with what is live when, each forward op's fate and the host pool's layout;
and the same walk recording nothing, for searches comparing programs."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Literal, NamedTuple

from core.graph import Graph, Phase
from core.simulator.program import (
    COLUMNS,
    OFFLOAD,
    RUN,
    Instruction,
    Link,
    check_rules,
    step_values,
)
from core.simulator.walker import Transfer, Walk, walk

Fate = Literal["kept", "recomputed", "freed", "offloaded"]


class Step(NamedTuple):
    """One row of the memory timeline: live bytes after the instruction, by kind."""

    index: int  # type: ignore[assignment]  # shadows tuple.index: the step's position
    kind: str  # run | free | offload | prefetch
    target: int  # op index (run) or value index (free)
    name: str
    label: str  # "aten.mm" for runs, the value's kind for frees
    phase: Phase
    block: int
    recompute: bool
    activations: int
    temporaries: int
    gradients: int

    @property
    def live(self) -> int:
        return self.activations + self.temporaries + self.gradients


@dataclass
class Simulation:
    """A plan's program walked on its graph: the timeline, its peak and time, and what
    is live when (the app's step-through reads this; it never walks the program itself)."""

    timeline: list[Step]
    peak: int
    peak_step: int
    time: float
    recomputed_ops: int
    backward_start: int
    intervals: dict[int, list[tuple[int, int]]]  # value -> [first step live, step freed)
    op_steps: dict[int, list[int]]  # op -> program steps that run it
    forward_outputs: dict[int, tuple[int, ...]]  # forward op -> the values it produces
    stall: float = 0.0  # seconds of `time` the compute lane waited for prefetches
    transfers: list[Transfer] = field(default_factory=list)  # the transfer lane
    host: list[int] = field(default_factory=list)  # bytes parked on the host after each step
    host_peak: int = 0  # most bytes parked at once
    host_slots: dict[int, int] = field(default_factory=dict)  # offload step -> pool offset
    host_pool: int = 0  # bytes of the host pool the slots need (>= host_peak)
    waits: list[tuple[int, float, float]] = field(default_factory=list)  # stalls: (run step,
    # seconds it was ready to start, seconds its prefetched input arrived)

    def live_after(self, step: int) -> set[int]:
        """Values (storages) live after program step `step` (-1: before the first)."""
        return {
            v
            for v, spans in self.intervals.items()
            if any(start <= step < end for start, end in spans)
        }

    def fates(self) -> dict[int, Fate]:
        """Each forward op by what the program does with its results: recomputed in the
        backward, kept until the backward, or freed in the forward (the backward never needs
        them again), or offloaded to the host. Where: `op_steps` (its runs), `intervals` (its
        values' lifetimes) and `transfers`."""
        kept = self.live_after(self.backward_start - 1)
        sent = {t.value for t in self.transfers if t.kind == OFFLOAD}
        out: dict[int, Fate] = {}
        for o, outputs in self.forward_outputs.items():
            if len(self.op_steps.get(o, ())) > 1:
                out[o] = "recomputed"
            elif sent.intersection(outputs):
                out[o] = "offloaded"
            elif kept.intersection(outputs):
                out[o] = "kept"
            else:
                out[o] = "freed"
        return out

    def releases(self) -> tuple[dict[int, list[int]], dict[int, list[int]]]:
        """Run step -> values released before it runs: offloaded device storages, and host
        copies of prefetched values (a copy is done). Values missing are released at the end."""
        device: dict[int, list[int]] = {}
        host: dict[int, list[int]] = {}
        for t in self.transfers:
            if t.release >= 0:
                (device if t.kind == OFFLOAD else host).setdefault(t.release, []).append(t.value)
        return device, host


def host_layout(transfers: Sequence[Transfer], sizes: dict[int, int], end: int) -> dict[int, int]:
    """A host pool offset for each offload (by its step): first fit, in program order, among
    the copies parked at the same time. A copy is parked from its offload until its prefetch's
    copy is done (step `end` when never)."""
    until: dict[int, int] = {}  # offload step -> step its slot is free again
    pending: dict[int, int] = {}  # value -> step of its open offload
    for t in transfers:
        if t.kind == OFFLOAD:
            pending[t.value] = t.step
        else:
            until[pending.pop(t.value)] = t.release if t.release >= 0 else end
    for step in pending.values():
        until[step] = end
    slots: dict[int, int] = {}
    active: list[tuple[int, int, int]] = []  # (offset, bytes, free from step)
    for t in transfers:
        if t.kind != OFFLOAD:
            continue
        active = sorted(a for a in active if a[2] > t.step)
        nbytes, offset = sizes.get(t.value, 0), 0
        for start, used, _ in active:
            if start - offset >= nbytes:
                break
            offset = max(offset, start + used)
        slots[t.step] = offset
        active.append((offset, nbytes, until[t.step]))
    return slots


def simulate(
    graph: Graph,
    block_of_op: Sequence[int],
    program: Sequence[Instruction],
    backward_start: int,
    link: Link | None = None,
) -> Simulation:
    """Walk a plan's program on its graph, checking it is valid, and record live bytes
    after each instruction by kind (activations, temporaries, gradients), and the bytes
    parked on the host; `link` times offloads and prefetches."""
    values, ops = graph.values, graph.ops
    check_rules(graph, program, backward_start)
    column = {v.index: COLUMNS.index(v.kind) for v in values if v.kind in COLUMNS}
    sizes, initial, arriving = step_values(graph)
    walked = walk(
        ops,
        program,
        backward_start,
        sizes,
        initial=initial,
        arriving=arriving,
        final=graph.final_values,
        column=column,
        record=True,
        op_names=[op.name for op in ops],
        value_names=[v.name for v in values],
        link=link,
    )
    slots = host_layout(walked.transfers, sizes, len(program))
    offloads = [t for t in walked.transfers if t.kind == OFFLOAD]
    return Simulation(
        timeline=_timeline(graph, block_of_op, program, backward_start, walked),
        peak=walked.peak,
        peak_step=walked.peak_step,
        time=walked.time,
        recomputed_ops=walked.recomputed_ops,
        backward_start=backward_start,
        intervals=walked.intervals,
        op_steps=walked.op_steps,
        forward_outputs={o: ops[o].outputs for o in graph.forward_ops},
        stall=walked.stall,
        transfers=walked.transfers,
        host=walked.host,
        host_peak=walked.host_peak,
        host_slots=slots,
        host_pool=max((slots[t.step] + sizes[t.value] for t in offloads), default=0),
        waits=walked.waits,
    )


def _timeline(
    graph: Graph,
    block_of_op: Sequence[int],
    program: Sequence[Instruction],
    backward_start: int,
    walked: Walk,
) -> list[Step]:
    """One `Step` per instruction of a recorded walk: what it did and the live bytes after it."""
    values, ops = graph.values, graph.ops
    timeline = []
    for i, ((kind, target), live) in enumerate(zip(program, walked.columns)):
        phase: Phase = "forward" if i < backward_start else "backward"
        if kind == RUN:
            op = ops[target]
            recompute = walked.op_steps[target][0] < i
            name, label, block = op.name, op.label, block_of_op[target]
        else:
            value = values[target]
            recompute = False
            name, label = value.name, value.kind
            block = block_of_op[value.producer] if value.producer is not None else -1
        live = (*live, *[0] * (len(COLUMNS) - len(live)))  # kinds absent from the graph
        timeline.append(Step(i, kind, target, name, label, phase, block, recompute, *live))
    return timeline


def walk_step(
    graph: Graph, program: Sequence[Instruction], backward_start: int, link: Link | None = None
) -> Walk:
    """`walk` a program over a traced step, recording nothing: what searches compare."""
    sizes, initial, arriving = step_values(graph)
    return walk(
        graph.ops, program, backward_start, sizes, initial, arriving, graph.final_values, link=link
    )
