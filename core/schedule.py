"""The plan: a straight-line program over the graph's ops, with where it came from.

A program is a list of instructions, plain data (see `core.simulator`): `("run", op)`,
`("free", value)`, `("offload", value)` and `("prefetch", value)`. The simulator and the runtime (`core.runtime`) walk the very same program,
so the memory timeline the app draws is the memory the step uses. A plan converts to and from
the plain data a plan file holds (`Plan.to_data`, `Plan.from_data`; `core.plan_io` reads and
writes the file).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from core import plan_io
from core.errors import PlanMismatch, RematError
from core.problem import Problem
from core.simulator import (
    Instruction,
    Simulation,
    Step,
    program_from_runs,
    simulate,
    store_all_program,
)
from core.trace import describe_difference


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
                "the plan was made for another graph: "
                + describe_difference(problem.graph.trace, self.graph_meta)
            )
        self.problem = problem
        self._sim = None
        return self

    def attached_problem(self) -> Problem:
        """The problem the plan is attached to; RematError when it is not attached."""
        if self.problem is None:
            raise RematError("this plan is not attached to a problem: call plan.attach()")
        return self.problem

    def simulate(self) -> Simulation:
        """Walk the program once (cached): timeline, peak and time."""
        if self._sim is None:
            problem = self.attached_problem()
            self._sim = simulate(
                problem.graph,
                problem.block_of_op,
                self.program,
                self.backward_start,
                problem.link,
            )
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
        return self.predicted_time / self.attached_problem().store_all_time

    @property
    def predicted_host_bytes(self) -> int:
        """Most bytes the program parks in host memory at once (0 without offloads)."""
        return self.simulate().host_peak

    @property
    def recomputed_ops(self) -> int:
        return self.simulate().recomputed_ops

    def save(self, path: str | Path) -> None:
        """Write the plan file: a pickle of `to_data()` (see core.plan_io)."""
        plan_io.write(self.to_data(), path)

    def to_data(self) -> dict[str, Any]:
        """The plan as plain data: what a plan file holds."""
        return {
            "format": plan_io.FORMAT,
            "version": plan_io.VERSION,
            "method": self.method,
            "budget": int(self.budget),
            "fingerprint": self.fingerprint,
            "graph_meta": self.graph_meta,
            "backward_start": int(self.backward_start),
            "program": [[kind, int(target)] for kind, target in self.program],
            "predicted": [
                int(self.predicted_peak),
                float(self.predicted_time),
                float(self.overhead),
            ],
            "notes": list(self.notes),
        }

    @classmethod
    def from_data(cls, data: Any, name: str = "plan") -> Plan:
        """The plan `to_data` gave, every field checked (`plan_io.check_data`); PlanFileError
        says what is wrong with `data`. The program is checked against a graph on `attach`
        and `apply_plan` (`core.validate.check_program`)."""
        plan_io.check_data(data, name)
        predicted = data["predicted"]
        plan = cls(
            program=[(kind, target) for kind, target in data["program"]],
            backward_start=data["backward_start"],
            method=data["method"],
            budget=data["budget"],
            fingerprint=data["fingerprint"],
            notes=list(data["notes"]),
            graph_meta=data["graph_meta"],
        )
        plan.saved_prediction = (predicted[0], float(predicted[1]), float(predicted[2]))
        return plan


def load_plan(path: str | Path) -> Plan:
    """Read a plan file; never runs code from it. Raises PlanFileError saying what is wrong."""
    return Plan.from_data(plan_io.read(path), str(path))


def plan_from_runs(
    problem: Problem,
    runs: Sequence[int],
    backward_start: int,
    method: str,
    budget: int,
) -> Plan:
    """The plan of a sequence of op runs, each value freed right after its last read before
    it is produced again (`core.simulator.program_from_runs`), so a solver only chooses what
    runs when. `backward_start` counts runs: the first `backward_start` runs are the forward."""
    graph = problem.graph
    program, start = program_from_runs(graph.ops, runs, backward_start, graph.final_values)
    return plan_of_program(problem, program, start, method, budget)


def plan_of_program(
    problem: Problem, program: list[Instruction], backward_start: int, method: str, budget: int
) -> Plan:
    """A plan of `problem` running `program` (its first `backward_start` steps the forward)."""
    return Plan(
        program,
        backward_start,
        method,
        budget,
        problem.fingerprint,
        problem=problem,
        graph_meta=problem.graph_meta,
    )


def store_all_plan(problem: Problem, method: str = "store_all", budget: int = 0) -> Plan:
    """Plain PyTorch: every op once, in order, each value freed after its last use."""
    program, start = store_all_program(problem.graph)
    return plan_of_program(problem, program, start, method, budget)
