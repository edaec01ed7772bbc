"""Numpy fast paths: the peak and time `walk_step` would find, computed without building or
walking a program, for searches that compare thousands of candidates. They check nothing, so
a search walks the program it picks; tests hold each to `walk` on every candidate.

- `StepRuns`: the program of a run list (runs and frees, no transfers), for Rotor's probes.
- `TransferProbe`: a program with one more value's offload and prefetch inserted, for the
  greedy offload pass's tries.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from core.graph import Graph
from core.simulator.program import FREE, OFFLOAD, RUN, Instruction, Link, step_values


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
        sizes, _, arriving = step_values(graph)
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
        sizes, _, arriving = step_values(graph)
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
