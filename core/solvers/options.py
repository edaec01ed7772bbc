"""The chain as Rotor sees it, and each block's options (ways to run it), exactly measured.

Backward ops run in stages, one stage per block, from the last block to the first. An op's
stage is its block, or earlier when it reads a gradient an earlier stage produces (gradient
sums of a residual stream are sometimes tagged with a later block). A value a stage produces
for the stage just before it is that block's gradient output (`grad`); one read further away,
or a final value (parameter gradients), stays live to the end of the step (`permanent`): the
chain model counts it from its stage on, which is exact for final values and safe otherwise.

An option of block j is a pair of run lists over the block's ops: its forward (all forward ops,
in order) and its backward (the stage's ops with the recomputes the block ILP or the keep-set
search chose). Each is simulated with `simulate_runs` under the same free-after-last-read
rule as `plan_from_runs`, so its figures are exact for the block; options are cached per
block shape (which covers the cost model: op times are part of it) in `problem.cache` and
on disk.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from dataclasses import dataclass
from pathlib import Path

from core.problem import Problem
from core.solvers.checkmate import (
    DEFAULT_SOLVER,
    Dag,
    DagOp,
    Simulated,
    kept_bytes,
    simulate_runs,
    simulated,
    solve_ilp,
)
from core.solvers.keep_sets import MAX_STATES, KeepSetSearch

GRID = (0.9, 0.8, 0.7, 0.6, 0.5, 0.4, 0.3)  # block budgets: activations kept, as fractions
ILP_SECONDS = 1.0  # HiGHS's limit for one budget of the grid
ILP_BLOCK_SECONDS = 1.0  # for the whole grid of one block: budgets left are skipped
_VERSION = 7
_MEMORY: dict[str, _Found] = {}


@dataclass(frozen=True)
class _Found:
    """A block's options as run lists (what the caches hold), and why the search stopped
    early when it did (None: the whole grid and keep-set search ran)."""

    runs: list[tuple[int, ...]]
    note: str | None


@dataclass(frozen=True)
class BlockOption:
    """One way to run a block: Fe keeps `kept` bytes (plus its output if `reads_output`)."""

    forward_runs: tuple[int, ...]  # graph op indices
    backward_runs: tuple[int, ...]
    forward_time: float
    forward_peak: int  # bytes above what was live before the forward (output included)
    kept: int  # bytes kept for the backward, the block's output excluded
    reads_output: bool  # the backward reads the block's output: it stays until then
    reads_input: bool  # the backward reads the block's input: else it can go after the forward
    backward_time: float
    backward_peak: int  # bytes above what was live before the backward
    # the backward reads what the forward left (kept values or the output); without it, a
    # recompute that ends with this block need not run its forward again (a Linear's weight
    # gradient reads only the block's input)
    needs_forward: bool = True


@dataclass
class ChainBlock:
    """What Rotor needs of one block."""

    output: int  # bytes of its output (the next block's input); 0 for the last block
    grad: int  # bytes of the gradient its backward hands to the previous block
    permanent: int  # bytes its backward leaves live to the end of the step
    forward_runs: tuple[int, ...]
    forward_time: float
    forward_peak: int  # Fn / Fck: forward keeping nothing but the output
    options: list[BlockOption]


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


def layout(problem: Problem) -> Layout:
    """Split the backward into stages and build each block's Dag (cached on the problem)."""
    if "layout" in problem.cache:
        return problem.cache["layout"]
    graph, blocks = problem.graph, problem.blocks
    ops, values = graph.ops, graph.values
    n = len(blocks)
    stage: dict[int, int] = {}
    for o in graph.backward_ops:
        s = problem.block_of_op[o]
        for v in ops[o].inputs:
            p = values[v].producer
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
    result = Layout(stage, dags, grads, permanent, outputs, final_forward, constant_bytes)
    problem.cache["layout"] = result
    return result


def chain(problem: Problem, with_options: bool) -> list[ChainBlock]:
    """The chain for Rotor: each block with its store-all option only (`with_options` False,
    classic Rotor) or with the block ILP's options too (Rockmate)."""
    key = ("chain", with_options)
    if key in problem.cache:
        return problem.cache[key]
    lay = layout(problem)
    out = []
    for j, dag in enumerate(lay.dags):
        nf = dag.n_forward
        fwd_only = Dag(dag.ops[:nf], dag.sizes, frozenset(), dag.final, dag.held)
        input_value = problem.blocks[j - 1].output_value if j > 0 else None
        stats = simulate_runs(fwd_only, list(range(nf)), nf)
        options = block_options(problem, dag) if with_options else [simulated(dag, _store_all(dag))]
        out.append(
            ChainBlock(
                output=lay.outputs[j],
                grad=lay.grads[j],
                permanent=lay.permanent[j],
                forward_runs=tuple(dag.order[:nf]),
                forward_time=stats.forward_time,
                forward_peak=stats.forward_peak,
                options=[_to_graph(dag, o, lay.outputs[j], input_value) for o in options],
            )
        )
    problem.cache[key] = out
    return out


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
        st.backward_peak - st.backward_start,
        bool(st.kept),
    )


def clear_memory_cache() -> None:
    """Forget options computed in this process (benchmarks time them cold)."""
    _MEMORY.clear()


def block_options(problem: Problem, dag: Dag) -> list[Simulated]:
    """Options of one block over the budget grid, dominated ones dropped. The run lists are
    cached per block shape (memory, problem, disk); figures are simulated for this block."""
    key = _dag_key(dag)
    mem = problem.cache.setdefault("options", {})
    if key not in mem:
        if key not in _MEMORY:
            _MEMORY[key] = _load(key)
            if _MEMORY[key] is None:
                _MEMORY[key] = _compute_options(dag)
                _save(key, _MEMORY[key])
        mem[key] = _MEMORY[key]
    return [simulated(dag, list(runs)) for runs in mem[key].runs]


def option_notes(problem: Problem) -> list[str]:
    """Why some blocks' option searches stopped early (for the plan's notes)."""
    return sorted({f.note for f in problem.cache.get("options", {}).values() if f.note})


def _compute_options(dag: Dag) -> _Found:
    full = simulated(dag, _store_all(dag))
    top = max(full.stats.forward_peak, full.stats.backward_peak)
    activations = sum(dag.sizes.get(v, 0) for v in full.stats.kept)
    search = KeepSetSearch(dag)
    found = [full, *search.options(full)]
    notes = [f"keep-set search stopped at {search.max_states} states"] if search.bounded else []
    if any(op.backward for op in dag.ops):
        deadline = time.perf_counter() + ILP_BLOCK_SECONDS
        for frac in GRID:  # of the activations kept by store-all: gradients cannot shrink
            left = deadline - time.perf_counter()
            if left < 0.1:
                notes.append(f"block ILPs stopped at {ILP_BLOCK_SECONDS:.0f} s, from {frac:.0%}")
                break
            result = solve_ilp(
                dag, top - int((1 - frac) * activations), DEFAULT_SOLVER, min(ILP_SECONDS, left)
            )
            if result is None:
                break
            try:
                found.append(simulated(dag, result.runs))
            except ValueError:
                continue
    note = f"a block of {len(dag.ops)} ops: " + "; ".join(notes) if notes else None
    return _Found([o.runs for o in _pareto(dag, found)], note)


def _pareto(dag: Dag, options: list[Simulated]) -> list[Simulated]:
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

    parts = [(_VERSION, GRID, ILP_SECONDS, ILP_BLOCK_SECONDS, MAX_STATES, DEFAULT_SOLVER)]
    for op in dag.ops:
        parts.append((op.backward, f"{op.time:.6e}", [name(v) for v in op.inputs]))
        parts.append([name(v) for v in op.outputs])
    parts.append(sorted(name(v) for v in dag.arriving))
    parts.append(sorted(name(v) for v in dag.final))
    parts.append(sorted(name(v) for v in dag.held))
    return hashlib.sha256(repr(parts).encode()).hexdigest()[:24]


def _cache_dir() -> Path | None:
    where = os.environ.get("REMAT_CACHE", str(Path.home() / ".cache" / "remat"))
    return None if where in ("", "off") else Path(where)


def _load(key: str) -> _Found | None:
    folder = _cache_dir()
    path = folder / f"options-{key}.json" if folder else None
    if path is None or not path.exists():
        return None
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    runs = data.get("runs") if isinstance(data, dict) else None
    note = data.get("note") if isinstance(data, dict) else None
    ok = isinstance(runs, list) and all(
        isinstance(r, list) and all(isinstance(i, int) for i in r) for r in runs
    )
    ok = ok and (note is None or isinstance(note, str))
    return _Found([tuple(r) for r in runs], note) if ok else None


def _save(key: str, found: _Found) -> None:
    folder = _cache_dir()
    if folder is None:
        return
    try:
        folder.mkdir(parents=True, exist_ok=True)
        tmp = folder / f"options-{key}.tmp{os.getpid()}"
        tmp.write_text(json.dumps({"runs": [list(r) for r in found.runs], "note": found.note}))
        tmp.replace(folder / f"options-{key}.json")
    except OSError:
        pass
