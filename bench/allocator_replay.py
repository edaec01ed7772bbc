"""The CUDA caching allocator's rules replayed over a traced step: how much it reserves.

A GPU table that counts reserved memory (`torch.cuda.max_memory_reserved`, or NVML's used
memory) counts the segments the caching allocator took from `cudaMalloc`, not the blocks it
handed out. This replays its rules (c10/cuda/CUDACachingAllocator.cpp, default settings: no
`max_split_size_mb`, no expandable segments) over a plan's order of allocations and frees:

- a request is rounded up to a multiple of 512 B; up to 1 MiB it goes to the small pool,
  above to the large pool;
- it takes the smallest cached free block of its pool that fits (best fit); with none, a new
  segment: 2 MiB for a small request, 20 MiB for one under 10 MiB, else the request rounded
  up to 2 MiB;
- the block is split when the remainder is at least 512 B (small pool) or over 1 MiB
  (large pool); a freed block merges with free neighbours of its segment; nothing is ever
  returned to the device.

`replay_step` runs the step as a training loop does: the parameters allocated first, the
first iteration's gradients kept as `.grad`, AdamW's two moments per parameter made after
it (each update's `denom` a temporary), then more iterations whose gradients are added into
`.grad` and freed. It is an ideal replay: frees in the plan's order (at last use), no
kernel workspaces, one stream. `python -m bench.allocator_replay ROW` prints it for a row of
`bench.gpu_tables.ROWS`.
"""

from __future__ import annotations

import argparse
import bisect
import itertools
from collections.abc import Sequence
from dataclasses import dataclass

from core import Problem, Simulation

MIN_BLOCK = 512  # kMinBlockSize
SMALL = 1 << 20  # kSmallSize: the small pool's largest request
SMALL_SEGMENT = 2 << 20  # kSmallBuffer
LARGE_SEGMENT = 20 << 20  # kLargeBuffer, for requests under MIN_LARGE_ALLOC
MIN_LARGE_ALLOC = 10 << 20  # kMinLargeAlloc
ROUND_LARGE = 2 << 20  # kRoundLarge


class Block:
    """A block of a segment: handed out or cached free."""

    __slots__ = ("addr", "size", "small", "free", "prev", "next")

    def __init__(self, addr: int, size: int, small: bool) -> None:
        self.addr, self.size, self.small, self.free = addr, size, small, True
        self.prev: Block | None = None
        self.next: Block | None = None


class CachingAllocator:
    """One device's caching allocator, one stream: `malloc`, `free`, and what it holds."""

    def __init__(self) -> None:
        self._pools: dict[bool, list[tuple[int, int, Block]]] = {True: [], False: []}
        self._base = 0  # next segment's address
        self.allocated = self.reserved = self.peak_allocated = self.peak_reserved = 0
        self.segments = 0

    def malloc(self, nbytes: int) -> Block:
        """A block for a request of `nbytes`."""
        size = max(MIN_BLOCK, -(-nbytes // MIN_BLOCK) * MIN_BLOCK)
        small = size <= SMALL
        pool = self._pools[small]
        i = bisect.bisect_left(pool, (size, -1))
        if i < len(pool):
            block = pool.pop(i)[2]
        else:
            block = self._segment(size, small)
        rest = block.size - size
        if (rest >= MIN_BLOCK) if small else (rest > SMALL):
            tail = Block(block.addr + size, rest, small)
            tail.prev, tail.next = block, block.next
            if block.next is not None:
                block.next.prev = tail
            block.next, block.size = tail, size
            self._cache(tail)
        block.free = False
        self.allocated += block.size
        self.peak_allocated = max(self.peak_allocated, self.allocated)
        return block

    def free(self, block: Block) -> None:
        """Return `block` to its pool, merged with its free neighbours."""
        block.free = True
        self.allocated -= block.size
        prev, nxt = block.prev, block.next
        if prev is not None and prev.free:
            self._uncache(prev)
            prev.size += block.size
            prev.next = block.next
            if block.next is not None:
                block.next.prev = prev
            block = prev
        if nxt is not None and nxt.free:
            self._uncache(nxt)
            block.size += nxt.size
            block.next = nxt.next
            if nxt.next is not None:
                nxt.next.prev = block
        self._cache(block)

    def _segment(self, size: int, small: bool) -> Block:
        if small:
            total = SMALL_SEGMENT
        elif size < MIN_LARGE_ALLOC:
            total = LARGE_SEGMENT
        else:
            total = -(-size // ROUND_LARGE) * ROUND_LARGE
        block = Block(self._base, total, small)
        self._base += total
        self.segments += 1
        self.reserved += total
        self.peak_reserved = max(self.peak_reserved, self.reserved)
        return block

    def _cache(self, block: Block) -> None:
        bisect.insort(self._pools[block.small], (block.size, block.addr, block))

    def _uncache(self, block: Block) -> None:
        pool = self._pools[block.small]
        i = bisect.bisect_left(pool, (block.size, block.addr))
        assert pool[i][2] is block
        pool.pop(i)


@dataclass(frozen=True)
class Replay:
    """The peaks of a replayed training loop, bytes."""

    peak_allocated: int
    peak_reserved: int
    segments: int

    @property
    def cached(self) -> int:
        """What the allocator reserved beyond its peak of handed-out blocks."""
        return self.peak_reserved - self.peak_allocated


def replay_step(
    problem: Problem, simulation: Simulation, iterations: int = 3, adamw: bool = True
) -> Replay:
    """The allocator over `iterations` steps of `simulation` (see the module docstring)."""
    graph = problem.graph
    allocator = CachingAllocator()
    params = [value.nbytes for value in graph.values if value.kind == "param"]
    for value in graph.values:
        if value.kind in ("param", "state", "constant"):
            allocator.malloc(value.nbytes)
    starts: dict[int, list[int]] = {}
    stops: dict[int, list[int]] = {}
    for v, spans in simulation.intervals.items():
        if graph.values[v].is_placeholder:
            continue
        for start, stop in spans:
            starts.setdefault(start, []).append(v)
            stops.setdefault(stop, []).append(v)
    inputs = [value.nbytes for value in graph.values if value.kind == "input"]
    first = True
    for _ in range(iterations):
        held = [allocator.malloc(n) for n in inputs]
        live: dict[int, Block] = {}
        for i in range(len(simulation.timeline)):
            for v in stops.get(i, []):
                if v in live:
                    allocator.free(live.pop(v))
            for v in starts.get(i, []):
                if v in live:
                    continue
                block = allocator.malloc(graph.values[v].nbytes)
                if graph.values[v].kind != "gradient":
                    live[v] = block
                elif not first:  # added into .grad, then freed
                    allocator.free(block)
        for block in itertools.chain(live.values(), held):
            allocator.free(block)
        if adamw:
            if first:
                for n in params:  # exp_avg, exp_avg_sq
                    allocator.malloc(n)
                    allocator.malloc(n)
            denom: Block | None = None
            for n in params:
                new = allocator.malloc(n)
                if denom is not None:
                    allocator.free(denom)
                denom = new
            if denom is not None:
                allocator.free(denom)
        first = False
    return Replay(allocator.peak_allocated, allocator.peak_reserved, allocator.segments)


def main(argv: Sequence[str] | None = None) -> int:
    """`python -m bench.allocator_replay ROW`: the replay of a table row's step."""
    from bench import gpu_tables

    p = argparse.ArgumentParser(prog="python -m bench.allocator_replay", description=__doc__)
    p.add_argument("row", help="a row's label in bench.gpu_tables.ROWS, e.g. 'vanilla, batch 4'")
    args = p.parse_args(list(argv) if argv is not None else None)
    rows = [r for r in gpu_tables.ROWS if r.label == args.row and r.strategy != "none"]
    if not rows:
        p.error(f"no row with a step is labelled {args.row!r}")
    row = rows[0]
    case = row.build()
    problem = gpu_tables.analyze_row(row, case)
    simulation = gpu_tables.strategy_plan(problem, row.strategy, case.model).simulate()
    r = replay_step(problem, simulation)
    print(
        f"{row.label}: peak allocated {r.peak_allocated / 1e9:.3f} GB, peak reserved "
        f"{r.peak_reserved / 1e9:.3f} GB, cached {r.cached / 1e9:.3f} GB, "
        f"{r.segments} segments"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
