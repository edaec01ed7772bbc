"""Ops over values as the solvers see them: a block, or a whole traced step, as a `Dag`, and a
run list over it walked to its exact figures (what the solvers rank candidates by)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from core.graph import Graph
from core.simulator.program import program_from_runs
from core.simulator.walker import Walk, walk


@dataclass(frozen=True)
class DagOp:
    """One op of a `Dag`: the values it reads and makes, its seconds, its pass."""

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
class Simulated:
    """A run list over a Dag (op positions, its forward first) with its exact figures."""

    runs: tuple[int, ...]
    stats: Walk

    @property
    def time(self) -> float:
        return self.stats.forward_time + self.stats.backward_time


def simulate_runs(dag: Dag, runs: Sequence[int], n_forward: int) -> Walk:
    """Walk the runs under free-after-last-read (`program_from_runs`); InvalidPlan (a
    ValueError) when a run reads a value that is not live."""
    program, start = program_from_runs(dag.ops, runs, n_forward, dag.final, dag.held, dag.arriving)
    return walk(dag.ops, program, start, dag.sizes, arriving=dag.arriving, final=dag.final)


def simulated(dag: Dag, runs: Sequence[int]) -> Simulated:
    """`simulate_runs` on the Dag's forward split."""
    return Simulated(tuple(runs), simulate_runs(dag, runs, dag.n_forward))


def kept_bytes(dag: Dag, option: Simulated) -> int:
    """Bytes the forward leaves live for the backward."""
    return sum(dag.sizes.get(v, 0) for v in option.stats.kept)


def graph_dag(graph: Graph) -> Dag:
    """The whole traced step as a Dag (placeholders external, final values required)."""
    ops = [DagOp(op.inputs, op.outputs, op.time, op.phase == "backward") for op in graph.ops]
    order = graph.forward_ops + graph.backward_ops
    sizes = {v.index: v.nbytes for v in graph.values if not v.is_placeholder}
    outs = {
        v
        for v in graph.final_values
        if (p := graph.values[v].producer) is not None and graph.ops[p].phase == "forward"
    }
    return Dag(
        [ops[o] for o in order], sizes, final=graph.final_values, held=frozenset(outs), order=order
    )
