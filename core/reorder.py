"""Reorder a plan's program to lower its peak without running a single op more (ROAM's idea).

A plan fixes which ops run and how often; the order in which they run also sets the peak:
running a consumer right after its producer frees the producer's output sooner, delaying an
op whose result waits a long time for its reader keeps it off the peak, and the backward of
one branch can finish before another's starts. `reorder(plan)` keeps the plan's runs (the
same multiset, so the same predicted time and the same compute) and moves them within what
the program's dependencies allow:

- each run reads the copy of a value its producer's latest earlier run made, and a value is
  produced again (a recompute) only after every reader of its previous copy has run;
- the forward and backward passes keep their runs: nothing crosses `backward_start`;
- random ops (dropout) and state updates (batch-norm running statistics) keep their traced
  order in the forward, so the random stream and the state equal eager's; an op reading model
  state keeps its place relative to the ops writing it.

Values are pure functions of the values an op reads (a gradient summed from several branches
is an explicit add in the traced graph, its operands in a fixed order), so gradients stay
bit-equal to eager's in any valid order. The new order comes from greedy list scheduling by
memory delta (several tie rules), each program is simulated exactly, and the plan with the
lowest peak wins, the original included: reordering never raises a peak.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TypeGuard

from core.errors import InfeasibleBudget, fmt_bytes
from core.plan import Plan
from core.problem import Problem
from core.schedule import plan_from_runs
from core.simulator import RUN

ROUNDS = 3  # greedy rounds, each seeded with the best order so far
# how many solves `solve_reordered` may spend looking for the least-recompute plan that fits
SEARCH_PROBES = 10


@dataclass
class Dependencies:
    """What must run before what, over the positions of a run list, and the copies of values
    each position produces and reads (a value recomputed has one copy per production)."""

    before: list[set[int]]  # positions that must precede each position (same pass only)
    produces: list[list[int]]  # per position: the copies it produces
    reads: list[list[int]]  # per position: the copies it reads
    copies: list[tuple[int, bool]]  # per copy: (bytes, final: never freed)
    readers: list[int]  # per copy: how many positions read it


def run_list(plan: Plan) -> tuple[list[int], int]:
    """The plan's op runs in order and how many of them run in the forward pass."""
    runs = [target for kind, target in plan.program if kind == RUN]
    n_forward = sum(kind == RUN for kind, _ in plan.program[: plan.backward_start])
    return runs, n_forward


def dependencies(problem: Problem, runs: Sequence[int], n_forward: int) -> Dependencies:
    """Data, anti (recompute after the old copy's last read) and order-keeping edges."""
    graph = problem.graph
    ops, values, final = graph.ops, graph.values, graph.final_values
    n = len(runs)
    deps = Dependencies(
        [set() for _ in range(n)], [[] for _ in range(n)], [[] for _ in range(n)], [], []
    )
    copy_pos: list[int] = []  # copy -> position producing it
    readers_of: list[list[int]] = []  # copy -> positions reading it
    current: dict[int, int] = {}  # value -> its latest copy
    last_sticky = None  # first run of the latest random op or state update
    state_readers: list[int] = []  # positions reading model state since the last state update
    seen: set[int] = set()
    updated = {s for op in ops if op.update for s in op.writes}  # by an optimizer in the step
    readers_of_updated: dict[int, list[int]] = {s: [] for s in updated}
    writes_of: dict[int, list[int]] = {s: [] for s in updated}  # positions writing it, in order
    versions = graph.read_versions

    def after(p: int, q: int | None) -> None:
        if q is not None and q != p and (p < n_forward) == (q < n_forward):
            deps.before[p].add(q)

    for p, o in enumerate(runs):
        op = ops[o]
        for v in op.inputs:
            c = current.get(v)
            if c is not None:  # placeholders (params, inputs, tangents) have no copy
                after(p, copy_pos[c])
                readers_of[c].append(p)
                deps.reads[p].append(c)
            if values[v].kind == "state":
                after(p, last_sticky)
                state_readers.append(p)
            if v in updated:  # an optimizer's write comes after every read of the old value
                readers_of_updated[v].append(p)
                k = versions[o, v]  # and a read of a written value after that write
                after(p, writes_of[v][k - 1] if 0 < k <= len(writes_of[v]) else None)
        for s in op.writes if op.update else ():
            for r in readers_of_updated[s]:
                after(p, r)
            writes_of[s].append(p)
        for v in op.outputs:
            old = current.get(v)
            if old is not None:  # a recompute: the old copy's readers come first
                after(p, copy_pos[old])
                for r in readers_of[old]:
                    after(p, r)
            current[v] = len(deps.copies)
            deps.produces[p].append(len(deps.copies))
            deps.copies.append((values[v].nbytes, v in final))
            copy_pos.append(p)
            readers_of.append([])
        if (op.random or op.state_update) and o not in seen:
            after(p, last_sticky)
            for r in state_readers:
                after(p, r)
            last_sticky, state_readers = p, []
        seen.add(o)
    deps.readers = [len(r) for r in readers_of]
    return deps


def _greedy(deps: Dependencies, lo: int, hi: int, key: Callable, remaining: list[int]) -> list[int]:
    """List-schedule positions lo..hi-1: each time, the ready run that `key` ranks first.
    `remaining` counts the unscheduled readers of each copy (updated)."""
    users: dict[int, list[int]] = {}
    missing = {}
    for p in range(lo, hi):
        missing[p] = len(deps.before[p])
        for q in deps.before[p]:
            users.setdefault(q, []).append(p)
    ready = {p for p in range(lo, hi) if missing[p] == 0}
    order: list[int] = []
    while ready:
        best = min(ready, key=lambda p: key(p, _delta(deps, p, remaining)))
        ready.discard(best)
        order.append(best)
        for c in deps.reads[best]:
            remaining[c] -= 1
        for u in users.get(best, ()):
            missing[u] -= 1
            if missing[u] == 0:
                ready.add(u)
    if len(order) != hi - lo:  # cannot happen: the original order satisfies every edge
        raise AssertionError("the run dependencies have a cycle")
    return order


def _delta(deps: Dependencies, p: int, remaining: list[int]) -> tuple[int, int]:
    """(live bytes after running p and the frees it allows, minus before; bytes it allocates)."""
    alloc = freed = 0
    for c in deps.produces[p]:
        size, final = deps.copies[c]
        alloc += size
        if deps.readers[c] == 0 and not final:
            freed += size
    for c in deps.reads[p]:
        size, final = deps.copies[c]
        if remaining[c] == 1 and not final:
            freed += size
    return alloc - freed, alloc


def _greedy_backwards(deps: Dependencies, lo: int, hi: int, placed: list[int]) -> list[int]:
    """List-schedule positions lo..hi-1 from the last run to the first: each time, the run
    (all of whose successors are placed) whose removal grows the live set least when walking
    back in time (its inputs come alive, its outputs die). `placed` counts the readers of each
    copy already placed, later in time (updated). Returns the order in forward time."""
    succ_left = {p: 0 for p in range(lo, hi)}
    for p in range(lo, hi):
        for q in deps.before[p]:
            succ_left[q] += 1
    ready = {p for p in range(lo, hi) if succ_left[p] == 0}

    def grow(p: int) -> tuple[int, int]:
        born = sum(s for c in deps.reads[p] for s, f in [deps.copies[c]] if not placed[c] and not f)
        dies = sum(s for c in deps.produces[p] for s, f in [deps.copies[c]] if placed[c] or f)
        return born - dies, -p

    order: list[int] = []
    while ready:
        best = min(ready, key=grow)
        ready.discard(best)
        order.append(best)
        for c in deps.reads[best]:
            placed[c] += 1
        for q in deps.before[best]:
            succ_left[q] -= 1
            if succ_left[q] == 0:
                ready.add(q)
    if len(order) != hi - lo:  # cannot happen: the original order satisfies every edge
        raise AssertionError("the run dependencies have a cycle")
    return order[::-1]


# tie rules for the greedy: each gives one candidate order, the simulator picks the best
_KEYS: tuple[Callable[[int, tuple[int, int]], tuple], ...] = (
    lambda p, d: (d[0], p),  # least net growth, then original order
    lambda p, d: (d[0], d[1], p),  # least net growth, then smallest allocation
    lambda p, d: (d[0] > 0, p),  # anything that does not grow memory first, else as before
)


def reordered_runs(problem: Problem, runs: Sequence[int], n_forward: int) -> list[list[int]]:
    """Candidate run orders (one per greedy rule, forward in time, and one backward in time)
    with the same runs and pass boundary."""
    deps = dependencies(problem, runs, n_forward)
    n = len(runs)
    out = []
    for key in _KEYS:
        remaining = list(deps.readers)
        order = _greedy(deps, 0, n_forward, key, remaining)
        order += _greedy(deps, n_forward, n, key, remaining)
        out.append([runs[p] for p in order])
    placed = [0] * len(deps.copies)
    backward = _greedy_backwards(deps, n_forward, n, placed)
    out.append([runs[p] for p in _greedy_backwards(deps, 0, n_forward, placed) + backward])
    return out


def reorder(plan: Plan) -> Plan:
    """The plan's runs in the order with the lowest simulated peak found (the plan itself if
    no reordering lowers it). Same runs, same pass boundary: the predicted time is unchanged."""
    problem = plan.problem
    runs, n_forward = run_list(plan)
    best = plan
    for _ in range(ROUNDS):  # ties follow the current order: a better order can seed another
        start = best
        for order in reordered_runs(problem, run_list(best)[0], n_forward):
            trial = plan_from_runs(problem, order, n_forward, plan.method, plan.budget)
            if trial.predicted_peak < best.predicted_peak:
                best = trial
        if best is start:
            break
    if best is plan:
        return plan
    return best.replace(solve_seconds=plan.solve_seconds, notes=plan.notes).with_notes(
        f"reordered: peak {fmt_bytes(plan.predicted_peak)} -> {fmt_bytes(best.predicted_peak)} "
        "with the same runs"
    )


def solve_reordered(
    problem: Problem, budget: int, solver: Callable[[Problem, int], Plan], method: str
) -> Plan:
    """The least-time reordered plan of `method` whose peak fits `budget`.

    `solver` is the method's solve function (`method` its name, for errors). Reordering
    lowers a plan's peak, so the method may plan for more than `budget` (recompute
    less) and still fit once reordered: bisect the method's budget between `budget` and the
    store-all peak (`SEARCH_PROBES` solves at most) for the fastest plan that fits. Raises
    InfeasibleBudget with the reordered peak of the method's smallest plan when none fits.
    """
    top = problem.store_all_peak
    tried: dict[int, Plan | int] = {}

    def attempt(b: int) -> Plan | int:
        """The reordered plan the method makes for `b`, or the method's minimum if none."""
        if b not in tried:
            try:
                tried[b] = reorder(solver(problem, b))
            except InfeasibleBudget as e:
                tried[b] = e.minimum
        return tried[b]

    def fits(result: Plan | int) -> TypeGuard[Plan]:
        return isinstance(result, Plan) and result.predicted_peak <= budget

    best = attempt(top)
    if fits(best):
        return best
    best = attempt(budget)
    if isinstance(best, int):  # below the method's own minimum: its smallest plan may fit
        best = attempt(max(best, budget))
    if not fits(best):
        lowest = best.predicted_peak if isinstance(best, Plan) else best
        raise InfeasibleBudget(budget, lowest, f"{method} (reordered)")
    low, high = best.budget, top
    for _ in range(SEARCH_PROBES - 3):
        if high - low <= max(1, top // 200):
            break
        mid = (low + high) // 2
        trial = attempt(mid)
        if fits(trial):
            low = mid
            if trial.predicted_time < best.predicted_time:
                best = trial
        else:
            high = mid
    return best
