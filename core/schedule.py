"""The plan: a straight-line program over the graph's ops, and the simulator that walks it.

A program is a list of instructions, plain data: `("run", op)` computes an op (the first time,
or again: a recompute) and `("free", value)` drops a storage. Instructions before
`backward_start` run in the forward pass; the rest run when `loss.backward()` reaches the
model. The simulator and the runtime (`core.runtime`) walk the very same program, so the
memory timeline the app draws is the memory the step uses.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, NamedTuple

from core.errors import PlanMismatch, RematError

if TYPE_CHECKING:
    from core.problem import Problem

RUN, FREE = "run", "free"
Instruction = tuple[str, int]


class InvalidPlan(RematError):
    """A program that cannot run: an input not live, a double free, a misplaced backward op."""


class Step(NamedTuple):
    """One row of the memory timeline: live bytes after the instruction, by kind."""

    index: int
    kind: str  # run | free
    target: int  # op index (run) or value index (free)
    name: str
    label: str  # "aten.mm" for runs, the value's kind for frees
    phase: str  # forward | backward
    block: int
    recompute: bool
    activations: int
    temporaries: int
    gradients: int

    @property
    def live(self) -> int:
        return self.activations + self.temporaries + self.gradients


@dataclass
class Simulation:
    timeline: list[Step]
    peak: int
    peak_step: int
    time: float
    recomputed_ops: int


@dataclass
class Plan:
    """A program for one traced step, with where it came from and what it predicts."""

    program: list[Instruction]
    backward_start: int
    method: str
    budget: int
    fingerprint: str
    problem: Problem | None = field(default=None, repr=False, compare=False)
    solve_seconds: float = 0.0
    notes: list[str] = field(default_factory=list)
    graph_meta: dict = field(default_factory=dict)  # params, inputs: to retrace and compare
    _sim: Simulation | None = field(default=None, repr=False, compare=False)
    # figures read from a plan file, shown until the plan is attached to its problem
    saved_prediction: tuple[int, float, float] | None = field(default=None, repr=False)

    def attach(self, problem: Problem) -> Plan:
        """Bind a loaded plan to the problem it was made for (same graph fingerprint)."""
        if problem.fingerprint != self.fingerprint:
            raise PlanMismatch(
                "the plan was made for another graph: " + problem.describe_difference(self)
            )
        self.problem = problem
        self._sim = None
        return self

    def simulate(self) -> Simulation:
        """Walk the program once (cached): timeline, peak and time."""
        if self._sim is None:
            if self.problem is None:
                raise RematError("this plan is not attached to a problem: call plan.attach()")
            self._sim = simulate(self.problem, self.program, self.backward_start)
        return self._sim

    @property
    def timeline(self) -> list[Step]:
        return self.simulate().timeline

    @property
    def predicted_peak(self) -> int:
        if self.problem is None and self.saved_prediction:
            return self.saved_prediction[0]
        return self.simulate().peak

    @property
    def predicted_time(self) -> float:
        if self.problem is None and self.saved_prediction:
            return self.saved_prediction[1]
        return self.simulate().time

    @property
    def overhead(self) -> float:
        """Predicted time over the store-all time: 1.0 means no recomputation."""
        if self.problem is None and self.saved_prediction:
            return self.saved_prediction[2]
        return self.predicted_time / self.problem.store_all_time

    @property
    def recomputed_ops(self) -> int:
        return self.simulate().recomputed_ops

    def save(self, path: str) -> None:
        """Write the plan as a pickle of plain data (see core.plan_io)."""
        from core.plan_io import save_plan

        save_plan(self, path)


def plan_from_runs(
    problem: Problem,
    runs: Sequence[int],
    backward_start: int,
    method: str,
    budget: int,
) -> Plan:
    """Build a program from a sequence of op runs: each value is freed right after its last
    read before it is produced again, so a solver only chooses what runs when.

    `backward_start` counts runs: the first `backward_start` runs are the forward pass.
    """
    graph = problem.graph
    final = graph.final_values
    # for each run position, the values whose last read (before re-production) happens there
    last_read: dict[int, int] = {}  # value -> run position of its latest read so far
    frees_after: dict[int, list[int]] = {}
    produced_at: dict[int, int] = {}

    def retire(v: int) -> None:
        pos = last_read.pop(v, produced_at[v])
        frees_after.setdefault(pos, []).append(v)

    for pos, o in enumerate(runs):
        op = graph.ops[o]
        for v in op.inputs:
            if v in produced_at:
                last_read[v] = pos
        for v in op.outputs:
            if v in produced_at:
                retire(v)
            produced_at[v] = pos
    for v in produced_at:
        if v not in final:
            retire(v)

    program: list[Instruction] = []
    start = None
    for pos, o in enumerate(runs):
        if pos == backward_start:
            start = len(program)
        program.append((RUN, o))
        program.extend((FREE, v) for v in sorted(frees_after.get(pos, ())))
    if start is None:
        start = len(program)
    return Plan(
        program,
        start,
        method,
        budget,
        problem.fingerprint,
        problem=problem,
        graph_meta=problem.graph_meta,
    )


def simulate(problem: Problem, program: Sequence[Instruction], backward_start: int) -> Simulation:
    """Walk the program, checking it is valid, and record live bytes after each instruction."""
    graph = problem.graph
    values, ops, final = graph.values, graph.ops, graph.final_values
    block_of_op = problem.block_of_op
    live: set[int] = {v.index for v in values if v.is_placeholder and v.kind != "tangent"}
    # bytes each value adds to (activations, temporaries, gradients)
    column = {"activation": 0, "temporary": 1, "gradient": 2}
    slot = [column.get(v.kind, -1) for v in values]
    size = [v.nbytes for v in values]
    totals = [0, 0, 0]
    done: set[int] = set()
    next_sticky = iter(o.index for o in ops if o.random or o.state_update)
    expected_sticky = next(next_sticky, None)
    timeline: list[Step] = []
    time = 0.0
    peak, peak_step, recomputed = 0, 0, 0
    tangents = [v.index for v in values if v.kind == "tangent"]

    for i, (kind, target) in enumerate(program):
        phase = "forward" if i < backward_start else "backward"
        if i == backward_start:
            live.update(tangents)
        if kind == RUN:
            op = ops[target]
            if op.phase == "backward" and phase == "forward":
                raise InvalidPlan(f"step {i}: backward op {op.name} runs in the forward pass")
            if not live.issuperset(op.inputs):
                missing = [values[v].name for v in op.inputs if v not in live]
                raise InvalidPlan(f"step {i}: op {op.name} reads {missing}, which are not live")
            recompute = target in done
            if not recompute and target == expected_sticky:
                if phase != "forward":
                    raise InvalidPlan(
                        f"step {i}: {op.name} (random or state update) must first run in forward"
                    )
                expected_sticky = next(next_sticky, None)
            elif not recompute and (op.random or op.state_update):
                raise InvalidPlan(f"step {i}: random/state op {op.name} runs out of traced order")
            for v in op.outputs:
                if v in live:
                    raise InvalidPlan(
                        f"step {i}: {op.name} recomputes {values[v].name}, still live"
                    )
                live.add(v)
                totals[slot[v]] += size[v]
            recomputed += recompute
            done.add(target)
            time += op.time
            name, label, block = op.name, op.label, block_of_op[target]
        elif kind == FREE:
            if target not in live or slot[target] < 0:
                raise InvalidPlan(
                    f"step {i}: frees {values[target].name}, which is not a live activation"
                )
            if target in final:
                raise InvalidPlan(f"step {i}: frees {values[target].name}, an output of the step")
            live.discard(target)
            totals[slot[target]] -= size[target]
            recompute = False
            value = values[target]
            name, label, block = value.name, value.kind, block_of_op[value.producer]
        else:
            raise InvalidPlan(f"step {i}: unknown instruction {kind!r}")
        timeline.append(Step(i, kind, target, name, label, phase, block, recompute, *totals))
        total = totals[0] + totals[1] + totals[2]
        if total > peak:
            peak, peak_step = total, i

    never = [ops[o].name for o in range(len(ops)) if o not in done]
    if never:
        raise InvalidPlan(f"ops never run: {never[:5]}{'...' if len(never) > 5 else ''}")
    missing_final = [values[v].name for v in final if v not in live]
    if missing_final:
        raise InvalidPlan(f"outputs or gradients freed before the end: {missing_final[:5]}")
    return Simulation(timeline, peak, peak_step, time, recomputed)


def runs_keeping(problem: Problem, keep: set[int]) -> tuple[list[int], int]:
    """Op runs for "forward once, keep `keep`, recompute the rest when the backward needs it".

    Forward values outside `keep` are dropped after their last forward use; a backward op that
    reads one recomputes it just before, from whatever is available (recursively). Returns the
    runs and the number of forward runs.
    """
    graph = problem.graph
    ops, values = graph.ops, graph.values
    runs = list(graph.forward_ops)
    available = set(keep) | set(graph.final_values)
    available |= {v.index for v in values if v.producer is None}

    def ensure(v: int) -> None:
        if v in available:
            return
        producer = ops[values[v].producer]
        for u in producer.inputs:
            ensure(u)
        runs.append(producer.index)
        available.update(producer.outputs)

    for o in graph.backward_ops:
        for v in ops[o].inputs:
            ensure(v)
        runs.append(o)
        available.update(ops[o].outputs)
    return runs, len(graph.forward_ops)
