"""The walker: the one place that says what a program does to memory, and when.

Each instruction kind has one handler here; a new kind is a new handler and a new constant in
`core.simulator.program`, not a second simulator. Runs and frees are handled inline in one loop
(the solvers' searches walk thousands of programs); transfers go to a `_Lane`. A recorded walk
reports to a `Recording` at fixed points (each step done, the backward's start, a copy out
released, a run that waited); a walk that records nothing has no recorder and skips them.

Time runs on two lanes: compute (runs, one after another) and transfer (offloads and
prefetches, one after another, at the host link's bandwidth). A transfer starts when the lane
is free and the compute issued so far is done; a run that reads a prefetched value waits for
its copy (a stall, counted in the predicted time). An offloaded storage stays on the device
until its copy is done: it is released before the first run that starts after that, and a
prefetched value's host copy likewise once its copy back is done.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

from core.errors import InvalidPlan
from core.simulator.program import FREE, OFFLOAD, PREFETCH, RUN, Instruction, Link, OpLike


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
    # recorded walks only (record=True), from their `Recording`:
    columns: list[tuple[int, ...]] = field(default_factory=list)  # live bytes per column, per step
    intervals: dict[int, list[tuple[int, int]]] = field(
        default_factory=dict
    )  # value -> [start, end)
    op_steps: dict[int, list[int]] = field(default_factory=dict)  # op -> steps that run it
    host: list[int] = field(default_factory=list)  # host bytes after each step
    waits: list[tuple[int, float, float]] = field(default_factory=list)  # (run step, from, to)


class Recording:
    """What a recorded walk keeps, reported by the walk at fixed points: live bytes per column
    after each step, each value's live intervals, the steps that run each op, the host bytes
    after each step and the runs that waited for a prefetch (what the timeline draws)."""

    def __init__(
        self,
        ops: Sequence[OpLike],
        sizes: dict[int, int],
        column: dict[int, int] | None,
        initial: Iterable[int],
    ) -> None:
        self._ops, self._sizes, self._column = ops, sizes, column or {}
        self._totals = [0] * (1 + max(column.values(), default=0) if column else 1)
        self._opened: dict[int, int] = dict.fromkeys(initial, -1)  # live value -> first step
        self._leaving: dict[int, list[int]] = {}  # offloaded value -> its leaving copies' starts
        self.columns: list[tuple[int, ...]] = []
        self.intervals: dict[int, list[tuple[int, int]]] = {}
        self.op_steps: dict[int, list[int]] = {}
        self.host: list[int] = []
        self.waits: list[tuple[int, float, float]] = []

    def _open(self, v: int, step: int) -> None:
        self._opened[v] = step
        self._totals[self._column.get(v, 0)] += self._sizes.get(v, 0)

    def _close(self, start: int, v: int, step: int) -> None:
        self.intervals.setdefault(v, []).append((start, step))
        self._totals[self._column.get(v, 0)] -= self._sizes.get(v, 0)

    def arrived(self, values: Iterable[int], step: int) -> None:
        """`values` become live when the backward starts (after step `step`)."""
        for v in values:
            self._open(v, step)

    def step(self, i: int, kind: str, target: int, host: int) -> None:
        """Instruction `i` is done, with `host` bytes parked on the host after it."""
        if kind == RUN:
            for v in self._ops[target].outputs:
                self._open(v, i)
            self.op_steps.setdefault(target, []).append(i)
        elif kind == FREE:
            self._close(self._opened.pop(target), target, i)
        elif kind == OFFLOAD:  # its device storage stays until the copy is done: `released`
            self._leaving.setdefault(target, []).append(self._opened.pop(target))
        else:
            self._open(target, i)
        self.columns.append(tuple(self._totals))
        self.host.append(host)

    def released(self, v: int, step: int) -> None:
        """An offloaded storage of `v` leaves the device before run step `step` (the oldest
        leaving copy: one lane, copies done in order)."""
        self._close(self._leaving[v].pop(0), v, step)

    def waited(self, step: int, ready: float, start: float) -> None:
        """Run step `step`, ready at `ready` seconds, started at `start` (a prefetch's copy)."""
        self.waits.append((step, ready, start))

    def finish(self, n_steps: int) -> None:
        """The program is done: what is still live (or leaving) lives to its end."""
        for v, start in self._opened.items():
            self.intervals.setdefault(v, []).append((start, n_steps))
        for v, starts in self._leaving.items():
            self.intervals.setdefault(v, []).extend((first, n_steps) for first in starts)


class _Names:
    """Names of ops and values for error messages (indices when the walk has none)."""

    def __init__(self, ops: Sequence[str] | None, values: Sequence[str] | None) -> None:
        self._ops, self._values = ops, values

    def op(self, o: int) -> str:
        return self._ops[o] if self._ops else f"op {o}"

    def value(self, v: int) -> str:
        return self._values[v] if self._values else f"value {v}"

    def unread(self, i: int, o: int, v: int, parked: set[int]) -> InvalidPlan:
        """Step `i` runs op `o`, which reads `v`, not live."""
        where = ", parked on the host and not prefetched" if v in parked else ""
        return InvalidPlan(
            f"step {i}: {self.op(o)} reads {self.value(v)}, which is not live{where}"
        )

    def remade(self, i: int, o: int, v: int, parked: set[int]) -> InvalidPlan:
        """Step `i` runs op `o`, which makes `v`, still live or parked."""
        where = "parked on the host" if v in parked else "still live"
        return InvalidPlan(f"step {i}: {self.op(o)} recomputes {self.value(v)}, {where}")

    def unfreed(self, i: int, v: int, live: set[int], parked: set[int]) -> InvalidPlan:
        """Step `i` frees `v`, which is not live, or an output of the step."""
        if v in live:
            return InvalidPlan(f"step {i}: frees {self.value(v)}, an output of the step")
        where = ", it is parked on the host" if v in parked else ""
        return InvalidPlan(f"step {i}: frees {self.value(v)}, which is not live{where}")


class _Lane:
    """The transfer lane: its clock, the values parked on the host and the copies not yet
    done. The walk's loop reads `parked`, `ready` and `releasing` in place."""

    def __init__(
        self, link: Link | None, sizes: dict[int, int], recorder: Recording | None, names: _Names
    ) -> None:
        self.link, self.sizes, self.recorder, self.names = link, sizes, recorder, names
        self.clock = 0.0
        self.host = self.host_peak = 0
        self.parked: set[int] = set()  # on the host, not prefetched
        self.sent: set[int] = set()  # offloaded at least once
        self.ready: dict[int, float] = {}  # prefetched value -> when its copy is done
        self.releasing: list[tuple[float, int, int]] = []  # (copy done, transfer index, value)
        self.transfers: list[Transfer] = []

    def arrived(self, inputs: tuple[int, ...], start: float) -> float:
        """When a run reading `inputs`, ready at `start`, starts: once its prefetches are in."""
        ready = self.ready
        for v in inputs:
            if v in ready:
                start = max(start, ready.pop(v))
        return start

    def release(self, until: float, step: int) -> int:
        """Copies done by `until` (before run step `step`): offloaded device storages and
        prefetched host copies go. Returns the device bytes released."""
        done = [r for r in self.releasing if r[0] <= until]
        if not done:
            return 0
        self.releasing[:] = [r for r in self.releasing if r[0] > until]
        freed = 0
        for _, k, v in done:
            t = self.transfers[k]
            self.transfers[k] = Transfer(t.kind, t.value, t.step, t.start, t.end, step)
            if t.kind == OFFLOAD:
                freed += self.sizes.get(v, 0)
                if self.recorder:
                    self.recorder.released(v, step)
            else:
                self.host -= self.sizes.get(v, 0)
        return freed

    def copy(
        self,
        i: int,
        kind: str,
        target: int,
        live: set[int],
        final: frozenset[int],
        time: float,
    ) -> int:
        """Issue step `i`'s offload or prefetch of `target` once the runs issued so far are
        done (at `time`). Returns the device bytes it makes live now. Any other kind of
        instruction is refused here."""
        names = self.names
        if kind != OFFLOAD and kind != PREFETCH:
            raise InvalidPlan(f"step {i}: unknown instruction {kind!r}")
        if self.link is None:
            raise InvalidPlan(f"step {i}: a {kind} needs a host link to time it")
        nbytes = self.sizes.get(target, 0)
        if kind == OFFLOAD:
            if target not in live or target not in self.sizes:
                raise InvalidPlan(
                    f"step {i}: offloads {names.value(target)}, which is not live on the device"
                )
            if target in final:
                raise InvalidPlan(
                    f"step {i}: offloads {names.value(target)}, an output of the step"
                )
            start = max(self.clock, time, self.ready.pop(target, 0.0))
            self.clock = start + nbytes / self.link.d2h
            live.discard(target)
            self.parked.add(target)
            self.sent.add(target)
            self.host += nbytes
            added = 0
        else:
            if target not in self.parked:
                why = "was prefetched already" if target in self.sent else "was never offloaded"
                raise InvalidPlan(f"step {i}: prefetches {names.value(target)}, which {why}")
            start = max(self.clock, time)
            self.clock = start + nbytes / self.link.h2d
            self.parked.discard(target)
            live.add(target)
            self.ready[target] = self.clock
            added = nbytes
        self.releasing.append((self.clock, len(self.transfers), target))
        self.transfers.append(Transfer(kind, target, i, start, self.clock, -1))
        self.host_peak = max(self.host_peak, self.host)
        return added


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
    start; `final` ones may not be freed. With `record`, a `Recording` keeps live bytes per
    step split by `column` (value -> column index; all in one column when None), each value's
    live intervals, the steps that run each op, host bytes and stalls. `link` times the
    offloads and prefetches (see the module's docstring); a program with either needs one.

    Raises InvalidPlan when an op reads a tracked value that is not live (or is parked on the
    host and not prefetched), recomputes a value still live, a free drops a value not live
    or final, or a transfer moves a value that is not where it says."""
    initial = tuple(initial)
    recorder = Recording(ops, sizes, column, initial) if record else None
    lane = _Lane(link, sizes, recorder, _Names(op_names, value_names))
    return _walk(
        ops, program, backward_start, set(initial), tuple(arriving), frozenset(final), lane
    )


def _walk(
    ops: Sequence[OpLike],
    program: Sequence[Instruction],
    backward_start: int,
    live: set[int],
    arriving: tuple[int, ...],
    final: frozenset[int],
    lane: _Lane,
) -> Walk:
    """`walk`'s loop: runs and frees inline, transfers on `lane`, each step to its recorder."""
    sizes, names, recorder = lane.sizes, lane.names, lane.recorder
    size = sizes.get  # the solvers' searches walk thousands of programs: keep this loop lean
    parked, ready, releasing = lane.parked, lane.ready, lane.releasing
    now = f_peak = b_peak = b_start = peak = peak_step = n_runs = 0
    time = f_time = b_time = stall = 0.0
    ran: set[int] = set()
    kept: frozenset[int] | None = None
    for i, (kind, target) in enumerate(program):
        if i == backward_start:
            kept = frozenset(live)
            now = b_start = now + _arrive(live, arriving, size, recorder, i - 1)
        if kind == RUN:
            op = ops[target]
            start = lane.arrived(op.inputs, time) if ready else time
            if releasing:
                now -= lane.release(start, i)
            for v in op.inputs:
                if v not in live and v in sizes:
                    raise names.unread(i, target, v, parked)
            for v in op.outputs:
                if v in live or v in parked:
                    raise names.remade(i, target, v, parked)
                live.add(v)
                now += size(v, 0)
            n_runs += 1
            ran.add(target)
            waited = start - time
            stall += waited
            if recorder and waited > 0:
                recorder.waited(i, time, start)
            time = start + op.time
            if i < backward_start:
                f_time += op.time + waited
            else:
                b_time += op.time + waited
        elif kind == FREE:
            if target not in live or target in final:
                raise names.unfreed(i, target, live, parked)
            live.discard(target)
            ready.pop(target, None)
            now -= size(target, 0)
        else:
            now += lane.copy(i, kind, target, live, final, time)
        if i < backward_start:
            if now > f_peak:
                f_peak = now
        elif now > b_peak:
            b_peak = now
        if now > peak:
            peak, peak_step = now, i
        if recorder:
            recorder.step(i, kind, target, lane.host)
    if kept is None:  # no backward instruction
        kept, b_start = frozenset(live), now + sum(size(v, 0) for v in arriving)
    return Walk(
        peak=max(peak, b_start),
        peak_step=peak_step,
        forward_peak=f_peak,
        backward_peak=max(b_peak, b_start),
        backward_start_bytes=b_start,
        kept=kept,
        time=max(time, lane.clock),
        forward_time=f_time,
        backward_time=b_time + max(0.0, lane.clock - time),
        recomputed_ops=n_runs - len(ran),
        stall=stall,
        host_peak=lane.host_peak,
        transfers=lane.transfers,
        **_recorded(recorder, len(program)),
    )


def _arrive(
    live: set[int],
    arriving: tuple[int, ...],
    size: Callable[[int, int], int],
    recorder: Recording | None,
    step: int,
) -> int:
    """The backward starts after `step`: `arriving` values become live. Returns their bytes."""
    live.update(arriving)
    if recorder:
        recorder.arrived(arriving, step)
    return sum(size(v, 0) for v in arriving)


def _recorded(recorder: Recording | None, n_steps: int) -> dict:
    """The `Walk` fields a recorded walk fills in (none for a walk that records nothing)."""
    if recorder is None:
        return {}
    recorder.finish(n_steps)
    return {
        "columns": recorder.columns,
        "intervals": recorder.intervals,
        "op_steps": recorder.op_steps,
        "host": recorder.host,
        "waits": recorder.waits,
    }
