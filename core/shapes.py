"""One planned model for every input shape a run meets: a plan per shape, one budget in bytes.

A plan is made for one traced step, whose ops bake in its shapes. A call with other shapes
(a short last batch, another sequence length) gets its own trace and its own plan, under the
same budget in bytes as the first plan (a device's memory does not grow with the batch):

1. the new shape is traced under fake tensors (`core.analyze`, nothing computed);
2. if its store-all peak fits the budget, plain PyTorch is its plan: nothing recomputed;
3. fast path: the plan of the nearest planned shape at or above it (its "bucket": the
   smallest store-all peak not below this one's, else the largest) is carried over: the very
   same program (the same keep and recompute decisions, op by op) on the new graph when the
   two graphs have the same structure (the same ops over the same values; only sizes and
   times differ), simulated on the new graph. It is taken when it fits the budget and saves
   at most CARRY_MAX_EXCESS times the bytes this shape must save (store-all peak - budget):
   a plan saving far more than needed recomputes far more than needed;
4. slow path: otherwise (it misses the budget, the structure differs, or it is far from
   optimal as above) a full solve with the plan's method; the faster of it and a fitting
   carried plan is kept;
5. no plan fits: `ShapeInfeasible` (an `InfeasibleBudget`) names the shape and the smallest
   budget that fits it.

Every shape's plan is cached by its inputs' shapes and dtypes. `ShapePlans.prepare` plans
declared shapes ahead (`apply_plan(..., shapes={"seq": (16, 2048)})`): a range is planned at
its bucket edges (powers of two and its ends), so a size met later inside a bucket takes the
fast path from the edge above it.
"""

from __future__ import annotations

import itertools
import time
import weakref
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import torch
from torch import nn

from core.errors import InfeasibleBudget, PlanMismatch, RematError, UnsupportedModel
from core.plan import Plan
from core.problem import Problem, trace_recorded
from core.schedule import plan_of_program, store_all_plan
from core.solvers import METHODS, solve
from core.trace import TensorSpec
from core.validate import check_program

# A carried plan saving more than this many times the bytes its shape must save is "far from
# optimal": the shape gets a full solve instead (docs/shapes.md).
CARRY_MAX_EXCESS = 2.0
DIM_NAMES = {"batch": 0, "seq": 1}  # what `shapes=` keys name: a dimension of every input

Shapes = tuple[tuple[int, ...], ...]  # each input's shape, in the call's order
Path = Literal["planned", "store_all", "carried", "solved"]


class ShapeSpecError(RematError, ValueError):
    """A `shapes=` declaration that cannot be read: an unknown dimension, a bad size."""


class ShapeInfeasible(InfeasibleBudget):
    """No plan fits the budget at these input shapes; `.minimum` is the smallest that does."""

    def __init__(self, shapes: str, error: InfeasibleBudget) -> None:
        super().__init__(error.budget, error.minimum, error.method)
        self.shapes = shapes
        self.args = (f"inputs {shapes}: {error}; or call the model with smaller inputs",)


@dataclass(frozen=True)
class ShapePlan:
    """One input shape's plan and how it was made (`path`), with the seconds it took."""

    shapes: Shapes
    problem: Problem
    plan: Plan
    path: Path
    analyze_seconds: float
    plan_seconds: float

    @property
    def store_all_peak(self) -> int:
        return self.problem.store_all_peak


def describe(shapes: Shapes) -> str:
    """'[4, 32], [4, 32]': input shapes for messages."""
    return ", ".join(str(list(s)) for s in shapes)


def structure(problem: Problem) -> tuple:
    """What a carried program depends on: the ops over the values, not their sizes or times."""
    g = problem.graph
    ops = tuple((o.label, o.inputs, o.outputs, o.phase, o.random, o.state_update) for o in g.ops)
    return ops, tuple(v.kind for v in g.values), g.final_values


def carry(plan: Plan, problem: Problem, budget: int) -> Plan | None:
    """`plan`'s program on `problem`, another shape's step of the same structure, simulated
    there (None when the structures differ)."""
    if structure(plan.problem) != structure(problem):
        return None
    carried = plan_of_program(problem, plan.program, plan.backward_start, plan.method, budget)
    return carried.with_notes(*plan.notes)


class ShapePlans:
    """The plans of one model for every input shape it meets: made on demand, cached."""

    def __init__(self, model: nn.Module, plan: Plan, loss_fn: Callable | None = None) -> None:
        problem = plan.problem
        self._loss_fn = loss_fn
        trace = problem.graph.trace
        self._model = weakref.ref(model)
        self.budget = int(plan.budget)
        self.method = plan.method
        self._problem = problem
        self._dtypes = [s.dtype for s in trace.input_specs]
        self._grads = set(trace.grad_inputs)
        first = tuple(s.shape for s in trace.input_specs)
        self.first = first
        self._plans: dict[Shapes, ShapePlan] = {
            first: ShapePlan(first, problem, plan, "planned", 0.0, 0.0)
        }
        self._structures: dict[Shapes, tuple] = {first: structure(problem)}

    @property
    def plans(self) -> dict[Shapes, ShapePlan]:
        """Every shape planned so far, the first one included."""
        return dict(self._plans)

    def get(self, shapes: Shapes) -> ShapePlan:
        """The plan for inputs of these shapes (cached); ShapeInfeasible when none fits."""
        if shapes not in self._plans:
            self._plans[shapes] = self._make(shapes)
        return self._plans[shapes]

    def prepare(self, declared: Mapping[str | int, Any]) -> list[ShapePlan]:
        """Plan every shape `declared` spans, largest first (so smaller ones carry from
        them): {"batch": [8, 3], "seq": (16, 2048)}; see `expand`."""
        wanted = expand(declared, self.first)
        wanted.sort(key=lambda s: -sum(_numel(x) for x in s))
        return [self.get(s) for s in wanted]

    def _make(self, shapes: Shapes) -> ShapePlan:
        if self.budget <= 0:
            raise PlanMismatch(
                f"inputs {describe(shapes)}: the plan was made for {describe(self.first)} and "
                "has no budget in bytes to plan other shapes under: make it with core.solve"
            )
        start = time.perf_counter()
        problem = self._analyze(shapes)
        analysed = time.perf_counter()
        self._structures[shapes] = structure(problem)
        plan, path = self._choose(shapes, problem)
        check_program(plan, problem)
        return ShapePlan(
            shapes, problem, plan, path, analysed - start, time.perf_counter() - analysed
        )

    def _choose(self, shapes: Shapes, problem: Problem) -> tuple[Plan, Path]:
        """The store-all plan, the carried one or a full solve's (module docstring)."""
        budget = self.budget
        if problem.store_all_peak <= budget:
            return store_all_plan(problem, "store_all", budget), "store_all"
        ref = self._reference(shapes, problem)
        carried = carry(ref.plan, problem, budget) if ref is not None else None
        fits = carried is not None and carried.predicted_peak <= budget
        if carried is not None and fits:
            saved = problem.store_all_peak - carried.predicted_peak
            if saved <= CARRY_MAX_EXCESS * (problem.store_all_peak - budget):
                return carried, "carried"
        if self.method not in METHODS:
            if carried is not None and fits:
                return carried, "carried"
            raise PlanMismatch(
                f"inputs {describe(shapes)}: the plan's method {self.method!r} cannot be "
                "solved again for them: make the plan with one of " + ", ".join(METHODS)
            )
        try:
            solved = solve(problem, budget, self.method)
        except InfeasibleBudget as e:
            if carried is not None and fits:
                return carried, "carried"
            raise ShapeInfeasible(describe(shapes), e) from None
        if carried is not None and fits and carried.predicted_time <= solved.predicted_time:
            return carried, "carried"
        return solved, "solved"

    def _reference(self, shapes: Shapes, problem: Problem) -> ShapePlan | None:
        """The planned shape of the same structure whose plan carries over: the smallest
        store-all peak not below this shape's, else the largest."""
        mine = self._structures[shapes]
        same = [p for s, p in self._plans.items() if s != shapes and self._structures[s] == mine]
        if not same:
            return None
        above = [p for p in same if p.store_all_peak >= problem.store_all_peak]
        if above:
            return min(above, key=lambda p: p.store_all_peak)
        return max(same, key=lambda p: p.store_all_peak)

    def _analyze(self, shapes: Shapes) -> Problem:
        """The step at these shapes, traced on fake inputs (nothing allocated)."""
        model = self._model()
        if model is None:
            raise RematError("the planned model no longer exists")
        problem, trace = self._problem, self._problem.graph.trace
        costs, _, on = problem.cost_model.partition(":")
        inputs = [(s, d, i in self._grads) for i, (s, d) in enumerate(zip(shapes, self._dtypes))]
        try:
            return trace_recorded(
                model,
                inputs,
                trace.call,
                self._loss_fn,
                costs=costs,
                device=on if costs == "estimated" else "cpu",
                name=problem.name,
                autocast=trace.autocast,
            )
        except UnsupportedModel as e:
            raise PlanMismatch(
                f"the model cannot be traced at inputs {describe(shapes)} ({e}): call it with "
                "shapes it accepts"
            ) from None

    def check(self, inputs: Sequence[torch.Tensor]) -> Shapes:
        """The shapes of a call's inputs; PlanMismatch when a dtype or rank differs."""
        for i, (x, dtype, want) in enumerate(zip(inputs, self._dtypes, self.first, strict=True)):
            got = TensorSpec.of(x)
            if got.dtype != dtype or len(got.shape) != len(want):
                spec = TensorSpec(want, dtype)
                raise PlanMismatch(
                    f"input {i} is {got}, the plan was made for {spec}: a planned model takes "
                    "other sizes, not other dtypes or ranks; make a plan for these inputs"
                )
        return tuple(tuple(int(n) for n in x.shape) for x in inputs)


def bucket_edges(low: int, high: int) -> list[int]:
    """The sizes a range is planned at: its ends and the powers of two between them."""
    edges = {low, high}
    p = 1
    while p < high:
        if p > low:
            edges.add(p)
        p *= 2
    return sorted(edges)


def expand(declared: Mapping[str | int, Any], first: Shapes) -> list[Shapes]:
    """Every combination of the sizes `declared` names, as input shapes. Keys: "batch"
    (dimension 0), "seq" (dimension 1) or a dimension's index; that dimension changes in every
    input whose size there is the first input's having it. Values: a list of sizes, or a
    (low, high) range planned at `bucket_edges`."""
    if not isinstance(declared, Mapping) or not declared:
        raise ShapeSpecError(
            f"shapes= takes a dict such as {{'batch': [8, 3], 'seq': (16, 2048)}}, not {declared!r}"
        )
    axes: list[tuple[int, int, list[int]]] = []  # (dimension, planned size, sizes)
    for key, sizes in declared.items():
        dim = DIM_NAMES.get(key, key) if isinstance(key, str) else key
        if not isinstance(dim, int) or isinstance(dim, bool) or dim < 0:
            raise ShapeSpecError(
                f"shapes= key {key!r}: name a dimension ('batch', 'seq') or give its index"
            )
        having = [s[dim] for s in first if len(s) > dim]
        if not having:
            raise ShapeSpecError(f"shapes= key {key!r}: no input has a dimension {dim}")
        axes.append((dim, having[0], _sizes(key, sizes)))
    out = []
    for combo in itertools.product(*(sizes for _, _, sizes in axes)):
        shapes = [list(s) for s in first]
        for (dim, planned, _), size in zip(axes, combo, strict=True):
            for s in shapes:
                if len(s) > dim and s[dim] == planned:
                    s[dim] = size
        out.append(tuple(tuple(s) for s in shapes))
    return list(dict.fromkeys(out))


def _sizes(key: str | int, sizes: Any) -> list[int]:
    if isinstance(sizes, tuple) and len(sizes) == 2:
        low, high = sizes
        if _positive(low) and _positive(high) and low <= high:
            return bucket_edges(low, high)
    elif isinstance(sizes, (list, range)) and sizes and all(_positive(n) for n in sizes):
        return sorted(set(sizes))
    raise ShapeSpecError(
        f"shapes= {key!r}: give a list of sizes ([8, 3]) or a range (low, high) of positive "
        f"integers, not {sizes!r}"
    )


def _positive(n: Any) -> bool:
    return isinstance(n, int) and not isinstance(n, bool) and n > 0


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n
