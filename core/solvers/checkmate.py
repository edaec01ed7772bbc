"""Checkmate (Jain et al., MLSys 2020) in the restricted form that solves in seconds.

The published ILP has a stage per op and O(T^2) binaries; on a GPT layer it does not close its
gap in a minute (docs/tuning.md). This form keeps what matters for a forward+backward graph:
- the forward runs once, and one keep bit per forward value says whether it stays live until
  the backward (else it is freed after its last forward read);
- each backward op runs once, in its own stage k, in graph order; before it, forward ops may be
  recomputed (only those the next `lookahead` stages need), and a stored bit per forward value
  and stage says whether a copy is carried into the stage;
- memory is checked by one conservative row per forward op and per stage: everything stored or
  recomputed in the stage counts at once, with the backward values live during that stage.
The solution becomes op runs; the simulator (`core.simulator`) gives the exact figures,
which are never above the rows. The core works on any `Dag`, so tests can compare it with
brute force on small random graphs; `solve` runs it on a whole model (the reference optimum
for small models) and `core.solvers.options` on one block at a time.
"""

from __future__ import annotations

import os
import sys
import threading
import warnings
from dataclasses import dataclass, field

import highspy
import pulp

from core.errors import InfeasibleBudget, Interrupted
from core.interrupt import stop_condition
from core.plan import Plan
from core.problem import Problem, per_problem
from core.schedule import plan_from_runs
from core.simulator import Dag, graph_dag

DEFAULT_SOLVER = os.environ.get("REMAT_ILP_SOLVER", "highs")
_banner_silenced = False  # see _silence_highs_banner
_banner_lock = threading.Lock()


@dataclass
class IlpResult:
    runs: list[int]  # op positions in the dag
    objective: float  # recompute time
    optimal: bool
    status: str = field(default="")
    bound: float | None = None  # HiGHS's lower bound on the objective (None from CBC)
    limit: str | None = None  # the limit that stopped the search short of optimal
    iterations: int = 0  # HiGHS's simplex iterations, all LPs of the search (0 from CBC)


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


@dataclass
class _Stages:
    """The restricted model's index sets: forward and backward ops, the forward values and
    their sizes, the backward values' fixed liveness per stage, and per stage what its backward
    op reads (`need_at`), what it may recompute (`cand`) and what it or later stages read."""

    fwd: list[int]
    bwd: list[int]
    producer: dict[int, int]  # forward value -> forward op producing it
    fvals: list[int]  # forward values with a size, in op order
    size: dict[int, int]
    bwd_live: list[int]  # bytes of backward values live during each stage
    need_at: list[set[int]]
    cand: list[set[int]]
    later_use: list[set[int]]
    final_f: set[int]  # forward values live to the end of the step


@dataclass
class _Vars:
    """The ILP and its binaries: keep (forward value kept for the backward), R (forward op
    recomputed in a stage), S (forward value carried into a stage)."""

    prob: pulp.LpProblem
    keep: dict[int, pulp.LpVariable]
    R: dict[tuple[int, int], pulp.LpVariable]
    S: dict[tuple[int, int], pulp.LpVariable]


def solve_ilp(
    dag: Dag,
    budget: int,
    solver: str = DEFAULT_SOLVER,
    time_limit: float | None = None,
    lookahead: int | None = 3,
    node_limit: int | None = None,
) -> IlpResult | None:
    """Least recompute time whose conservative memory rows stay within `budget` bytes.

    Returns None when no feasible schedule was found within the limits. With a limit hit,
    the best incumbent is returned (`optimal` False, `limit` saying which). A node limit
    (branch-and-bound nodes) gives the same answer on a loaded machine as on an idle one; a
    time limit does not. `lookahead=None` lets a stage recompute anything a later stage
    needs (the exact restricted model, for tests).
    """
    st = _stages(dag, lookahead)
    ilp = _variables(st)
    # the order of rows is part of the model: HiGHS's choices can depend on it
    _stage_rows(dag, st, ilp, budget)
    _forward_rows(dag, st, ilp, budget)
    status, limit = _run(ilp.prob, solver, time_limit, node_limit)
    if ilp.prob.sol_status not in (pulp.LpSolutionOptimal, pulp.LpSolutionIntegerFeasible):
        return None
    return _result(dag, st, ilp, solver, status, limit)


def _stages(dag: Dag, lookahead: int | None) -> _Stages:
    """The index sets of the model (see `_Stages`); a stage recomputes only forward ops that
    the next `lookahead` stages may need (all later ones with None)."""
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
    return _Stages(fwd, bwd, producer, fvals, size, bwd_live, need_at, cand, later_use, final_f)


def _variables(st: _Stages) -> _Vars:
    """The problem and its binaries, created in a fixed order (keep, R, S): column order is
    part of the model."""
    prob = pulp.LpProblem("checkmate", pulp.LpMinimize)
    keep = {v: prob.add_variable(f"k_{v}", cat="Binary") for v in st.fvals}
    R = {
        (k, f): prob.add_variable(f"r_{k}_{f}", cat="Binary")
        for k in range(len(st.bwd))
        for f in st.cand[k]
    }
    S = {
        (k, v): prob.add_variable(f"s_{k}_{v}", cat="Binary")
        for k in range(len(st.bwd))
        for v in st.fvals
        if v in st.later_use[k] or v in st.final_f
    }
    return _Vars(prob, keep, R, S)


def _stage_rows(dag: Dag, st: _Stages, ilp: _Vars, budget: int) -> None:
    """The objective (recompute time) and the backward stages' rows: final values stay,
    a copy is carried only if it was there before, what a stage reads is there, a recomputed
    value is not also carried, and each stage's memory fits `budget`."""
    ops, prob, keep, R, S, size = dag.ops, ilp.prob, ilp.keep, ilp.R, ilp.S, st.size

    def avail(k: int, v: int):
        return S.get((k, v), 0) + R.get((k, st.producer[v]), 0)

    prob += pulp.lpSum(ops[f].time * r for (k, f), r in R.items())
    for v in st.final_f:
        prob += keep[v] == 1
        for k in range(len(st.bwd)):
            prob += S[(k, v)] == 1
    for (k, v), s in S.items():
        prev = keep[v] if k == 0 else avail(k - 1, v)
        prob += s <= prev
    for k in range(len(st.bwd)):
        for v in st.need_at[k]:
            if v in size:
                prob += avail(k, v) >= 1
        for f in st.cand[k]:
            for u in ops[f].inputs:
                if u in size:
                    prob += avail(k, u) >= R[(k, f)]
            for v in ops[f].outputs:
                if (k, v) in S:
                    prob += R[(k, f)] + S[(k, v)] <= 1
        counted = pulp.lpSum(size[v] * s for (kk, v), s in S.items() if kk == k)
        counted += pulp.lpSum(
            sum(size.get(v, 0) for v in ops[f].outputs) * R[(k, f)] for f in st.cand[k]
        )
        prob += counted + st.bwd_live[k] <= budget


def _forward_rows(dag: Dag, st: _Stages, ilp: _Vars, budget: int) -> None:
    """One memory row per forward op: values still read later in the forward are live;
    others only if kept. Rows with nothing to choose and within budget are left out."""
    ops, producer, size, fwd = dag.ops, st.producer, st.size, st.fwd
    last_fwd = {v: producer[v] for v in st.fvals}
    for f in fwd:
        for v in ops[f].inputs:
            if v in last_fwd:
                last_fwd[v] = max(last_fwd[v], f)
    for v in dag.held:
        if v in last_fwd:
            last_fwd[v] = fwd[-1]
    for f in fwd:
        fixed = sum(size[v] for v in st.fvals if producer[v] <= f <= last_fwd[v])
        optional = [ilp.keep[v] * size[v] for v in st.fvals if last_fwd[v] < f]
        if optional or fixed > budget:
            ilp.prob += pulp.lpSum(optional) + fixed <= budget


def _result(dag: Dag, st: _Stages, ilp: _Vars, solver: str, status: str, limit: str) -> IlpResult:
    """The schedule read back from a solved model: the forward once, then per stage the
    recomputed forward ops (in op order) and its backward op; with HiGHS's bound."""
    ops, R, prob = dag.ops, ilp.R, ilp.prob
    info = prob.solverModel.getInfo() if solver == "highs" else None
    bound = info.mip_dual_bound if info is not None else None
    runs = list(st.fwd)
    for k, b in enumerate(st.bwd):
        runs.extend(f for f in sorted(st.cand[k]) if R[(k, f)].value() > 0.5)
        runs.append(b)
    objective = sum(ops[f].time for (k, f), r in R.items() if r.value() > 0.5)
    optimal = prob.sol_status == pulp.LpSolutionOptimal
    return IlpResult(
        runs,
        objective,
        optimal,
        status,
        objective if optimal else bound,
        None if optimal else limit,
        info.simplex_iteration_count if info is not None else 0,
    )


class _HiGHS(pulp.HiGHS):
    """PuLP's HiGHS, also reading the incumbent of a node-limited solve (PuLP 3.3 has no
    status for HiGHS's kSolutionLimit, raised by mip_max_nodes, and fails with a KeyError),
    and stopped at its interrupt callbacks when the thread's `core.stop_when` condition holds
    (then raising `Interrupted`, no result read)."""

    def callSolver(self, lp: pulp.LpProblem) -> None:
        should_stop = stop_condition()
        if should_stop is None:
            super().callSolver(lp)
            return
        stopped = False

        def poll(event: highspy.highs.HighsCallbackEvent) -> None:
            nonlocal stopped
            if should_stop():
                stopped = True
                event.interrupt()

        model = lp.solverModel
        for callback in (model.cbSimplexInterrupt, model.cbIpmInterrupt, model.cbMipInterrupt):
            callback += poll
        super().callSolver(lp)
        if stopped:
            raise Interrupted("the ILP stopped: the caller asked (core.stop_when)")

    def findSolutionValues(self, lp: pulp.LpProblem) -> tuple[int, int]:
        model = lp.solverModel
        if model.getModelStatus() != highspy.HighsModelStatus.kSolutionLimit:
            return super().findSolutionValues(lp)
        if model.getInfo().primal_solution_status != highspy.SolutionStatus.kSolutionStatusFeasible:
            return pulp.LpStatusNotSolved, pulp.LpSolutionNoSolutionFound
        values = model.getSolution().col_value
        for var in lp.variables():
            var.varValue = values[var.index]
        return pulp.LpStatusOptimal, pulp.LpSolutionIntegerFeasible


def _silence_highs_banner() -> None:
    """Construct a first Highs with stdout (fd 1) on /dev/null, once per process.

    HiGHS's C++ prints its two-line banner to fd 1 the first time a Highs object is built in
    a process, before PuLP can pass msg=False, so a library call would write it into the
    caller's stdout (a CLI's JSON, a notebook). Later constructions print nothing. Done just
    before the first HiGHS solve rather than at import, so importing stays side-effect free;
    under a lock, since solves may start in several threads and fd 1 is the process's.
    """
    global _banner_silenced
    with _banner_lock:
        if _banner_silenced:
            return
        if sys.stdout is not None:
            sys.stdout.flush()
        try:
            saved = os.dup(1)
        except OSError:  # no fd 1: nowhere for the banner to go
            saved = None
        try:
            if saved is not None:
                devnull = os.open(os.devnull, os.O_WRONLY)
                try:
                    os.dup2(devnull, 1)
                finally:
                    os.close(devnull)
            highspy.Highs()
            _banner_silenced = True
        finally:
            if saved is not None:
                os.dup2(saved, 1)
                os.close(saved)


def _run(
    prob: pulp.LpProblem, solver: str, time_limit: float | None, node_limit: int | None
) -> tuple[str, str]:
    """Solve on one thread; returns PuLP's status and the limit that stopped the search
    (meaningful when the solution is not optimal)."""
    nodes = {} if node_limit is None else {"mip_max_nodes": node_limit}
    if solver == "highs":
        _silence_highs_banner()
        backend = _HiGHS(msg=False, timeLimit=time_limit, threads=1, **nodes)
    elif solver == "cbc":
        with warnings.catch_warnings():  # the bundled CBC: deprecated for PuLP 4 (pinned < 4)
            warnings.simplefilter("ignore", DeprecationWarning)
            backend = pulp.PULP_CBC_CMD(
                msg=False, timeLimit=time_limit, threads=1, maxNodes=node_limit
            )
    else:
        raise ValueError(f"unknown ILP solver {solver!r}: use 'highs' or 'cbc'")
    prob.solve(backend)
    limit = _limit_name(time_limit, node_limit)
    if solver == "highs":
        hit = prob.solverModel.getModelStatus()
        if hit == highspy.HighsModelStatus.kSolutionLimit:
            limit = _limit_name(None, node_limit)
        elif hit == highspy.HighsModelStatus.kTimeLimit:
            limit = _limit_name(time_limit, None)
    return pulp.LpStatus[prob.status], limit


def _limit_name(time_limit: float | None, node_limit: int | None) -> str:
    parts = ([f"{time_limit:g} s"] if time_limit is not None else []) + (
        [f"{node_limit}-node"] if node_limit is not None else []
    )
    return " or ".join(parts) + " limit" if parts else "limit"


def solve(
    problem: Problem,
    budget: int,
    solver: str = DEFAULT_SOLVER,
    time_limit: float | None = 30.0,
    node_limit: int | None = None,
) -> Plan:
    """The whole-graph ILP: the reference optimum for small models (within its limits)."""
    return solve_with_bound(problem, budget, solver, time_limit, node_limit)[0]


def solve_with_bound(
    problem: Problem,
    budget: int,
    solver: str = DEFAULT_SOLVER,
    time_limit: float | None = 30.0,
    node_limit: int | None = None,
) -> tuple[Plan, float | None]:
    """The whole-graph ILP's plan and a lower bound on the overhead of any schedule this ILP
    admits at `budget` (its optimum when solved, HiGHS's bound when time ran out; None when
    unknown: CBC, or a tightened budget whose bound does not hold at `budget`)."""
    found = whole_graph_ilp(problem, budget, solver, time_limit, node_limit)
    if found is None:
        raise InfeasibleBudget(budget, ilp_minimum(problem, solver), "checkmate")
    return found


@per_problem
def ilp_minimum(problem: Problem, solver: str = DEFAULT_SOLVER, probe_nodes: int = 50) -> int:
    """The smallest budget asked at which the whole-graph ILP finds a schedule, to 1% of the
    store-all peak: bisection with `probe_nodes` branch-and-bound nodes per try (at most 8
    tries; a node limit, so the answer does not depend on the machine's load), memoised."""
    peak = problem.store_all_peak
    low, high = 0, peak  # high: store-all always fits
    for _ in range(8):
        if high - low <= peak // 100:
            break
        mid = (low + high) // 2
        if whole_graph_ilp(problem, mid, solver, None, probe_nodes) is None:
            low = mid
        else:
            high = mid  # the budget asked, which the ILP can meet again
    return high


def whole_graph_ilp(
    problem: Problem,
    budget: int,
    solver: str,
    time_limit: float | None,
    node_limit: int | None,
    method: str = "checkmate",
) -> tuple[Plan, float | None] | None:
    """A `method` plan within `budget` from the whole-graph ILP, tightening the ILP's budget
    when the simulator finds its conservative rows still too loose, with the overhead bound
    (see `solve_with_bound`); None when it finds nothing."""
    dag = graph_dag(problem.graph)
    n_fwd = dag.n_forward
    target = budget
    for _ in range(8):
        result = solve_ilp(dag, target, solver, time_limit, node_limit=node_limit)
        if result is None:
            return None
        runs = [dag.order[i] for i in result.runs]
        plan = plan_from_runs(problem, runs, n_fwd, method, budget)
        bound = None
        if result.bound is not None and target == budget:
            bound = 1 + result.bound / problem.store_all_time
        if not result.optimal:
            plan = plan.with_notes(f"the ILP hit its {result.limit}: best schedule found")
            if bound is not None:
                plan = plan.with_notes(
                    f"the ILP's lower bound at this budget: overhead {bound:.3f}"
                )
        if plan.predicted_peak <= budget:
            return plan, bound
        target -= plan.predicted_peak - budget
    return None
