"""The chain as Rotor sees it, and each block's options (ways to run it), exactly measured.

Backward ops run in stages, one stage per block, from the last block to the first. An op's
stage is its block, or earlier when it reads a gradient an earlier stage produces (gradient
sums of a residual stream are sometimes tagged with a later block). A value a stage produces
for the stage just before it is that block's gradient output (`grad`); one read further away,
or a final value (parameter gradients), stays live to the end of the step (`permanent`): the
chain model counts it from its stage on, which is exact for final values and safe otherwise.

An option of block j is a pair of run lists over the block's ops: its forward (all forward ops,
in order) and its backward (the stage's ops with the recomputes the block ILP, the keep-set
search or, in a block that is not a chain inside, Rotor on its inner chain (`nested`) chose). Each is simulated with `simulate_runs` under the same free-after-last-read
rule as `plan_from_runs`, so its figures are exact for the block; options are cached per
block shape (which covers the cost model: op times are part of it) in memory and on disk,
keyed by a hash of the code that computes them; the chain is memoised per problem. A small
graph nested whole as one block (`whole_graph_schedules`, Rockmate's other route) gets its
run lists from here too, cached the same way.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import sys
from dataclasses import dataclass
from pathlib import Path

import pulp

from core import simulator
from core.plan import Plan
from core.problem import Problem, per_problem
from core.schedule import plan_from_runs
from core.simulator import (
    Dag,
    DagOp,
    InvalidPlan,
    Simulated,
    graph_dag,
    kept_bytes,
    simulate_runs,
    simulated,
)
from core.solvers import checkmate, keep_sets, nested, rotor_table
from core.solvers.checkmate import DEFAULT_SOLVER, solve_ilp
from core.solvers.keep_sets import MAX_STATES, KeepSetSearch
from core.solvers.nested import MAX_SEGMENTS, nested_options
from core.solvers.rotor_table import BlockOption, ChainBlock

log = logging.getLogger(__name__)
GRID = (0.9, 0.8, 0.7, 0.6, 0.5, 0.4, 0.3)  # block budgets: activations kept, as fractions
# Bounds in work, not time, so a loaded machine gets the same options as an idle one: each
# block ILP stops after ILP_NODES branch-and-bound nodes, and a block's grid stops (the budgets
# left skipped, the plan says so) after ILP_BLOCK_ITERATIONS HiGHS simplex iterations. Blocks
# above ILP_MAX_OPS ops (one variable per backward/forward op pair) skip the ILP; their options
# come from the keep-set search and nested schedules. No wall-clock limit, not even a guard:
# one would cut a block's grid short on a loaded machine only, and the options it left would
# be cached (the whole-graph ILP's 300 s guard changed plans at load 23: docs/app.md). The
# measurements behind these: docs/tuning.md.
ILP_NODES = 20
ILP_BLOCK_ITERATIONS = 5000
ILP_MAX_OPS = 100
MEMORY_ENTRIES = 512  # block shapes whose option run lists this process keeps


@dataclass(frozen=True)
class _Computed:
    """A block shape's options as cached: their run lists, how many block ILPs a node limit
    stopped short of optimal (their schedules are the best found, not proven optimal), and
    why the search stopped early when it did (None: the whole grid and keep-set search ran)."""

    runs: list[tuple[int, ...]]
    limited: int
    note: str | None


_MEMORY: dict[str, _Computed] = {}  # block key -> options, least recently used first


@dataclass
class Layout:
    """Stages of backward ops and the block Dags."""

    stage: dict[int, int]  # backward op -> stage (block)
    dags: list[Dag]
    grads: list[int]
    permanent: list[int]
    outputs: list[int]
    final_forward: int  # bytes of model outputs (live from the forward to the end)
    constants: int  # bytes of step constants (counted for the whole step: safe)


@per_problem
def layout(problem: Problem) -> Layout:
    """Split the backward into stages and build each block's Dag (memoised per problem)."""
    graph, blocks = problem.graph, problem.blocks
    ops, values = graph.ops, graph.values
    n = len(blocks)
    stage: dict[int, int] = {}
    for o in graph.backward_ops:
        s = problem.block_of_op[o]
        for u in ops[o].inputs:
            p = values[u].producer
            if p is not None and ops[p].phase == "backward":
                s = min(s, stage[p])
        stage[o] = s
    home = {o: problem.block_of_op[o] for o in graph.forward_ops} | stage
    grads, permanent = [0] * (n + 1), [0] * n
    arriving: list[set[int]] = [set() for _ in range(n + 1)]
    leaving: list[set[int]] = [set() for _ in range(n)]
    final_forward = 0
    constants = set(problem.constant_ops)
    for v in values:
        if v.producer is None or not v.nbytes or v.producer in constants:
            continue
        s = home[v.producer]
        readers = {home[c] for c in v.consumers} - {s}
        if ops[v.producer].phase == "forward":
            if v.index in graph.final_values:
                final_forward += v.nbytes
            out_of = blocks[s].output_value
            bad = readers - ({s + 1} if v.index == out_of else set())
            if bad:  # find_blocks merges such blocks: this is a bug
                raise AssertionError(f"forward value {v.name} of block {s} read by blocks {bad}")
            continue
        if v.index in graph.final_values or readers - {s - 1}:
            permanent[s] += v.nbytes
            leaving[s].add(v.index)
        elif readers:
            grads[s] += v.nbytes
            leaving[s].add(v.index)
            arriving[s - 1].add(v.index)
    dags = []
    for j, block in enumerate(blocks):
        order = list(block.forward_ops) + [o for o in graph.backward_ops if stage[o] == j]
        own = {v for o in order for v in ops[o].outputs}
        sizes = {v: values[v].nbytes for v in own | arriving[j]}
        held = {block.output_value} if block.output_value is not None else set()
        final = leaving[j] | {v for v in own if v in graph.final_values}
        dag_ops = [
            DagOp(ops[o].inputs, ops[o].outputs, ops[o].time, ops[o].phase == "backward")
            for o in order
        ]
        dags.append(
            Dag(dag_ops, sizes, frozenset(arriving[j]), frozenset(final), frozenset(held), order)
        )
    outputs = [values[b.output_value].nbytes if b.output_value is not None else 0 for b in blocks]
    constant_bytes = sum(values[v].nbytes for o in constants for v in ops[o].outputs)
    return Layout(stage, dags, grads, permanent, outputs, final_forward, constant_bytes)


@per_problem
def chain(problem: Problem, with_options: bool) -> list[ChainBlock]:
    """The chain for Rotor: each block with its store-all option only (`with_options` False,
    classic Rotor) or with the block ILP's and keep-set search's options too (Rockmate);
    memoised per problem."""
    lay = layout(problem)
    out = []
    for j, dag in enumerate(lay.dags):
        nf = dag.n_forward
        fwd_only = Dag(dag.ops[:nf], dag.sizes, frozenset(), dag.final, dag.held)
        input_value = problem.blocks[j - 1].output_value if j > 0 else None
        stats = simulate_runs(fwd_only, list(range(nf)), nf)
        options, limited, note = (
            block_options(dag) if with_options else (_store_all_option(dag), 0, None)
        )
        out.append(
            ChainBlock(
                output=lay.outputs[j],
                grad=lay.grads[j],
                permanent=lay.permanent[j],
                forward_runs=tuple(dag.order[:nf]),
                forward_time=stats.forward_time,
                forward_peak=stats.forward_peak,
                options=[_to_graph(dag, o, lay.outputs[j], input_value) for o in options],
                ilps_limited=limited,
                search_note=note,
            )
        )
    return out


def _store_all_option(dag: Dag) -> list[Simulated]:
    return [simulated(dag, _store_all(dag))]


def _store_all(dag: Dag) -> list[int]:
    return list(range(len(dag.ops)))


def _to_graph(
    dag: Dag, local: Simulated, output_bytes: int, input_value: int | None
) -> BlockOption:
    nf, st = dag.n_forward, local.stats
    reads_input = any(input_value in dag.ops[i].inputs for i in local.runs[nf:])
    reads_output = any(v in st.kept for v in dag.held)
    kept = sum(dag.sizes.get(v, 0) for v in st.kept) - (output_bytes if reads_output else 0)
    return BlockOption(
        tuple(dag.order[i] for i in local.runs[:nf]),
        tuple(dag.order[i] for i in local.runs[nf:]),
        st.forward_time,
        st.forward_peak,
        kept,
        reads_output,
        reads_input,
        st.backward_time,
        st.backward_peak - st.backward_start_bytes,
        bool(st.kept),
    )


def clear_memory_cache() -> None:
    """Forget options computed in this process (benchmarks time them cold)."""
    _MEMORY.clear()


def block_options(dag: Dag) -> tuple[list[Simulated], int, str | None]:
    """Options of one block over the budget grid, dominated ones dropped, and how many of
    the block ILPs behind them stopped at a limit. The run lists are cached per block shape
    (in memory, the last MEMORY_ENTRIES shapes, and on disk); figures are simulated here."""
    key = _dag_key(dag)
    computed = _MEMORY.pop(key, None) or _load(key)
    if computed is None:
        computed = _compute_options(dag)
        _save(key, computed)
    _MEMORY[key] = computed  # most recently used last
    while len(_MEMORY) > MEMORY_ENTRIES:
        _MEMORY.pop(next(iter(_MEMORY)))
    return [simulated(dag, list(r)) for r in computed.runs], computed.limited, computed.note


def whole_graph_runs(dag: Dag) -> list[tuple[int, ...]]:
    """The run lists of `nested_options` on a whole graph's DAG, cached on disk as block
    options are: Rotor's tables over its up to MAX_SEGMENTS segments were most of a small
    model's first solve, every time the model was analysed again."""
    key = "whole-" + _dag_key(dag)
    computed = _load(key)
    if computed is None:
        computed = _Computed([tuple(o.runs) for o in nested_options(dag)], 0, None)
        if computed.runs:  # none: too few segments, found again at once
            _save(key, computed)
    return computed.runs


@dataclass(frozen=True)
class WholeGraphSchedule:
    """A schedule of the whole step from `nested_options` on the graph as one block."""

    runs: tuple[int, ...]  # graph op indices
    n_forward: int
    predicted_peak: int
    predicted_time: float


@per_problem
def whole_graph_schedules(problem: Problem) -> list[WholeGraphSchedule]:
    """The whole graph nested as one block, when its forward has at most MAX_SEGMENTS ops: a
    top level that is not a chain (a U-Net's skips around every block, a head reading two
    towers) is then solved at op granularity, where Rockmate's chain keeps a block's input
    through its whole backward. Each schedule simulated as a plan; memoised per problem, and
    the run lists cached on disk (`whole_graph_runs`)."""
    graph = problem.graph
    if len(graph.forward_ops) > MAX_SEGMENTS:
        return []
    dag = graph_dag(graph)
    out = []
    for option_runs in whole_graph_runs(dag):
        runs = tuple(dag.order[i] for i in option_runs)
        plan = plan_from_runs(problem, runs, dag.n_forward, "rockmate", 0)
        out.append(
            WholeGraphSchedule(runs, dag.n_forward, plan.predicted_peak, plan.predicted_time)
        )
    return out


def whole_graph_plan(problem: Problem, budget: int) -> Plan | None:
    """The fastest whole-graph schedule that fits `budget`, as a plan; None if none does."""
    fits = [s for s in whole_graph_schedules(problem) if s.predicted_peak <= budget]
    if not fits:
        return None
    best = min(fits, key=lambda s: s.predicted_time)
    return plan_from_runs(problem, best.runs, best.n_forward, "rockmate", budget)


def option_notes(blocks: list[ChainBlock]) -> list[str]:
    """What a plan says about its blocks' options: where block ILPs stopped at their node
    limit, and where a block's option search stopped early."""
    notes = []
    limited = sum(b.ilps_limited > 0 for b in blocks)
    if limited:
        notes.append(
            f"in {limited} of {len(blocks)} blocks, block ILPs stopped at their "
            f"{ILP_NODES}-node limit: those options are the best found, not proven optimal"
        )
    return notes + sorted({b.search_note for b in blocks if b.search_note})


def _compute_options(dag: Dag) -> _Computed:
    full = simulated(dag, _store_all(dag))
    top = max(full.stats.forward_peak, full.stats.backward_peak)
    activations = sum(dag.sizes.get(v, 0) for v in full.stats.kept)
    search = KeepSetSearch(dag)
    found = [full, *search.options(full), *nested_options(dag)]
    notes = [f"keep-set search stopped at {search.max_states} states"] if search.bounded else []
    limited = 0
    if len(dag.ops) > ILP_MAX_OPS:
        notes.append(f"no block ILP above {ILP_MAX_OPS} ops")
    elif any(op.backward for op in dag.ops):
        spent = 0
        for frac in GRID:  # of the activations kept by store-all: gradients cannot shrink
            if spent >= ILP_BLOCK_ITERATIONS:
                notes.append(
                    f"block ILPs stopped at {spent} simplex iterations, from {frac:.0%} kept"
                )
                break
            budget = top - int((1 - frac) * activations)
            result = solve_ilp(dag, budget, DEFAULT_SOLVER, None, node_limit=ILP_NODES)
            if result is None:
                break
            limited += not result.optimal
            spent += result.iterations
            try:
                found.append(simulated(dag, result.runs))
            except InvalidPlan as e:
                log.warning("a block ILP's schedule does not simulate, dropped: %s", e)
                continue
    note = f"a block of {len(dag.ops)} ops: " + "; ".join(notes) if notes else None
    return _Computed([o.runs for o in _undominated(dag, found)], limited, note)


def _undominated(dag: Dag, options: list[Simulated]) -> list[Simulated]:
    def figures(o: Simulated) -> tuple:
        s = o.stats
        return (o.time, kept_bytes(dag, o), s.forward_peak, s.backward_peak)

    scored = sorted({figures(o): o for o in options}.items())
    out: list[Simulated] = []
    kept_figs: list[tuple] = []
    for fig, o in scored:
        if not any(all(a <= b for a, b in zip(k, fig)) for k in kept_figs):
            out.append(o)
            kept_figs.append(fig)
    return out


def _dag_key(dag: Dag) -> str:
    """Hash of the block's shape: ops over locally renumbered values, sizes, times, grid."""
    local: dict[int, int] = {}

    def name(v: int) -> tuple:
        if v not in dag.sizes:
            return ("x", local.setdefault(v, len(local)))  # external: parameters, inputs
        return ("v", local.setdefault(v, len(local)), dag.sizes[v])

    parts: list[object] = [
        (_CODE, GRID, ILP_NODES, ILP_BLOCK_ITERATIONS, MAX_STATES, DEFAULT_SOLVER)
    ]
    for op in dag.ops:
        parts.append((op.backward, f"{op.time:.6e}", [name(v) for v in op.inputs]))
        parts.append([name(v) for v in op.outputs])
    parts.append(sorted(name(v) for v in dag.arriving))
    parts.append(sorted(name(v) for v in dag.final))
    parts.append(sorted(name(v) for v in dag.held))
    return hashlib.sha256(repr(parts).encode()).hexdigest()[:24]


def _code_hash() -> str:
    """Hash of the code that computes options (this module, the ILP, the keep-set search,
    every module of the simulator package, the nested chains and Rotor's table behind them) and of PuLP's version: a
    change to any of them is a new cache key."""
    h = hashlib.sha256(pulp.__version__.encode())
    modules = (simulator, checkmate, keep_sets, nested, rotor_table, sys.modules[__name__])
    for module in modules:
        path = Path(str(module.__file__))
        for source in sorted(path.parent.glob("*.py")) if path.name == "__init__.py" else [path]:
            h.update(source.read_bytes())
    return h.hexdigest()[:16]


_CODE = _code_hash()


def _cache_dir() -> Path | None:
    where = os.environ.get("REMAT_CACHE", str(Path.home() / ".cache" / "remat"))
    return None if where in ("", "off") else Path(where)


def _load(key: str) -> _Computed | None:
    folder = _cache_dir()
    path = folder / f"options-{key}.json" if folder else None
    if path is None or not path.exists():
        return None
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(data, dict) or not isinstance(data.get("limited"), int):
        return None
    runs, note = data.get("runs"), data.get("note")
    if not isinstance(runs, list) or not runs or not (note is None or isinstance(note, str)):
        return None
    ok = all(isinstance(r, list) and all(isinstance(i, int) for i in r) for r in runs)
    return _Computed([tuple(r) for r in runs], data["limited"], note) if ok else None


def _save(key: str, computed: _Computed) -> None:
    folder = _cache_dir()
    if folder is None:
        return
    try:
        folder.mkdir(parents=True, exist_ok=True)
        tmp = folder / f"options-{key}.tmp{os.getpid()}"
        data = {"runs": [list(r) for r in computed.runs], "limited": computed.limited}
        tmp.write_text(json.dumps(data | {"note": computed.note}))
        tmp.replace(folder / f"options-{key}.json")
    except OSError:
        pass
