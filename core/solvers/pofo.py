"""POFO (Beaumont, Eyraud-Dubois, Shilova, NeurIPS 2021): Rotor's chain dynamic program
with a third fate for each block checkpoint (a block's input kept for its backward): keep it
on the device, drop it and recompute it (Rotor's moves), or offload it to host memory and
prefetch it back before its block's backward needs it.

The cost model, on top of Rotor's (`core.solvers.rotor_table`, whose recurrence this one
extends; with no offload feasible the two tables are equal):
- An offloaded checkpoint x_s (input of block s, output of block s-1) is offloaded right
  after block s's forward, while blocks s+1..j-1 run forward keeping nothing, and j..t are
  then solved with x_s on the host. The copy must fit in that window: bytes / d2h <= the
  forward time of blocks s+1..j-1, so the transfer never delays compute; x_s is counted on
  the device during each of those forwards that starts before its copy is done (the
  simulator releases it before the first run that starts after).
- It is prefetched when the backward of block j (the last backward of j..t) starts and is
  counted on the device from then on. The copy overlaps that backward; whatever it takes
  beyond it is a stall: max(0, bytes / h2d - backward time of the option block j runs).
- Transfers never queue: each copy runs inside its own window and the windows of different
  checkpoints are disjoint in time (a forward window runs only plain forwards, a backward
  window is one block's backward, each block's backward runs once), so the lane is free
  when each copy starts.
So transfers add to the table's time only the stalls it counts (fewer when the first read
of a prefetched checkpoint comes after some of its block's forward). Memory is in Rotor's
slots; the final plan is always walked by `core.simulator`, and a plan whose simulated peak
is over the budget is never returned (the slot count is probed down, as in
`core.solvers.rotor`).

What is claimed (tests/test_pofo.py, against an enumeration on 4-6 block chains): in Rotor's
classic model (every backward reads its input) the table's least time is the least time of
every schedule in its family, walked step by step with the transfer lane: Rotor's persistent
schedules where each checkpoint a sub-chain may drop is kept, recomputed or offloaded as
above. Not searched: copies that overlap anything but plain forwards, prefetches issued
before the backward of the sub-chain's first block, and offloading the activations an option
keeps inside a block (what `method="offload"` does greedily).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np

from core.errors import InfeasibleBudget
from core.plan import Plan
from core.problem import Problem, per_problem
from core.schedule import plan_of_program, store_all_plan
from core.simulator import OFFLOAD, PREFETCH, RUN, Instruction, Link, program_from_runs, walk_step
from core.solvers import rockmate
from core.solvers.options import chain, layout
from core.solvers.rotor import chain_plan, loosen
from core.solvers.rotor_table import SLOTS, BlockOption, ChainBlock

_LEAF = 1 << 20  # checkpoint block j's input, keep the sub-chain's input
_OFFLOAD = 1 << 21  # checkpoint block j's input, offload the sub-chain's input
_KEEP_INPUT = -2  # a sub-chain that keeps its input throughout


@dataclass
class PofoTable:
    """The table over sub-chains, memory slots and reserves. A reserve is the bytes of a
    checkpoint prefetched while the sub-chain's first block runs its backward (0: none)."""

    slot: int  # bytes per slot
    reserves: tuple[int, ...]  # bytes; index 0 is 0
    cost: dict[tuple[int, int, int], np.ndarray]  # (reserve index, s, t) -> least time
    what: dict[tuple[int, int, int], np.ndarray]  # option index, or _LEAF + j
    free_cost: dict[tuple[int, int, int], np.ndarray]  # the sub-chain's input counted in m
    free_what: dict[tuple[int, int, int], np.ndarray]  # option, _KEEP_INPUT or _OFFLOAD + j
    out: list[int]  # slots of each block's output

    def best(self, slots: int) -> float:
        arr = self.cost[(0, 0, len(self.out) - 1)]
        return float(arr[min(slots, len(arr) - 1)]) if slots >= 0 else float("inf")

    @property
    def max_slots(self) -> int:
        return len(self.cost[(0, 0, len(self.out) - 1)]) - 1

    def min_slots(self) -> int | None:
        finite = np.flatnonzero(np.isfinite(self.cost[(0, 0, len(self.out) - 1)]))
        return int(finite[0]) if len(finite) else None

    def reserve_of(self, blocks: list[ChainBlock], p: int | None) -> int:
        """The reserve index of checkpoint p (block p's input; None: no reserve)."""
        return 0 if p is None else self.reserves.index(blocks[p - 1].output)


def compute_table(
    blocks: list[ChainBlock], link: Link, max_bytes: int, slots: int = SLOTS
) -> PofoTable:
    """Fill the table for every sub-chain, reserve and m = 0..slots (max_bytes/slots each).

    As in Rotor, `cost` is for a sub-chain whose input the caller keeps (outside m) and
    `free_cost` for one whose input is counted in m; the latter may also offload its input
    (see the module's docstring). A reserve r adds r's slots to the sub-chain's first
    backward and the stall of r's copy back behind it."""
    slot = max(1, -(-max_bytes // slots))
    n = len(blocks)

    def q(b: int) -> int:
        return -(-b // slot)

    out = [q(b.output) for b in blocks]
    grad = [q(b.grad) for b in blocks] + [0]
    perm = np.cumsum([0] + [q(b.permanent) for b in blocks])
    fwd_t = np.cumsum([0.0] + [b.forward_time for b in blocks])
    reserves = tuple(sorted({0} | {b.output for b in blocks[:-1] if b.output > 0}))
    m = np.arange(slots + 1)
    inf = np.inf
    cost: dict[tuple[int, int, int], np.ndarray] = {}
    what: dict[tuple[int, int, int], np.ndarray] = {}
    free_cost: dict[tuple[int, int, int], np.ndarray] = {}
    free_what: dict[tuple[int, int, int], np.ndarray] = {}

    def shift(arr: np.ndarray, k: int) -> np.ndarray:
        if k <= 0:
            return arr
        res = np.full_like(arr, inf)
        if k < len(arr):
            res[k:] = arr[:-k]
        return res

    def better(best: np.ndarray, choice_of: np.ndarray, val: np.ndarray, choice: int) -> None:
        mask = val < best
        best[mask], choice_of[mask] = val[mask], choice

    for d in range(n):
        for s in range(n - d):
            t = s + d
            inp = out[s - 1] if s > 0 else 0
            after = perm[t + 1] - perm[s + 1]
            # checkpoint j with the input offloaded: (j, forward slots needed, input's reserve)
            offloads = []
            if s > 0 and blocks[s - 1].output > 0:
                copy = blocks[s - 1].output / link.d2h
                need = grad[t + 1] + inp + q(blocks[s].forward_peak)
                for j in range(s + 1, t + 1):
                    if j > s + 1:  # the input is on the device until its copy is done
                        leaving = inp if fwd_t[j - 1] - fwd_t[s + 1] < copy else 0
                        need = max(
                            need, grad[t + 1] + leaving + out[j - 2] + q(blocks[j - 1].forward_peak)
                        )
                    if copy <= fwd_t[j] - fwd_t[s + 1]:
                        offloads.append((j, need, reserves.index(blocks[s - 1].output)))
            for k, r in enumerate(reserves):
                k_best, k_what = np.full(slots + 1, inf), np.full(slots + 1, -1, dtype=np.int64)
                f_best, f_what = np.full(slots + 1, inf), np.full(slots + 1, -1, dtype=np.int64)
                for i, o in enumerate(blocks[s].options):
                    kept = q(o.kept) + (out[s] if o.reads_output else 0)
                    fwd_need = grad[t + 1] + q(o.forward_peak)
                    bwd_need = grad[s + 1] + after + kept + q(o.backward_peak) + q(r)
                    fwd_time = o.forward_time
                    if _skips_forward(blocks, s, t, o):
                        fwd_need, fwd_time = 0, 0.0
                    rest: float | np.ndarray
                    if d == 0:
                        rest = 0.0
                    elif o.reads_output:
                        rest = shift(cost[(0, s + 1, t)], out[s] + q(o.kept))
                    else:
                        rest = shift(free_cost[(0, s + 1, t)], q(o.kept))
                    stall = max(0.0, r / link.h2d - o.backward_time) if r else 0.0
                    val = fwd_time + o.backward_time + stall + rest
                    better(k_best, k_what, np.where((m >= fwd_need) & (m >= bwd_need), val, inf), i)
                    if not o.reads_input:
                        ok = (m >= inp + fwd_need) & (m >= bwd_need)
                        better(f_best, f_what, np.where(ok, val, inf), i)
                need = 0
                for j in range(s + 1, t + 1):
                    i = j - 1
                    need = max(
                        need, grad[t + 1] + (out[i - 1] if i > s else 0) + q(blocks[i].forward_peak)
                    )
                    val = (
                        fwd_t[j]
                        - fwd_t[s]
                        + free_cost[(0, j, t)]
                        + shift(cost[(k, s, j - 1)], int(perm[t + 1] - perm[j]))
                    )
                    better(k_best, k_what, np.where(m >= need, val, inf), _LEAF + j)
                cost[(k, s, t)], what[(k, s, t)] = k_best, k_what
                better(f_best, f_what, shift(k_best, inp), _KEEP_INPUT)
                for j, fneed, kx in offloads:
                    val = (
                        fwd_t[j]
                        - fwd_t[s]
                        + free_cost[(kx, j, t)]
                        + shift(cost[(k, s, j - 1)], int(perm[t + 1] - perm[j]) + inp)
                    )
                    better(f_best, f_what, np.where(m >= fneed, val, inf), _OFFLOAD + j)
                free_cost[(k, s, t)], free_what[(k, s, t)] = f_best, f_what
    return PofoTable(slot, reserves, cost, what, free_cost, free_what, out)


def sequence(blocks: list[ChainBlock], table: PofoTable, slots: int) -> list[tuple]:
    """The schedule for `slots`: ("F", j), ("Fe", j, option), ("B", j, option),
    ("offload", j) and ("prefetch", j) (of block j's input)."""
    q = lambda b: -(-b // table.slot)  # noqa: E731
    seq: list[tuple] = []

    def option(s: int, t: int, m: int, c: int, p: int | None) -> None:
        o = blocks[s].options[c]
        if not _skips_forward(blocks, s, t, o):
            seq.append(("Fe", s, c))
        if t > s and o.reads_output:
            keep(s + 1, t, m - q(blocks[s].output) - q(o.kept), None)
        elif t > s:
            free(s + 1, t, m - q(o.kept), None)
        if p is not None:
            seq.append((PREFETCH, p))
        seq.append(("B", s, c))

    def keep(s: int, t: int, m: int, p: int | None) -> None:
        c = int(table.what[(table.reserve_of(blocks, p), s, t)][m])
        if c < 0:
            raise ValueError("infeasible sub-chain")
        if c >= _LEAF:
            j = c - _LEAF
            seq.extend(("F", i) for i in range(s, j))
            free(j, t, m, None)
            perm = sum(q(b.permanent) for b in blocks[j : t + 1])
            keep(s, j - 1, m - perm, p)
            return
        option(s, t, m, c, p)

    def free(s: int, t: int, m: int, p: int | None) -> None:
        c = int(table.free_what[(table.reserve_of(blocks, p), s, t)][m])
        inp = table.out[s - 1] if s > 0 else 0
        if c == _KEEP_INPUT:
            keep(s, t, m - inp, p)
        elif c >= _OFFLOAD:
            j = c - _OFFLOAD
            seq.extend([("F", s), (OFFLOAD, s)] + [("F", i) for i in range(s + 1, j)])
            free(j, t, m, s)
            perm = sum(q(b.permanent) for b in blocks[j : t + 1])
            keep(s, j - 1, m - perm - inp, p)
        elif c < 0:
            raise ValueError("infeasible sub-chain")
        else:
            option(s, t, m, c, p)

    keep(0, len(blocks) - 1, min(slots, table.max_slots), None)
    return seq


def _skips_forward(blocks: list[ChainBlock], s: int, t: int, o: BlockOption) -> bool:
    """As in Rotor: a one-block sub-chain whose backward reads nothing its forward leaves
    does not rerun that forward (never the last block's)."""
    return s == t < len(blocks) - 1 and not o.needs_forward


def program_of(
    problem: Problem, blocks: list[ChainBlock], seq: list[tuple]
) -> tuple[list[Instruction], int]:
    """The program of a schedule: its runs under free-after-last-read (step constants first),
    with `offload x` after the forward run that marks it and `prefetch x` before the next
    run. A checkpoint nothing reads after its offload is freed there instead (no transfer)."""
    runs: list[int] = list(problem.constant_ops)
    n_forward = None
    marks: list[tuple[int, str, int]] = []  # (run position it precedes, kind, value)
    for step in seq:
        kind, j = step[0], step[1]
        if kind == "F":
            runs.extend(blocks[j].forward_runs)
        elif kind == "Fe":
            runs.extend(blocks[j].options[step[2]].forward_runs)
        elif kind == "B":
            if n_forward is None:
                n_forward = len(runs)
            runs.extend(blocks[j].options[step[2]].backward_runs)
        else:
            marks.append((len(runs), kind, problem.blocks[j - 1].output_value))
    graph = problem.graph
    program, start = program_from_runs(
        graph.ops, runs, len(runs) if n_forward is None else n_forward, graph.final_values
    )
    ops = graph.ops  # a schedule offloads each checkpoint once at most
    sent = {
        v
        for pos, kind, v in marks
        if kind == OFFLOAD and any(v in ops[o].inputs for o in runs[pos:])
    }
    inserts: dict[int, list[Instruction]] = {}
    for pos, kind, v in marks:
        if v in sent:
            inserts.setdefault(pos, []).append((kind, v))
    result: list[Instruction] = []
    new_start = start
    position = 0
    for i, ins in enumerate(program):
        if ins[0] == RUN:
            extra = inserts.get(position, [])
            result += extra
            if i < start:
                new_start += len(extra)
            position += 1
        result.append(ins)
    return result, new_start


@per_problem
def _prepared(problem: Problem) -> tuple[list[ChainBlock], PofoTable]:
    """Rockmate's chain and its POFO table up to twice the store-all peak (memoised)."""
    blocks = chain(problem, True)
    return blocks, compute_table(blocks, problem.link, 2 * problem.store_all_peak)


@dataclass(frozen=True)
class _Probe:
    """The schedule at one slot count, walked once: its figures only (not its program)."""

    slots: int
    peak: int
    time: float


def _program(problem: Problem, slots: int) -> tuple[list[Instruction], int]:
    """The program of the table's schedule at `slots`."""
    blocks, table = _prepared(problem)
    return program_of(problem, blocks, sequence(blocks, table, slots))


@per_problem
def _probe(problem: Problem, slots: int) -> _Probe:
    """The simulated peak and time of the schedule at `slots` (memoised per problem)."""
    walked = walk_step(problem.graph, *_program(problem, slots), problem.link)
    return _Probe(slots, walked.peak, walked.time)


def table_plan(problem: Problem, budget: int) -> Plan:
    """The fastest schedule read from the POFO table whose simulated peak fits `budget`:
    the slot count is probed down from the budget until the walk fits, then a few slot
    counts above are tried, as in `core.solvers.rotor.chain_plan`."""
    _, table = _prepared(problem)
    lay = layout(problem)
    slots = (budget - lay.final_forward - lay.constants) // table.slot
    lowest = table.min_slots()
    tried: set[int] = set()
    while lowest is not None and slots >= lowest and slots not in tried:
        tried.add(slots)
        probe = _probe(problem, slots)
        if probe.peak <= budget:
            best = loosen(lambda n: _probe(problem, n), table.max_slots, slots, probe, budget)
            program, start = _program(problem, best.slots)
            return plan_of_program(problem, program, start, "pofo", budget)
        slots -= max(1, -(-(probe.peak - budget) // table.slot))
    if lowest is None:
        raise InfeasibleBudget(budget, problem.store_all_peak, "pofo")
    floor = _probe(problem, lowest)  # the chain model over-counts: the floor may still fit
    if floor.peak > budget:
        raise InfeasibleBudget(budget, floor.peak, "pofo")
    program, start = _program(problem, lowest)
    return plan_of_program(problem, program, start, "pofo", budget)


def solve(problem: Problem, budget: int) -> Plan:
    """The fastest of the POFO table's plan, Rockmate's plan and Rotor's that fits `budget`
    (so never slower than either where it fits: the table alone may be, as its slot
    probing can stop at a different slot count)."""
    if problem.store_all_peak <= budget:
        return store_all_plan(problem, "pofo", budget)
    plans: list[tuple[Plan, str | None]] = []
    floors: list[int] = []
    for make, note in (
        (lambda: table_plan(problem, budget), None),
        (lambda: replace(rockmate.solve(problem, budget), method="pofo"), "Rockmate's"),
        (lambda: chain_plan(problem, budget, "pofo", with_options=False), "Rotor's"),
    ):
        try:
            plans.append((make(), note))
        except InfeasibleBudget as e:
            floors.append(e.minimum)
    if not plans:
        raise InfeasibleBudget(budget, min(floors), "pofo")
    plan, note = min(plans, key=lambda pair: pair[0].predicted_time)
    if note is not None:
        plan = plan.with_notes(f"POFO's table found nothing faster at this budget: {note} plan")
    return plan
