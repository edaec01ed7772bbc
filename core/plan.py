"""The plan: a straight-line program over a graph's ops, with where it came from.

A program is a list of instructions, plain data (see `core.simulator`): `("run", op)`,
`("free", value)`, `("offload", value)` and `("prefetch", value)`. The simulator and the
runtime (`core.runtime`) walk the very same program, so the memory timeline the app draws is
the memory the step uses.

A `Plan` is frozen: a change (notes, a solve time, a binding to a problem) is a new plan. Its
figures (peak, time, overhead) have one source, its `prediction`: the simulation of its program
once it is bound to a problem, the figures its file recorded until then. A plan converts to and
from the plain data a plan file holds (`to_data`, `from_data`; `core.plan_io` reads and writes
the file).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Any

from core import plan_io
from core.errors import PlanMismatch, RematError
from core.problem import Problem
from core.simulator import Instruction, Simulation, Step, simulate
from core.trace import describe_difference

# fields a simulation depends on: a plan changed in any other keeps its parent's simulation
_SIMULATED = frozenset({"program", "backward_start", "problem"})


@dataclass(frozen=True)
class Prediction:
    """What a program is predicted to cost: peak bytes, seconds, time over store-all's."""

    peak: int
    time: float
    overhead: float


@dataclass(frozen=True)
class Plan:
    """A program for one traced step, with where it came from and what it predicts."""

    program: list[Instruction]
    backward_start: int
    method: str
    budget: int
    fingerprint: str
    problem: Problem | None = field(default=None, repr=False, compare=False)
    solve_seconds: float = 0.0
    notes: tuple[str, ...] = ()
    graph_meta: dict = field(default_factory=dict)  # params, inputs: to retrace and compare
    # the figures a plan file recorded: the prediction until the plan is bound to a problem
    saved_prediction: Prediction | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "notes", tuple(self.notes))

    def replace(self, **changes: Any) -> Plan:
        """`dataclasses.replace`, keeping the simulation when the program and problem stay."""
        new = dataclasses.replace(self, **changes)
        if "_simulation" in self.__dict__ and _SIMULATED.isdisjoint(changes):
            new.__dict__["_simulation"] = self.__dict__["_simulation"]
        return new

    def with_notes(self, *notes: str, first: bool = False) -> Plan:
        """The plan with `notes` added after its own (before them when `first`)."""
        return self.replace(notes=(*notes, *self.notes) if first else (*self.notes, *notes))

    def attach(self, problem: Problem) -> Plan:
        """This plan bound to the problem it was made for (same graph fingerprint): its
        figures are then simulated on that problem, never read from a file."""
        if problem.fingerprint != self.fingerprint:
            raise PlanMismatch(
                "the plan was made for another graph: "
                + describe_difference(problem.graph.trace, self.graph_meta)
            )
        return self.replace(problem=problem, saved_prediction=None)

    def attached_problem(self) -> Problem:
        """The problem the plan is attached to; RematError when it is not attached."""
        if self.problem is None:
            raise RematError("this plan is not attached to a problem: call plan.attach()")
        return self.problem

    def simulate(self) -> Simulation:
        """Walk the program once (cached): timeline, peak and time."""
        return self._simulation

    @cached_property
    def _simulation(self) -> Simulation:
        problem = self.attached_problem()
        return simulate(
            problem.graph, problem.block_of_op, self.program, self.backward_start, problem.link
        )

    @property
    def prediction(self) -> Prediction:
        """The plan's figures: simulated when bound to a problem, else its file's."""
        if self.problem is None and self.saved_prediction is not None:
            return self.saved_prediction
        sim, base = self.simulate(), self.attached_problem().store_all_time
        return Prediction(sim.peak, sim.time, sim.time / base if base else 1.0)

    @property
    def timeline(self) -> list[Step]:
        return self.simulate().timeline

    @property
    def predicted_peak(self) -> int:
        return self.prediction.peak

    @property
    def predicted_time(self) -> float:
        return self.prediction.time

    @property
    def overhead(self) -> float:
        """Predicted time over the store-all time: 1.0 means no recomputation."""
        return self.prediction.overhead

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
        predicted = self.prediction
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
                int(predicted.peak),
                float(predicted.time),
                float(predicted.overhead),
            ],
            "notes": list(self.notes),
        }

    @classmethod
    def from_data(cls, data: Any, name: str = "plan") -> Plan:
        """The plan `to_data` gave, every field checked (`plan_io.check_data`); PlanFileError
        says what is wrong with `data`. The program is checked against a graph when the plan
        is applied (`core.bind`)."""
        plan_io.check_data(data, name)
        peak, time, overhead = data["predicted"]
        return cls(
            program=[(kind, target) for kind, target in data["program"]],
            backward_start=data["backward_start"],
            method=data["method"],
            budget=data["budget"],
            fingerprint=data["fingerprint"],
            notes=tuple(data["notes"]),
            graph_meta=data["graph_meta"],
            saved_prediction=Prediction(peak, float(time), float(overhead)),
        )


def load_plan(path: str | Path) -> Plan:
    """Read a plan file; never runs code from it. Raises PlanFileError saying what is wrong."""
    return Plan.from_data(plan_io.read(path), str(path))
