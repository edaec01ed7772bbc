"""The plan: a straight-line program over a graph's ops, with where it came from.

A program is a list of instructions, plain data (see `core.simulator`): `("run", op)`,
`("free", value)`, `("offload", value)` and `("prefetch", value)`. The simulator and the
runtime (`core.runtime`) walk the very same program, so the memory timeline the app draws is
the memory the step uses.

A `Plan` is frozen and always belongs to the problem it was made for: its figures (peak,
time, overhead) are the simulation of its program on that problem, the problem's costs
included. A plan file holds its plain data (`to_data`): the program, what the step was
(`core.graph_meta.GraphMeta`: the trace's identity, the cost model and its op times) and the
figures it predicted. `load_plan` reads one as a `SavedPlan`, plain data whose figures are the
recorded ones; `core.bind` binds it to a model (one route: trace the model as recorded, under
the recorded costs), giving a `Plan` again whose figures are those it was saved with, or a
`PlanMismatch` saying why they cannot be.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from core import plan_io
from core.errors import PlanMismatch
from core.graph_meta import GraphMeta
from core.problem import Problem
from core.simulator import Instruction, Simulation, Step, simulate
from core.trace import describe_difference

# fields a simulation depends on: a plan changed in any other shares its parent's simulation
_SIMULATED = frozenset({"program", "backward_start", "problem"})


@dataclass(frozen=True)
class Prediction:
    """What a program is predicted to cost: peak bytes, seconds, time over store-all's."""

    peak: int
    time: float
    overhead: float


class Figures:
    """The figures a plan is judged by, read from its `prediction` (a `Plan` simulates it,
    a `SavedPlan` carries the recorded one)."""

    if TYPE_CHECKING:

        @property
        def prediction(self) -> Prediction: ...

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


@dataclass(frozen=True)
class Plan(Figures):
    """A program for one traced step (`problem`), with where it came from and what it
    predicts (its simulation on `problem`)."""

    program: list[Instruction]
    backward_start: int
    method: str
    budget: int
    problem: Problem = field(repr=False, compare=False)
    solve_seconds: float = 0.0
    notes: tuple[str, ...] = ()
    # the program's simulation, walked once when first asked for and shared by the plans
    # `replace` makes without changing what it depends on
    _simulated: list[Simulation] = field(default_factory=list, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "notes", tuple(self.notes))

    @property
    def fingerprint(self) -> str:
        """The hash of the traced step the plan runs on (`core.trace.fingerprint`)."""
        return self.problem.fingerprint

    @property
    def graph_meta(self) -> GraphMeta:
        """What the plan records of its step (`core.graph_meta.GraphMeta`)."""
        return self.problem.graph_meta

    def replace(self, **changes: Any) -> Plan:
        """`dataclasses.replace`, sharing the simulation when the program and problem stay."""
        if _SIMULATED.isdisjoint(changes):
            changes["_simulated"] = self._simulated
        return dataclasses.replace(self, **changes)

    def with_notes(self, *notes: str, first: bool = False) -> Plan:
        """The plan with `notes` added after its own (before them when `first`)."""
        return self.replace(notes=(*notes, *self.notes) if first else (*self.notes, *notes))

    def simulate(self) -> Simulation:
        """Walk the program once (kept): timeline, peak and time."""
        if not self._simulated:
            p = self.problem
            sim = simulate(p.graph, p.block_of_op, self.program, self.backward_start, p.link)
            self._simulated.append(sim)
        return self._simulated[0]

    @property
    def prediction(self) -> Prediction:
        """The plan's figures: its program simulated on its problem."""
        sim, base = self.simulate(), self.problem.store_all_time
        return Prediction(sim.peak, sim.time, sim.time / base if base else 1.0)

    @property
    def timeline(self) -> list[Step]:
        return self.simulate().timeline

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
            "graph_meta": self.graph_meta.to_data(),
            "backward_start": int(self.backward_start),
            "program": [[kind, int(target)] for kind, target in self.program],
            "predicted": [
                int(predicted.peak),
                float(predicted.time),
                float(predicted.overhead),
            ],
            "notes": list(self.notes),
        }


@dataclass(frozen=True)
class SavedPlan(Figures):
    """A plan read from a file: plain data, its figures those the file recorded. Apply it
    (`core.apply_plan`) or bind it (`core.bind`) to a model: that traces the model as the
    plan records and gives the `Plan` again, or a PlanMismatch saying what differs."""

    program: list[Instruction]
    backward_start: int
    method: str
    budget: int
    fingerprint: str
    graph_meta: GraphMeta
    prediction: Prediction
    notes: tuple[str, ...] = ()

    def on(self, problem: Problem) -> Plan:
        """The plan on `problem`, a trace of the step it records (same fingerprint), or a
        PlanMismatch saying what differs. `core.bind` finds that problem from a model."""
        if problem.fingerprint != self.fingerprint:
            raise PlanMismatch(
                "the plan was made for another graph: "
                + describe_difference(problem.graph.trace, self.graph_meta.trace_data())
            )
        return Plan(
            self.program,
            self.backward_start,
            self.method,
            self.budget,
            problem,
            notes=self.notes,
        )

    @classmethod
    def from_data(cls, data: Any, name: str = "plan") -> SavedPlan:
        """The plan `Plan.to_data` gave, every field checked (`plan_io.check_data`);
        PlanFileError says what is wrong with `data`. The program is checked against a graph
        when the plan is bound to a model (`core.bind`)."""
        plan_io.check_data(data, name)
        peak, time, overhead = data["predicted"]
        return cls(
            program=[(kind, target) for kind, target in data["program"]],
            backward_start=data["backward_start"],
            method=data["method"],
            budget=data["budget"],
            fingerprint=data["fingerprint"],
            graph_meta=GraphMeta.from_data(data["graph_meta"]),
            prediction=Prediction(peak, float(time), float(overhead)),
            notes=tuple(data["notes"]),
        )


def load_plan(path: str | Path) -> SavedPlan:
    """Read a plan file; never runs code from it. Raises PlanFileError saying what is wrong."""
    return SavedPlan.from_data(plan_io.read(path), str(path))
