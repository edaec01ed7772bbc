"""Memory layout: an address for every storage a plan allocates, in one arena.

The simulator's peak counts live bytes; an allocator needs a contiguous address range for each
storage, and when the holes freed storages leave are too small for the next one, it needs more
than the live peak. `arena(plan)` assigns every storage an offset in one arena, as a static
allocator would, so the plan predicts the arena size too; arena size over live peak is the
plan's fragmentation (1.0: none).

Offsets come from the greedy-by-size assignment of TensorFlow Lite's arena planner (also the
baseline of OLLA): the largest storages first, each at the lowest-waste gap among the storages
whose lifetimes overlap its own (best fit), else on top of them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from core.graph import Graph
from core.plan import Plan
from core.simulator import OFFLOAD, PREFETCH, RUN, Step, Transfer


@dataclass(frozen=True)
class Placement:
    """One storage's copy in the arena: bytes [offset, offset + size) during steps first..last."""

    value: int
    offset: int
    size: int
    first: int  # the step that allocates it (a run)
    last: int  # the last step it is live (the step before its free, or the program's end)


@dataclass
class Arena:
    """Every storage's place; `size` is the arena a static allocator needs for the plan."""

    placements: list[Placement]
    size: int
    live_peak: int  # the simulator's peak: the most bytes live at one step

    @property
    def fragmentation(self) -> float:
        """Arena size over live peak: 1.0 when no byte of the arena is ever wasted."""
        return self.size / self.live_peak if self.live_peak else 1.0


def lifetimes(
    graph: Graph, timeline: Sequence[Step], transfers: Sequence[Transfer] = ()
) -> list[tuple[int, int, int, int]]:
    """(value, bytes, first step, last step) of every storage copy the timeline allocates: a
    prefetch allocates one, an offloaded copy lives until its copy out is done (`transfers`)."""
    end = len(timeline) - 1
    released = {t.step: t.release - 1 if t.release >= 0 else end for t in transfers}
    start: dict[int, int] = {}
    out = []
    for step in timeline:
        if step.kind == RUN:
            for v in graph.ops[step.target].outputs:
                start[v] = step.index
        elif step.kind == PREFETCH:
            start[step.target] = step.index
        else:
            v = step.target
            last = released[step.index] if step.kind == OFFLOAD else step.index - 1
            out.append((v, graph.values[v].nbytes, start.pop(v), last))
    out += [(v, graph.values[v].nbytes, first, end) for v, first in start.items()]
    return [item for item in out if item[1] > 0]


def assign_offsets(
    items: Sequence[tuple[int, int, int, int]], alignment: int = 1
) -> list[Placement]:
    """Greedy by size with best fit: (value, bytes, first, last) -> placements that never
    overlap in address while they overlap in time. Sizes are rounded up to `alignment`."""
    order = sorted(range(len(items)), key=lambda i: (-items[i][1], items[i][2], i))
    firsts = np.array([it[2] for it in items], dtype=np.int64)
    lasts = np.array([it[3] for it in items], dtype=np.int64)
    sizes = np.array([-(-it[1] // alignment) * alignment for it in items], dtype=np.int64)
    offsets = np.zeros(len(items), dtype=np.int64)
    placed = np.zeros(len(items), dtype=bool)
    for i in order:
        clash = placed & (firsts <= lasts[i]) & (lasts >= firsts[i])
        others = np.flatnonzero(clash)
        others = others[np.argsort(offsets[others], kind="stable")]
        # the gap below each storage live at the same time, lowest first: from the highest end
        # of those below it to its offset
        ends = np.maximum.accumulate(offsets[others] + sizes[others])
        below = np.concatenate(([0], ends[:-1]))
        waste = offsets[others] - below - sizes[i]
        fits = np.flatnonzero(waste >= 0)
        if fits.size:  # best fit: the gap that wastes least, the lowest of equals
            offsets[i] = below[fits[np.argmin(waste[fits])]]
        else:
            offsets[i] = ends[-1] if ends.size else 0
        placed[i] = True
    return [
        Placement(v, int(offsets[i]), int(sizes[i]), first, last)
        for i, (v, _, first, last) in enumerate(items)
    ]


def arena(plan: Plan, alignment: int = 1) -> Arena:
    """The plan's storages laid out in one arena (see the module docstring)."""
    sim = plan.simulate()
    graph = plan.problem.graph
    placements = assign_offsets(lifetimes(graph, sim.timeline, sim.transfers), alignment)
    size = max((p.offset + p.size for p in placements), default=0)
    return Arena(placements, size, sim.peak)
