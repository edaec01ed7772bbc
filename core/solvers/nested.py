"""Nested blocks: options for a block that is not a chain inside, from Rotor on its inner chain.

A block whose forward has long-range reads (a U-Net's skips from each encoder level to its
decoder level, a time embedding read by every residual block, two towers joined by one
head) has no single-value cut inside, so `core.blocks` keeps it whole and its options come
only from the keep-set search and a node-limited block ILP, which reach little on a big block.

Inside such a block every position between two forward ops is a cut whose crossing set is
the values produced before it and read after it (a skip is in every crossing set of its
span). Cutting at every such position (a segment per op; Rotor's table finds the groupings)
gives an inner chain of segments; each segment runs forward keeping everything its backward
reads (one store-all option, as in Rotor: segments do not get options of their own), and
Rotor's table over that chain (`core.solvers.rotor_table.compute_table`, crossing sets as outputs)
gives, for each inner budget, a schedule: a first sweep of forwards (each op once, in
order: the block's forward) and the backward with its recomputes (the block's backward).
Each schedule is simulated exactly on the block's Dag and becomes one more option, so the
level above ranks it by its true figures. The chain model counts a value carried through
several cuts once per kept checkpoint, which only overstates memory: the DP is a generator
of run lists, and the simulation is the judge.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from core.errors import InvalidPlan
from core.simulator import Dag, Simulated, simulated
from core.solvers.rotor_table import BlockOption, ChainBlock, compute_table, runs_of, sequence

MIN_FORWARD_OPS = 24  # smaller blocks: the keep-set search and the block ILP suffice
MAX_SEGMENTS = 96  # inner chain length: the table costs O(n^3) array operations
INNER_BUDGETS = 12  # inner budgets read from the table, minimum to store-all
SLOTS = 400


def nested_options(dag: Dag) -> list[Simulated]:
    """Options of a block from Rotor on its inner chain of segments (see the module
    docstring); none when the block is small or has fewer than three segments."""
    nf = dag.n_forward
    if nf < MIN_FORWARD_OPS:
        return []
    cuts = _cuts(dag)
    if len(cuts) < 2:
        return []
    bounds = [-1, *cuts, nf - 1]
    seg_of = [0] * len(dag.ops)
    for s in range(len(bounds) - 1):
        for i in range(bounds[s] + 1, bounds[s + 1] + 1):
            seg_of[i] = s
    _assign_backward(dag, seg_of, len(bounds) - 1)
    blocks, far = _inner_chain(dag, bounds, seg_of)
    total = max(1, sum(dag.sizes.values()))
    # The chain model counts a gradient read beyond the segment before as live to the end of
    # the step (`far`), which overstates memory a lot once there is a segment per op; the
    # parameter gradients (final) fill the backward's end, so a table counting them keeps
    # much in the forward while it has room early in the backward. A segment's option says
    # whether its backward reads its input and output; saying it reads both (Rotor's
    # persistent model) reaches lower on some blocks, higher on others. Each table gives
    # different schedules; the simulation ranks them.
    variants = []
    for chain in (blocks, [_persistent(b) for b in blocks]):
        variants.append(
            [dataclasses.replace(b, permanent=b.permanent + f) for b, f in zip(chain, far)]
        )
        variants += [chain, [dataclasses.replace(b, permanent=0) for b in chain]]
    found: dict[tuple[int, ...], Simulated] = {}
    for chain in variants:
        table = compute_table(chain, total, SLOTS)
        lowest = table.min_slots()
        if lowest is None:
            continue
        for m in np.unique(np.linspace(lowest, table.max_slots, INNER_BUDGETS).astype(int)):
            runs, n_forward = runs_of(chain, sequence(chain, table, int(m)))
            if n_forward != nf or runs[:nf] != list(range(nf)) or tuple(runs) in found:
                continue  # the sweep must be the block's forward, each op once in order
            try:
                found[tuple(runs)] = simulated(dag, runs)
            except InvalidPlan:
                continue
    return list(found.values())


def _persistent(block: ChainBlock) -> ChainBlock:
    """The block with options that read their input and output."""
    options = [dataclasses.replace(o, reads_input=True, reads_output=True) for o in block.options]
    return dataclasses.replace(block, options=options)


def _crossing(dag: Dag) -> list[set[int]]:
    """For each position i (between forward ops i and i+1), the sized values produced at or
    before i and read by a forward op after it."""
    nf = dag.n_forward
    producer = {v: i for i, op in enumerate(dag.ops[:nf]) for v in op.outputs}
    last: dict[int, int] = {}
    for i, op in enumerate(dag.ops[:nf]):
        for v in op.inputs:
            if v in producer:
                last[v] = i
    crossing: list[set[int]] = [set() for _ in range(nf)]
    for v, p in producer.items():
        if dag.sizes.get(v, 0):
            for i in range(p, last.get(v, p)):
                crossing[i].add(v)
    return crossing


def _cuts(dag: Dag) -> list[int]:
    """Every position with a crossing set (a segment per op: the table finds the groupings),
    the MAX_SEGMENTS - 1 smallest when there are more; none at or after an op producing a
    final value (the loss must not run twice)."""
    nf = dag.n_forward
    crossing = _crossing(dag)
    size = [sum(dag.sizes[v] for v in c) for c in crossing]
    stop = next((i for i, op in enumerate(dag.ops[:nf]) if set(op.outputs) & dag.final), nf - 1)
    cuts = [i for i in range(stop) if crossing[i]]
    if len(cuts) > MAX_SEGMENTS - 1:
        cuts = sorted(sorted(cuts, key=lambda i: size[i])[: MAX_SEGMENTS - 1])
    return cuts


def _assign_backward(dag: Dag, seg_of: list[int], n: int) -> None:
    """A backward op's segment: the latest segment whose forward values it reads, but no
    later than any segment whose backward produced one of its inputs (backwards run from
    the last segment to the first); an op reading neither runs with the last segment."""
    nf = dag.n_forward
    producer = {v: i for i, op in enumerate(dag.ops) for v in op.outputs}
    for i in range(nf, len(dag.ops)):
        home, limit = -1, n - 1
        for v in dag.ops[i].inputs:
            p = producer.get(v)
            if p is None:
                continue
            if p < nf:
                home = max(home, seg_of[p])
            else:
                limit = min(limit, seg_of[p])
        seg_of[i] = min(home if home >= 0 else n - 1, limit)


def _inner_chain(
    dag: Dag, bounds: list[int], seg_of: list[int]
) -> tuple[list[ChainBlock], list[int]]:
    """Each segment as a ChainBlock with one option keeping what its backward reads (memory
    figures are the chain model's estimates within the segment), its permanent bytes the
    final values its backward makes; and per segment the bytes of gradients it makes that
    a segment other than the one before reads."""
    nf, ops, sizes = dag.n_forward, dag.ops, dag.sizes
    crossing = _crossing(dag)
    n = len(bounds) - 1
    fwd = [list(range(bounds[s] + 1, bounds[s + 1] + 1)) for s in range(n)]
    bwd: list[list[int]] = [[] for _ in range(n)]
    for i in range(nf, len(ops)):
        bwd[seg_of[i]].append(i)
    readers: dict[int, set[int]] = {}  # value -> positions reading it
    for i, op in enumerate(ops):
        for v in op.inputs:
            readers.setdefault(v, set()).add(i)
    grad, permanent, far = [0] * n, [0] * n, [0] * n
    for s in range(n):
        for i in bwd[s]:
            for v in ops[i].outputs:
                segs = {seg_of[r] for r in readers.get(v, ())} - {s}
                if v in dag.final:
                    permanent[s] += sizes.get(v, 0)
                elif segs - {s - 1}:
                    far[s] += sizes.get(v, 0)
                elif segs:
                    grad[s] += sizes.get(v, 0)
    out = []
    for s in range(n):
        output = set(crossing[bounds[s + 1]]) if s < n - 1 else set()
        out_bytes = sum(sizes[v] for v in output)
        mine = {v for i in fwd[s] for v in ops[i].outputs}
        read_back = {v for i in bwd[s] for v in ops[i].inputs if v in mine}
        kept = sum(sizes.get(v, 0) for v in read_back - output)
        f_time = sum(ops[i].time for i in fwd[s])
        b_time = sum(ops[i].time for i in bwd[s])
        fn_peak = _peak(dag, fwd[s], output | dag.final)
        fe_peak = _peak(dag, fwd[s], output | read_back | dag.final)
        local = set(bwd[s])
        leaves = {v for i in bwd[s] for v in ops[i].outputs if readers.get(v, set()) - local}
        b_peak = _peak(dag, bwd[s], leaves | dag.final)
        inputs = set(crossing[bounds[s]]) if s > 0 else set()
        reads = {v for i in bwd[s] for v in ops[i].inputs}
        option = BlockOption(
            tuple(fwd[s]),
            tuple(bwd[s]),
            f_time,
            fe_peak,
            kept,
            bool(reads & output & mine),
            bool(reads & inputs),
            b_time,
            b_peak,
        )
        out.append(
            ChainBlock(out_bytes, grad[s], permanent[s], tuple(fwd[s]), f_time, fn_peak, [option])
        )
    return out, far


def _peak(dag: Dag, positions: list[int], keep: set[int]) -> int:
    """Peak bytes allocated while running `positions`, each value they produce freed after
    its last read among them (at once when none reads it) unless it is in `keep`."""
    last: dict[int, int] = {}
    for i in positions:
        for v in dag.ops[i].inputs:
            last[v] = i
        for v in dag.ops[i].outputs:
            last.setdefault(v, i)
    live = peak = 0
    made: set[int] = set()
    for i in positions:
        for v in dag.ops[i].outputs:
            made.add(v)
            live += dag.sizes.get(v, 0)
        peak = max(peak, live)
        for v in {*dag.ops[i].inputs, *dag.ops[i].outputs}:
            if v in made and last[v] == i and v not in keep:
                live -= dag.sizes.get(v, 0)
    return peak
