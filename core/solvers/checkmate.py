"""Checkmate (Jain et al., MLSys 2020) in the restricted form that solves in seconds.

The published ILP has a stage per op and O(T^2) binaries; on a GPT layer it does not close its
gap in a minute (see DESIGN.md). This form keeps what matters for a forward+backward graph:
- the forward runs once, and one keep bit per forward value says whether it stays live until
  the backward (else it is freed after its last forward read);
- each backward op runs once, in its own stage k, in graph order; before it, forward ops may be
  recomputed (only those the next `lookahead` stages need), and a stored bit per forward value
  and stage says whether a copy is carried into the stage;
- memory is checked by one conservative row per forward op and per stage: everything stored or
  recomputed in the stage counts at once, with the backward values live during that stage.
The solution becomes op runs; `simulate_runs` (and the plan simulator) give the exact figures,
which are never above the rows. The core works on any `Dag`, so tests can compare it with
brute force on small random graphs; `solve` runs it on a whole model (the reference optimum
for small models) and `core.solvers.options` on one block at a time.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Sequence
from dataclasses import dataclass, field

import pulp

from core.errors import InfeasibleBudget
from core.problem import Problem
from core.schedule import Plan, plan_from_runs

DEFAULT_SOLVER = os.environ.get("REMAT_ILP_SOLVER", "highs")


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
class RunStats:
    """Exact memory of a sequence of runs under free-after-last-read."""

    forward_peak: int  # most bytes live during the forward runs
    kept: frozenset[int]  # values live when the forward ends
    backward_start: int  # bytes live when the backward starts (kept + arriving)
    backward_peak: int  # most bytes live during the backward runs
    forward_time: float
    backward_time: float


@dataclass
class IlpResult:
    runs: list[int]  # op positions in the dag
    objective: float  # recompute time
    optimal: bool
    status: str = field(default="")
    bound: float | None = None  # HiGHS's lower bound on the objective (None from CBC)


def simulate_runs(dag: Dag, runs: list[int], n_forward: int) -> RunStats:
    """Walk the runs, freeing each value right after its last read before it is produced
    again, as `core.schedule.plan_from_runs` does; raise ValueError if a run misses an input."""
    ops, sizes = dag.ops, dag.sizes
    last_read: dict[int, int] = {}
    free_at: dict[int, list[int]] = {}
    produced: dict[int, int] = {}

    def retire(v: int) -> None:
        pos = last_read.pop(v, produced[v])
        if v in dag.held:
            pos = max(pos, n_forward - 1)
        free_at.setdefault(pos, []).append(v)

    for pos, o in enumerate(runs):
        for v in ops[o].inputs:
            if v in produced or v in dag.arriving:
                last_read[v] = pos
        for v in ops[o].outputs:
            if v in produced:
                retire(v)
            produced[v] = pos
    for v in dag.arriving:
        free_at.setdefault(max(last_read.pop(v, n_forward), n_forward), []).append(v)
    for v in list(produced):
        if v not in dag.final:
            retire(v)

    live: set[int] = set()
    now = f_peak = b_peak = b_start = 0
    f_time = b_time = 0.0
    kept: frozenset[int] = frozenset()
    for pos, o in enumerate(runs):
        if pos == n_forward:
            kept = frozenset(live)
            live |= dag.arriving
            now += sum(sizes.get(v, 0) for v in dag.arriving)
            b_start = now
        op = ops[o]
        missing = [v for v in op.inputs if v in sizes and v not in live]
        if missing:
            raise ValueError(f"run {pos} (op {o}) reads {missing}, not live")
        for v in op.outputs:
            live.add(v)
            now += sizes.get(v, 0)
        if pos < n_forward:
            f_peak, f_time = max(f_peak, now), f_time + op.time
        else:
            b_peak, b_time = max(b_peak, now), b_time + op.time
        for v in free_at.get(pos, ()):
            live.discard(v)
            now -= sizes.get(v, 0)
    if n_forward >= len(runs):
        kept = frozenset(live)
        b_start = now + sum(sizes.get(v, 0) for v in dag.arriving)
    return RunStats(f_peak, kept, b_start, max(b_peak, b_start), f_time, b_time)


@dataclass(frozen=True)
class Simulated:
    """A run list over a Dag (op positions, its forward first) with its exact figures."""

    runs: tuple[int, ...]
    stats: RunStats

    @property
    def time(self) -> float:
        return self.stats.forward_time + self.stats.backward_time


def simulated(dag: Dag, runs: Sequence[int]) -> Simulated:
    """`simulate_runs` on the Dag's forward split; ValueError when a run misses an input."""
    return Simulated(tuple(runs), simulate_runs(dag, list(runs), dag.n_forward))


def kept_bytes(dag: Dag, option: Simulated) -> int:
    """Bytes the forward leaves live for the backward."""
    return sum(dag.sizes.get(v, 0) for v in option.stats.kept)


def _closure(dag: Dag, values: set[int], producer: dict[int, int]) -> set[int]:
    """Forward ops that may need to run to recompute `values`."""
    out: set[int] = set()
    stack = [producer[v] for v in values if v in producer]
    while stack:
        f = stack.pop()
        if f not in out:
            out.add(f)
            stack.extend(producer[u] for u in dag.ops[f].inputs if u in producer)
    return out


def solve_ilp(
    dag: Dag,
    budget: int,
    solver: str = DEFAULT_SOLVER,
    time_limit: float = 2.0,
    lookahead: int | None = 3,
) -> IlpResult | None:
    """Least recompute time whose conservative memory rows stay within `budget` bytes.

    Returns None when no feasible schedule was found within the time limit. With a time limit
    hit, the best incumbent is returned (`optimal` False). `lookahead=None` lets a stage
    recompute anything a later stage needs (the exact restricted model, for tests).
    """
    ops, sizes = dag.ops, dag.sizes
    fwd = [i for i, op in enumerate(ops) if not op.backward]
    bwd = [i for i, op in enumerate(ops) if op.backward]
    producer = {v: f for f in fwd for v in ops[f].outputs}
    fvals = [v for f in fwd for v in ops[f].outputs if v in sizes]
    size = {v: sizes[v] for v in fvals}

    # backward values: fixed liveness, since each backward op runs once in its stage
    stage_of = {b: k for k, b in enumerate(bwd)}
    bwd_live = [0] * len(bwd)
    bprod = {v: stage_of[b] for b in bwd for v in ops[b].outputs if v in sizes}
    for v, k0 in list(bprod.items()) + [(v, 0) for v in dag.arriving]:
        reads = [stage_of[c] for c, op in enumerate(ops) if op.backward and v in op.inputs]
        end = len(bwd) - 1 if v in dag.final else max(reads, default=k0)
        for k in range(k0, end + 1):
            bwd_live[k] += sizes.get(v, 0)

    need_at = [{v for v in ops[b].inputs if v in producer} for b in bwd]
    horizon = len(bwd) if lookahead is None else lookahead + 1
    cand = [
        _closure(dag, set().union(*need_at[k : k + horizon]), producer) for k in range(len(bwd))
    ]
    later_use: list[set[int]] = [set() for _ in range(len(bwd) + 1)]
    for k in range(len(bwd) - 1, -1, -1):
        uses = set(need_at[k]) | {u for f in cand[k] for u in ops[f].inputs if u in producer}
        later_use[k] = later_use[k + 1] | uses
    final_f = {v for v in fvals if v in dag.final}

    prob = pulp.LpProblem("checkmate", pulp.LpMinimize)
    keep = {v: prob.add_variable(f"k_{v}", cat="Binary") for v in fvals}
    R = {
        (k, f): prob.add_variable(f"r_{k}_{f}", cat="Binary")
        for k in range(len(bwd))
        for f in cand[k]
    }
    S = {
        (k, v): prob.add_variable(f"s_{k}_{v}", cat="Binary")
        for k in range(len(bwd))
        for v in fvals
        if v in later_use[k] or v in final_f
    }

    def avail(k: int, v: int):
        return S.get((k, v), 0) + R.get((k, producer[v]), 0)

    prob += pulp.lpSum(ops[f].time * r for (k, f), r in R.items())
    for v in final_f:
        prob += keep[v] == 1
        for k in range(len(bwd)):
            prob += S[(k, v)] == 1
    for (k, v), s in S.items():
        prev = keep[v] if k == 0 else avail(k - 1, v)
        prob += s <= prev
    for k in range(len(bwd)):
        for v in need_at[k]:
            if v in size:
                prob += avail(k, v) >= 1
        for f in cand[k]:
            for u in ops[f].inputs:
                if u in size:
                    prob += avail(k, u) >= R[(k, f)]
            for v in ops[f].outputs:
                if (k, v) in S:
                    prob += R[(k, f)] + S[(k, v)] <= 1
        counted = pulp.lpSum(size[v] * s for (kk, v), s in S.items() if kk == k)
        counted += pulp.lpSum(
            sum(size.get(v, 0) for v in ops[f].outputs) * R[(k, f)] for f in cand[k]
        )
        prob += counted + bwd_live[k] <= budget

    # forward rows: values still read later in the forward are live; others only if kept
    last_fwd = {v: producer[v] for v in fvals}
    for f in fwd:
        for v in ops[f].inputs:
            if v in last_fwd:
                last_fwd[v] = max(last_fwd[v], f)
    for v in dag.held:
        if v in last_fwd:
            last_fwd[v] = fwd[-1]
    for f in fwd:
        fixed = sum(size[v] for v in fvals if producer[v] <= f <= last_fwd[v])
        optional = [keep[v] * size[v] for v in fvals if last_fwd[v] < f]
        if optional or fixed > budget:
            prob += pulp.lpSum(optional) + fixed <= budget
    status = _run(prob, solver, time_limit)
    if prob.sol_status not in (pulp.LpSolutionOptimal, pulp.LpSolutionIntegerFeasible):
        return None
    bound = prob.solverModel.getInfo().mip_dual_bound if solver == "highs" else None
    runs = list(fwd)
    for k, b in enumerate(bwd):
        runs.extend(f for f in sorted(cand[k]) if R[(k, f)].value() > 0.5)
        runs.append(b)
    objective = sum(ops[f].time for (k, f), r in R.items() if r.value() > 0.5)
    optimal = prob.sol_status == pulp.LpSolutionOptimal
    return IlpResult(runs, objective, optimal, status, objective if optimal else bound)


def _run(prob: pulp.LpProblem, solver: str, time_limit: float) -> str:
    if solver == "highs":
        backend = pulp.HiGHS(msg=False, timeLimit=time_limit, threads=1)
    elif solver == "cbc":
        with warnings.catch_warnings():  # the bundled CBC: deprecated for PuLP 4 (pinned < 4)
            warnings.simplefilter("ignore", DeprecationWarning)
            backend = pulp.PULP_CBC_CMD(msg=False, timeLimit=time_limit, threads=1)
    else:
        raise ValueError(f"unknown ILP solver {solver!r}: use 'highs' or 'cbc'")
    prob.solve(backend)
    return pulp.LpStatus[prob.status]


def graph_dag(problem: Problem) -> Dag:
    """The whole traced step as a Dag (placeholders external, final values required)."""
    graph = problem.graph
    ops = [DagOp(op.inputs, op.outputs, op.time, op.phase == "backward") for op in graph.ops]
    order = graph.forward_ops + graph.backward_ops
    sizes = {v.index: v.nbytes for v in graph.values if not v.is_placeholder}
    outs = {v for v in graph.final_values if graph.ops[graph.values[v].producer].phase == "forward"}
    return Dag(
        [ops[o] for o in order], sizes, final=graph.final_values, held=frozenset(outs), order=order
    )


def solve(
    problem: Problem,
    budget: int,
    solver: str = DEFAULT_SOLVER,
    time_limit: float = 30.0,
) -> Plan:
    """The whole-graph ILP: the reference optimum for small models (within its time limit)."""
    return solve_with_bound(problem, budget, solver, time_limit)[0]


def solve_with_bound(
    problem: Problem,
    budget: int,
    solver: str = DEFAULT_SOLVER,
    time_limit: float = 30.0,
) -> tuple[Plan, float | None]:
    """The whole-graph ILP's plan and a lower bound on the overhead of any schedule this ILP
    admits at `budget` (its optimum when solved, HiGHS's bound when time ran out; None when
    unknown: CBC, or a tightened budget whose bound does not hold at `budget`)."""
    found = _whole_graph(problem, budget, solver, time_limit)
    if found is None:
        raise InfeasibleBudget(budget, minimum_budget(problem, solver), "checkmate")
    return found


def minimum_budget(
    problem: Problem, solver: str = DEFAULT_SOLVER, probe_seconds: float = 2.0
) -> int:
    """The smallest budget asked at which the ILP finds a schedule, to 1% of the store-all
    peak: bisection with `probe_seconds` per try (at most 8 tries), cached on the problem."""
    key = ("checkmate-minimum", solver)
    if key not in problem.cache:
        peak = problem.store_all_peak
        low, high = 0, peak  # high: store-all always fits
        for _ in range(8):
            if high - low <= peak // 100:
                break
            mid = (low + high) // 2
            if _whole_graph(problem, mid, solver, probe_seconds) is None:
                low = mid
            else:
                high = mid  # the budget asked, which the ILP can meet again
        problem.cache[key] = high
    return problem.cache[key]


def _whole_graph(
    problem: Problem, budget: int, solver: str, time_limit: float
) -> tuple[Plan, float | None] | None:
    """A plan within `budget` from the whole-graph ILP, tightening the ILP's budget when the
    simulator finds its conservative rows still too loose, with the overhead bound (see
    `solve_with_bound`); None when it finds nothing."""
    dag = graph_dag(problem)
    n_fwd = dag.n_forward
    target = budget
    for _ in range(8):
        result = solve_ilp(dag, target, solver, time_limit)
        if result is None:
            return None
        runs = [dag.order[i] for i in result.runs]
        plan = plan_from_runs(problem, runs, n_fwd, "checkmate", budget)
        bound = None
        if result.bound is not None and target == budget:
            bound = 1 + result.bound / problem.store_all_time
        if not result.optimal:
            plan.notes.append(f"the ILP hit its {time_limit:.0f} s limit: best schedule found")
            if bound is not None:
                plan.notes.append(f"the ILP's lower bound at this budget: overhead {bound:.3f}")
        if plan.predicted_peak <= budget:
            return plan, bound
        target -= plan.predicted_peak - budget
    return None
