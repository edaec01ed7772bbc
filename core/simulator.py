"""The simulator: the one place that says what a program does to memory, and when.

A program is a list of instructions, plain data: `("run", op)` computes an op (the first
time, or again: a recompute), `("free", value)` drops a storage, `("offload", value)` starts
copying a storage to host memory (its device bytes are released once the copy is done) and
`("prefetch", value)` starts copying it back into a fresh device storage. Instructions before
`backward_start` run in the forward pass; the rest when `loss.backward()` reaches the model.
Every consumer reads this module: the plan's timeline (`core.schedule`), the exact figures
the solvers rank candidates by (a block or a whole graph as a `Dag`), the app's step-through
(live values and each forward op's fate) and the runtime, which walks the same program.

Each instruction kind has one handler in `walk`; a new kind is a new handler there and a new
constant here, not a second simulator. Two shortcuts, for speed only: `StepRuns` finds the
peak and time `walk` gives the program of a run list (runs and frees, no transfers) without
building it, for Rotor's probes; tests hold it to `walk` on every chain schedule.
`TransferProbe` finds them for a program with one more value's offload and prefetch inserted,
for the greedy offload pass's tries; tests hold it to `walk` on every try the pass makes.

Time runs on two lanes: compute (runs, one after another) and transfer (offloads and
prefetches, one after another, at the host link's bandwidth). A transfer starts when the lane
is free and the compute issued so far is done; a run that reads a prefetched value waits for
its copy (a stall, counted in the predicted time). An offloaded storage stays on the device
until its copy is done: it is released before the first run that starts after that, and a
prefetched value's host copy likewise once its copy back is done.
"""

from __future__ import annotations

import heapq
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Literal, NamedTuple, Protocol

import numpy as np

from core.errors import InvalidPlan
from core.graph import Graph, Phase

RUN: Literal["run"] = "run"
FREE: Literal["free"] = "free"
OFFLOAD: Literal["offload"] = "offload"
PREFETCH: Literal["prefetch"] = "prefetch"
KINDS = (RUN, FREE, OFFLOAD, PREFETCH)
_VERBS = {FREE: "frees", OFFLOAD: "offloads", PREFETCH: "prefetches"}
Instruction = tuple[str, int]
Fate = Literal["kept", "recomputed", "freed", "offloaded"]


@dataclass(frozen=True)
class Link:
    """The host link: bytes/s copied device-to-host (offload) and host-to-device (prefetch)."""

    d2h: float
    h2d: float

    def __post_init__(self) -> None:
        if not (self.d2h > 0 and self.h2d > 0):
            raise ValueError(f"link bandwidths must be positive bytes/s, not {self}")


@dataclass(frozen=True)
class Transfer:
    """One copy on the transfer lane: seconds from the step's start, the step that issued it
    and the run step before which its source storage is released (-1: the program's end)."""

    kind: str  # offload | prefetch
    value: int
    step: int
    start: float
    end: float
    release: int


class OpLike(Protocol):
    """What the simulator reads of an op: graph ops (`core.graph.Op`) and `DagOp`s."""

    @property
    def inputs(self) -> tuple[int, ...]: ...
    @property
    def outputs(self) -> tuple[int, ...]: ...
    @property
    def time(self) -> float: ...


# --------------------------------------------------------------------------- programs


def program_from_runs(
    ops: Sequence[OpLike],
    runs: Sequence[int],
    n_forward: int,
    final: Iterable[int],
    held: frozenset[int] = frozenset(),
    arriving: frozenset[int] = frozenset(),
) -> tuple[list[Instruction], int]:
    """The program of a sequence of op runs under free-after-last-read: each value produced
    by a run is freed right after its last read before it is produced again (or after its
    producing run when nothing reads it), unless it is `final`. `held` values live at least
    until the forward ends; `arriving` values (live from the backward's start) are freed
    after their last read in the backward. Returns the program and its `backward_start`;
    the first `n_forward` runs are the forward pass."""
    final = frozenset(final)
    last_read: dict[int, int] = {}  # value -> run position of its latest read so far
    produced: dict[int, int] = {}
    frees_after: dict[int, list[int]] = {}

    def retire(v: int) -> None:
        pos = last_read.pop(v, produced[v])
        if v in held:
            pos = max(pos, n_forward - 1)
        frees_after.setdefault(pos, []).append(v)

    for pos, o in enumerate(runs):
        op = ops[o]
        for v in op.inputs:
            if v in produced or v in arriving:
                last_read[v] = pos
        for v in op.outputs:
            if v in produced:
                retire(v)
            produced[v] = pos
    for v in arriving:
        frees_after.setdefault(max(last_read.pop(v, n_forward), n_forward), []).append(v)
    for v in produced:
        if v not in final:
            retire(v)

    program: list[Instruction] = []
    start = None
    for pos, o in enumerate(runs):
        if pos == n_forward:
            start = len(program)
        program.append((RUN, o))
        frees = frees_after.get(pos)
        if frees:
            frees.sort()
            program += [(FREE, v) for v in frees]
    return program, len(program) if start is None else start


# --------------------------------------------------------------------------- the walker


@dataclass
class Walk:
    """What walking a program found. Bytes count only the values the memory model sizes;
    device bytes unless named host."""

    peak: int
    peak_step: int  # first instruction after which `peak` bytes are live
    forward_peak: int  # most bytes live after a forward instruction
    backward_peak: int  # most bytes live from the backward's start on (its start included)
    backward_start_bytes: int  # live when the backward starts, arriving values included
    kept: frozenset[int]  # sized values the forward leaves live for the backward
    time: float  # seconds: every run in program order, plus the stalls waiting for prefetches
    forward_time: float
    backward_time: float
    recomputed_ops: int
    stall: float = 0.0  # seconds runs waited for prefetches (in `time`)
    host_peak: int = 0  # most bytes parked in host memory at once
    transfers: list[Transfer] = field(default_factory=list)
    # recorded walks only (record=True):
    columns: list[tuple[int, ...]] = field(default_factory=list)  # live bytes per column, per step
    intervals: dict[int, list[tuple[int, int]]] = field(
        default_factory=dict
    )  # value -> [start, end)
    op_steps: dict[int, list[int]] = field(default_factory=dict)  # op -> steps that run it
    host: list[int] = field(default_factory=list)  # host bytes after each step
    waits: list[tuple[int, float, float]] = field(default_factory=list)  # (run step, from, to)


def walk(
    ops: Sequence[OpLike],
    program: Sequence[Instruction],
    backward_start: int,
    sizes: dict[int, int],
    initial: Iterable[int] = (),
    arriving: Iterable[int] = (),
    final: Iterable[int] = (),
    column: dict[int, int] | None = None,
    record: bool = False,
    op_names: Sequence[str] | None = None,
    value_names: Sequence[str] | None = None,
    link: Link | None = None,
) -> Walk:
    """Walk `program` and return its memory and time. Only values in `sizes` are tracked
    (others, such as parameters of a block walked alone, are always available and never
    counted); `initial` values are live from the start, `arriving` ones from the backward's
    start; `final` ones may not be freed. With `record`, keep
    live bytes per step split by `column` (value -> column index; all in one column when
    None), each value's live intervals and the steps that run each op. `link` times the
    offloads and prefetches (see the module's docstring); a program with either needs one.

    Raises InvalidPlan when an op reads a tracked value that is not live (or is parked on the
    host and not prefetched), recomputes a value still live, a free drops a value not live
    or final, or a transfer moves a value that is not where it says."""

    def op_name(o: int) -> str:
        return op_names[o] if op_names else f"op {o}"

    def value_name(v: int) -> str:
        return value_names[v] if value_names else f"value {v}"

    live: set[int] = set(initial)
    arriving = tuple(arriving)
    final = frozenset(final)
    n_columns = 1 + max(column.values(), default=0) if column else 1
    totals = [0] * n_columns
    now = f_peak = b_peak = b_start = peak = peak_step = 0
    time = f_time = b_time = 0.0
    recomputed = 0
    ran: set[int] = set()
    kept: frozenset[int] | None = None
    columns: list[tuple[int, ...]] = []
    opened: dict[int, int] = dict.fromkeys(live, -1) if record else {}
    intervals: dict[int, list[tuple[int, int]]] = {}
    op_steps: dict[int, list[int]] = {}
    # the transfer lane: clock, values parked on the host, copies not yet done
    lane = stall = 0.0
    host = host_peak = 0
    parked: set[int] = set()  # on the host, not prefetched
    sent: set[int] = set()  # offloaded at least once
    ready: dict[int, float] = {}  # prefetched value -> when its copy is done
    releasing: list[tuple[float, int, int]] = []  # (copy done, transfer index, value)
    transfers: list[Transfer] = []
    host_steps: list[int] = []
    waits: list[tuple[int, float, float]] = []  # runs that waited for a prefetch
    leaving: dict[int, list[int]] = {}  # offloaded value -> steps its leaving copies opened

    size = sizes.get  # the solvers' searches walk thousands of programs: keep this loop lean

    def opens(v: int, step: int) -> None:
        opened[v] = step
        totals[column.get(v, 0) if column else 0] += size(v, 0)

    def closes(v: int, step: int) -> None:
        intervals.setdefault(v, []).append((opened.pop(v), step))
        totals[column.get(v, 0) if column else 0] -= size(v, 0)

    def release(until: float, step: int) -> None:
        """Copies done by `until`: offloaded device storages and prefetched host copies go."""
        nonlocal now, host
        done = [r for r in releasing if r[0] <= until]
        if not done:
            return
        releasing[:] = [r for r in releasing if r[0] > until]
        for _, k, v in done:
            t = transfers[k]
            transfers[k] = Transfer(t.kind, t.value, t.step, t.start, t.end, step)
            if t.kind == OFFLOAD:
                now -= size(v, 0)
                if record:  # the copy that left (the oldest: one lane, copies done in order)
                    intervals.setdefault(v, []).append((leaving[v].pop(0), step))
                    totals[column.get(v, 0) if column else 0] -= size(v, 0)
            else:
                host -= size(v, 0)

    for i, (kind, target) in enumerate(program):
        if i == backward_start:
            kept = frozenset(live)
            for v in arriving:
                live.add(v)
                now += size(v, 0)
                if record:
                    opens(v, i - 1)
            b_start = now
        if kind == RUN:
            op = ops[target]
            start = time
            if ready:
                for v in op.inputs:
                    if v in ready:
                        start = max(start, ready.pop(v))
            if releasing:
                release(start, i)
            for v in op.inputs:
                if v not in live and v in sizes:
                    where = ", parked on the host and not prefetched" if v in parked else ""
                    raise InvalidPlan(
                        f"step {i}: {op_name(target)} reads {value_name(v)}, which is not "
                        f"live{where}"
                    )
            for v in op.outputs:
                if v in live or v in parked:
                    where = "parked on the host" if v in parked else "still live"
                    raise InvalidPlan(
                        f"step {i}: {op_name(target)} recomputes {value_name(v)}, {where}"
                    )
                live.add(v)
                now += size(v, 0)
                if record:
                    opens(v, i)
            if target in ran:
                recomputed += 1
            ran.add(target)
            if record:
                op_steps.setdefault(target, []).append(i)
            waited = start - time
            stall += waited
            if record and waited > 0:
                waits.append((i, time, start))
            time = start + op.time
            if i < backward_start:
                f_time += op.time + waited
            else:
                b_time += op.time + waited
        elif kind == FREE:
            if target not in live:
                where = ", it is parked on the host" if target in parked else ""
                raise InvalidPlan(f"step {i}: frees {value_name(target)}, which is not live{where}")
            if target in final:
                raise InvalidPlan(f"step {i}: frees {value_name(target)}, an output of the step")
            live.discard(target)
            ready.pop(target, None)
            now -= size(target, 0)
            if record:
                closes(target, i)
        elif kind == OFFLOAD or kind == PREFETCH:
            if link is None:
                raise InvalidPlan(f"step {i}: a {kind} needs a host link to time it")
            nbytes = size(target, 0)
            if kind == OFFLOAD:
                if target not in live or target not in sizes:
                    raise InvalidPlan(
                        f"step {i}: offloads {value_name(target)}, which is not live on the device"
                    )
                if target in final:
                    raise InvalidPlan(
                        f"step {i}: offloads {value_name(target)}, an output of the step"
                    )
                start = max(lane, time, ready.pop(target, 0.0))
                lane = start + nbytes / link.d2h
                live.discard(target)
                parked.add(target)
                sent.add(target)
                host += nbytes
                if record:
                    leaving.setdefault(target, []).append(opened.pop(target))
            else:
                if target not in parked:
                    why = "was prefetched already" if target in sent else "was never offloaded"
                    raise InvalidPlan(f"step {i}: prefetches {value_name(target)}, which {why}")
                start = max(lane, time)
                lane = start + nbytes / link.h2d
                parked.discard(target)
                live.add(target)
                ready[target] = lane
                now += nbytes
                if record:
                    opens(target, i)
            releasing.append((lane, len(transfers), target))
            transfers.append(Transfer(kind, target, i, start, lane, -1))
            if host > host_peak:
                host_peak = host
        else:
            raise InvalidPlan(f"step {i}: unknown instruction {kind!r}")
        if i < backward_start:
            if now > f_peak:
                f_peak = now
        elif now > b_peak:
            b_peak = now
        if now > peak:
            peak, peak_step = now, i
        if record:
            columns.append(tuple(totals))
            host_steps.append(host)
    if kept is None:  # no backward instruction
        kept = frozenset(live)
        b_start = now + sum(sizes.get(v, 0) for v in arriving)
        live.update(arriving)
    if record:
        for v, start_step in opened.items():
            intervals.setdefault(v, []).append((start_step, len(program)))
        for v, starts in leaving.items():
            intervals.setdefault(v, []).extend((first, len(program)) for first in starts)
    return Walk(
        max(peak, b_start),
        peak_step,
        f_peak,
        max(b_peak, b_start),
        b_start,
        kept,
        max(time, lane),
        f_time,
        b_time + max(0.0, lane - time),
        recomputed,
        stall,
        host_peak,
        transfers,
        columns,
        intervals,
        op_steps,
        host_steps,
        waits,
    )


# --------------------------------------------------------------------------- ops over values


@dataclass(frozen=True)
class DagOp:
    inputs: tuple[int, ...]
    outputs: tuple[int, ...]
    time: float
    backward: bool


@dataclass
class Dag:
    """Ops over values: forward ops first in run order, then backward ops in run order.

    Values missing from `sizes` are external (parameters, inputs, values owned by someone
    else): always available, never counted. `arriving` values (gradients from later blocks)
    become live when the backward starts; `final` values must be live at the end.
    """

    ops: list[DagOp]
    sizes: dict[int, int]
    arriving: frozenset[int] = frozenset()
    final: frozenset[int] = frozenset()
    held: frozenset[int] = frozenset()  # forward values live until the forward ends (outputs)
    order: list[int] = field(default_factory=list)  # position -> op index in the graph

    @property
    def n_forward(self) -> int:
        return sum(not op.backward for op in self.ops)


@dataclass(frozen=True)
class Simulated:
    """A run list over a Dag (op positions, its forward first) with its exact figures."""

    runs: tuple[int, ...]
    stats: Walk

    @property
    def time(self) -> float:
        return self.stats.forward_time + self.stats.backward_time


def simulate_runs(dag: Dag, runs: Sequence[int], n_forward: int) -> Walk:
    """Walk the runs under free-after-last-read (`program_from_runs`); InvalidPlan (a
    ValueError) when a run reads a value that is not live."""
    program, start = program_from_runs(dag.ops, runs, n_forward, dag.final, dag.held, dag.arriving)
    return walk(dag.ops, program, start, dag.sizes, arriving=dag.arriving, final=dag.final)


def simulated(dag: Dag, runs: Sequence[int]) -> Simulated:
    """`simulate_runs` on the Dag's forward split."""
    return Simulated(tuple(runs), simulate_runs(dag, runs, dag.n_forward))


def kept_bytes(dag: Dag, option: Simulated) -> int:
    """Bytes the forward leaves live for the backward."""
    return sum(dag.sizes.get(v, 0) for v in option.stats.kept)


def graph_dag(graph: Graph) -> Dag:
    """The whole traced step as a Dag (placeholders external, final values required)."""
    ops = [DagOp(op.inputs, op.outputs, op.time, op.phase == "backward") for op in graph.ops]
    order = graph.forward_ops + graph.backward_ops
    sizes = {v.index: v.nbytes for v in graph.values if not v.is_placeholder}
    outs = {
        v
        for v in graph.final_values
        if (p := graph.values[v].producer) is not None and graph.ops[p].phase == "forward"
    }
    return Dag(
        [ops[o] for o in order], sizes, final=graph.final_values, held=frozenset(outs), order=order
    )


# --------------------------------------------------------------------------- a traced step


COLUMNS = ("activation", "temporary", "gradient")  # the kinds of value a budget counts


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
    _check_rules(graph, program, backward_start)
    column = {v.index: COLUMNS.index(v.kind) for v in values if v.kind in COLUMNS}
    sizes, initial, arriving = _step_values(graph)
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
    slots = host_layout(walked.transfers, sizes, len(program))
    offloads = [t for t in walked.transfers if t.kind == OFFLOAD]
    return Simulation(
        timeline,
        walked.peak,
        walked.peak_step,
        walked.time,
        walked.recomputed_ops,
        backward_start,
        walked.intervals,
        walked.op_steps,
        {o: ops[o].outputs for o in graph.forward_ops},
        walked.stall,
        walked.transfers,
        walked.host,
        walked.host_peak,
        slots,
        max((slots[t.step] + sizes[t.value] for t in offloads), default=0),
        walked.waits,
    )


def walk_step(
    graph: Graph, program: Sequence[Instruction], backward_start: int, link: Link | None = None
) -> Walk:
    """`walk` a program over a traced step, recording nothing: what searches compare."""
    sizes, initial, arriving = _step_values(graph)
    return walk(
        graph.ops, program, backward_start, sizes, initial, arriving, graph.final_values, link=link
    )


class StepRuns:
    """The peak and time that `walk_step` finds for the program of a run list under
    free-after-last-read (`program_from_runs` with the step's final values), computed with
    numpy without building the program: what a search comparing many run lists reads (Rotor
    walks about ten schedules of thousands of runs per budget). It checks nothing (a run that
    reads a value not live goes unnoticed), so walk the program a search picks.

    Each production of a value is live from its run to its last read before the value is
    produced again (its own run when unread; the end for a final value's last production),
    so the bytes live after each run are a sum over intervals; frees only lower them."""

    def __init__(self, graph: Graph) -> None:
        sizes, _, arriving = _step_values(graph)
        ops = graph.ops
        self._outputs = _Ragged([op.outputs for op in ops])
        self._inputs = _Ragged([op.inputs for op in ops])
        self._time = np.array([op.time for op in ops], dtype=np.float64)
        self._size = np.zeros(len(graph.values), dtype=np.int64)
        self._size[list(sizes)] = list(sizes.values())
        self._final = np.zeros(len(graph.values), dtype=bool)
        self._final[list(graph.final_values)] = True
        self._arriving = int(self._size[arriving].sum())  # live from the backward's start

    def figures(self, runs: Sequence[int], n_forward: int) -> tuple[int, float]:
        """(peak bytes, seconds) of the runs, the first `n_forward` of them the forward."""
        ran = np.asarray(runs, dtype=np.int64)
        n = len(ran)
        made_at, made = self._outputs.gather(ran)
        read_at, read = self._inputs.gather(ran)
        # productions in (value, position) order; a read belongs to the latest production
        # of its value before it (none: a placeholder, or a value produced elsewhere)
        order = np.argsort(made * (n + 1) + made_at, kind="stable")
        made, made_at = made[order], made_at[order]
        keys = made * (n + 1) + made_at
        which = np.searchsorted(keys, read * (n + 1) + read_at) - 1
        ok = which >= 0
        ok[ok] = made[which[ok]] == read[ok]
        until = made_at.copy()
        np.maximum.at(until, which[ok], read_at[ok])
        last = np.ones(len(made), dtype=bool)
        last[:-1] = made[1:] != made[:-1]
        until[last & self._final[made]] = n  # never freed
        size = self._size[made]
        change = np.zeros(n + 2, dtype=np.int64)
        np.add.at(change, made_at, size)
        np.add.at(change, until + 1, -size)
        change[n_forward] += self._arriving
        live = np.cumsum(change[:n])  # bytes live after each run, before its frees
        start = self._arriving + int(size[(made_at < n_forward) & (until >= n_forward)].sum())
        peak = max(int(live.max()) if n else 0, start)
        time = float(np.cumsum(self._time[ran])[-1]) if n else 0.0  # in order, as walk adds
        return peak, time


class _Ragged:
    """Per-op tuples of values, flattened: gathers the values of a run list with positions."""

    def __init__(self, rows: Sequence[tuple[int, ...]]) -> None:
        self.count = np.array([len(r) for r in rows], dtype=np.int64)
        self.begin = np.concatenate(([0], np.cumsum(self.count)[:-1])).astype(np.int64)
        self.flat = np.array([v for r in rows for v in r], dtype=np.int64)

    def gather(self, ran: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(position in `ran`, value) of every value the runs' rows hold, in run order."""
        count = self.count[ran]
        at = np.repeat(np.arange(len(ran), dtype=np.int64), count)
        ends = np.cumsum(count)
        offset = np.repeat(self.begin[ran] - (ends - count), count)
        return at, self.flat[offset + np.arange(int(ends[-1]) if len(ends) else 0)]


def _step_values(graph: Graph) -> tuple[dict[int, int], list[int], list[int]]:
    """The step's sizes (0 for what a budget does not count), initial and arriving values."""
    values = graph.values
    sizes = {v.index: (v.nbytes if v.kind in COLUMNS else 0) for v in values}
    initial = [v.index for v in values if v.is_placeholder and v.kind != "tangent"]
    return sizes, initial, [v.index for v in values if v.kind == "tangent"]


def _check_rules(graph: Graph, program: Sequence[Instruction], backward_start: int) -> None:
    """The rules of a traced step that liveness does not cover: backward ops run in the
    backward, random and state-updating ops first run in the forward in traced order, only
    activations, temporaries and gradients are freed, every op runs."""
    values, ops = graph.values, graph.ops
    sticky = iter(o.index for o in ops if o.random or o.state_update)
    expected = next(sticky, None)
    done: set[int] = set()
    for i, (kind, target) in enumerate(program):
        if kind == RUN:
            op = ops[target]
            if op.phase == "backward" and i < backward_start:
                raise InvalidPlan(f"step {i}: backward op {op.name} runs in the forward pass")
            if target not in done and target == expected:
                if i >= backward_start:
                    raise InvalidPlan(
                        f"step {i}: {op.name} (random or state update) must first run in forward"
                    )
                expected = next(sticky, None)
            elif target not in done and (op.random or op.state_update):
                raise InvalidPlan(f"step {i}: random/state op {op.name} runs out of traced order")
            done.add(target)
        elif kind != RUN and values[target].kind not in COLUMNS:
            raise InvalidPlan(
                f"step {i}: {_VERBS[kind]} {values[target].name}, which is not a live activation"
            )
    never = [op.name for op in ops if op.index not in done]
    if never:
        raise InvalidPlan(f"ops never run: {never[:5]}{'...' if len(never) > 5 else ''}")


def store_all_program(graph: Graph) -> tuple[list[Instruction], int]:
    """Plain PyTorch: every op once, forward then backward, each value freed after its last
    use. Returns the program and its backward start."""
    return program_from_runs(
        graph.ops,
        graph.forward_ops + graph.backward_ops,
        len(graph.forward_ops),
        graph.final_values,
    )


class TransferProbe:
    """The peak and time `walk_step` finds for a program (runs, frees and transfers, each value
    offloaded at most once and prefetched at most once after) with one more value's transfer
    pair inserted, computed with numpy without building or walking the new program: what the
    greedy offload pass reads for each of its candidates (thousands per solve). It checks
    nothing, so walk the program a search picks.

    Memory is the program's with every transfer a no-op (each value live from its run to its
    free), less each offloaded value's bytes from the run its copy is released before, plus
    them again from its prefetch. Time follows the two lanes: runs add up in order (as `walk`
    adds them) except where a run waits for a prefetched input; the transfer lane is replayed
    copy by copy."""

    def __init__(
        self, graph: Graph, program: Sequence[Instruction], backward_start: int, link: Link
    ) -> None:
        sizes, _, arriving = _step_values(graph)
        ops = graph.ops
        n = len(program)
        delta = np.zeros(n, dtype=np.int64)  # bytes each step adds, every transfer a no-op
        times = np.zeros(n, dtype=np.float64)  # each run's seconds, 0 for the other steps
        is_run = np.zeros(n, dtype=bool)
        rows: list[tuple[int, bool, int, float, int]] = []  # see `_Transfers`
        waiting: dict[int, int] = {}  # prefetched value -> its row, until a run reads it
        sent: set[int] = set()
        for i, (kind, target) in enumerate(program):
            if kind == RUN:
                op = ops[target]
                delta[i] = sum(sizes.get(v, 0) for v in op.outputs)
                times[i], is_run[i] = op.time, True
                for v in op.inputs:
                    k = waiting.pop(v, None)
                    if k is not None:
                        rows[k] = (*rows[k][:4], i)
            elif kind == FREE:
                delta[i] = -sizes.get(target, 0)
                waiting.pop(target, None)
            else:
                nbytes = sizes.get(target, 0)
                if kind == OFFLOAD:
                    if target in sent:
                        raise ValueError(f"value {target} is offloaded twice: walk the program")
                    sent.add(target)
                    waiting.pop(target, None)
                    rows.append((i, True, nbytes, nbytes / link.d2h, -1))
                else:
                    waiting[target] = len(rows)
                    rows.append((i, False, nbytes, nbytes / link.h2d, -1))
        self._link, self._sizes = link, sizes
        self._arriving = sum(sizes.get(v, 0) for v in arriving)  # live from the backward's start
        if backward_start < n:
            delta[backward_start] += self._arriving
        self._start, self._delta, self._times = backward_start, delta, times
        self._runs = np.flatnonzero(is_run)
        self._transfers = _Transfers.of(rows)

    def figures(self, v: int, last: int, at: int, reader: int) -> tuple[int, float]:
        """(peak bytes, seconds) of the program with `offload v` after step `last` and
        `prefetch v` before step `at` (`last` < `at` <= `reader`, the first run that reads v
        after `at`): `core.solvers.offload.with_transfer`'s program."""
        return self.inserted(v, last, at, reader)._figures()

    def inserted(self, v: int, last: int, at: int, reader: int) -> TransferProbe:
        """The probe of that program (what `figures` reads), for the next insertion."""
        out = TransferProbe.__new__(TransferProbe)
        out._link, out._sizes, out._arriving = self._link, self._sizes, self._arriving
        out._start = self._start + 1 + (at <= self._start)
        out._delta = _paired(self._delta, last, at, 0)
        out._times = _paired(self._times, last, at, 0.0)
        out._runs = _moved(self._runs, last, at)
        nbytes = self._sizes.get(v, 0)
        out._transfers = self._transfers.inserted(
            last,
            at,
            (last + 1, True, nbytes, nbytes / self._link.d2h, -1),
            (at + 1, False, nbytes, nbytes / self._link.h2d, reader + 2),
        )
        return out

    def _figures(self) -> tuple[int, float]:
        """(peak bytes, seconds) of this probe's program."""
        times, tr = self._times, self._transfers
        n = len(times)
        # the two lanes in program order: each copy starts when the lane is free and the runs
        # issued before it are done; a run reading a prefetched value waits for its copy
        clock = np.cumsum(times)  # end of the last run, after each step
        stalls: list[tuple[int, float]] = []  # (run step, when it starts after waiting)
        waits: list[tuple[int, float]] = []  # heap: (run step, when its prefetch is done)
        ends: list[float] = []
        lane = 0.0
        for step, seconds, read in zip(tr.step.tolist(), tr.seconds.tolist(), tr.reader.tolist()):
            while waits and waits[0][0] < step:
                _wait(*heapq.heappop(waits), clock, times, stalls)
            now = float(clock[step - 1]) if step > 0 else 0.0
            lane = (lane if lane > now else now) + seconds
            ends.append(lane)
            if read >= 0 and lane > float(clock[read - 1]):  # else the run never waits for it
                heapq.heappush(waits, (read, lane))
        while waits:
            _wait(*heapq.heappop(waits), clock, times, stalls)
        delta = self._delta.copy()
        runs = self._runs
        starts = np.concatenate(([0.0], clock[:-1]))
        for step, start in stalls:
            starts[step] = start
        first = starts[runs]  # nondecreasing: a run starts when the one before it ends, or later
        off = tr.offload
        # an offloaded storage goes before the first run after its offload that starts once
        # its copy is done; a prefetched one is back from its prefetch
        k = np.maximum(
            np.searchsorted(runs, tr.step[off], "right"),
            np.searchsorted(first, np.asarray(ends)[off]) if len(ends) else 0,
        )
        gone = k < len(runs)
        np.subtract.at(delta, runs[k[gone]], tr.nbytes[off][gone])
        np.add.at(delta, tr.step[~off], tr.nbytes[~off])
        live = np.cumsum(delta)
        start = min(self._start, n)
        b_start = (int(live[start - 1]) if start > 0 else 0) + self._arriving
        peak = max(int(live.max()) if n else 0, b_start, 0)
        return peak, max(float(clock[-1]) if n else 0.0, lane)


@dataclass(frozen=True)
class _Transfers:
    """A program's transfers in program order, as arrays: step, whether an offload (else a
    prefetch), bytes, seconds on the lane, and the run that waits for it (a prefetch's first
    reader after it; -1: none)."""

    step: np.ndarray
    offload: np.ndarray
    nbytes: np.ndarray
    seconds: np.ndarray
    reader: np.ndarray

    @staticmethod
    def of(rows: Sequence[tuple[int, bool, int, float, int]]) -> _Transfers:
        rows = sorted(rows)
        cols = list(zip(*rows)) if rows else [(), (), (), (), ()]
        return _Transfers(
            np.array(cols[0], dtype=np.int64),
            np.array(cols[1], dtype=bool),
            np.array(cols[2], dtype=np.int64),
            np.array(cols[3], dtype=np.float64),
            np.array(cols[4], dtype=np.int64),
        )

    def inserted(
        self,
        last: int,
        at: int,
        off: tuple[int, bool, int, float, int],
        pre: tuple[int, bool, int, float, int],
    ) -> _Transfers:
        """These transfers once a step is inserted after `last` and another before `at`, with
        the transfers `off` and `pre` of those two steps."""
        step = _moved(self.step, last, at)
        i, j = np.searchsorted(step, [off[0], pre[0]]).tolist()
        reader = np.where(self.reader >= 0, _moved(self.reader, last, at), -1)

        def two(a: np.ndarray, x: float, y: float) -> np.ndarray:
            x_, y_ = np.array([x], dtype=a.dtype), np.array([y], dtype=a.dtype)
            return np.concatenate((a[:i], x_, a[i:j], y_, a[j:]))

        return _Transfers(
            *(
                two(a, x, y)
                for a, x, y in zip(
                    (step, self.offload, self.nbytes, self.seconds, reader), off, pre
                )
            )
        )


def _moved(steps: np.ndarray, last: int, at: int) -> np.ndarray:
    """Steps of a program once a step is inserted after `last` and another before `at`."""
    return steps + (steps > last) + (steps >= at)


def _paired(a: np.ndarray, last: int, at: int, fill: float) -> np.ndarray:
    """Per-step `a` once `fill` is inserted after step `last` and before step `at`."""
    one = np.array([fill], dtype=a.dtype)
    return np.concatenate((a[: last + 1], one, a[last + 1 : at], one, a[at:]))


def _wait(
    step: int, ready: float, clock: np.ndarray, times: np.ndarray, stalls: list[tuple[int, float]]
) -> None:
    """Run `step` waits until `ready` (a prefetched input is in) when that is later than the
    run before it ends: every later end moves, summed on from there as `walk` adds them."""
    before = float(clock[step - 1]) if step > 0 else 0.0
    if ready <= before:
        return
    if stalls and stalls[-1][0] == step:  # a second prefetch this run waits for
        if ready <= stalls[-1][1]:
            return
        stalls.pop()
    clock[step:] = np.cumsum(np.concatenate(([ready], times[step:])))[1:]
    stalls.append((step, ready))
