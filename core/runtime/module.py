"""`apply_plan(model, plan)`: a drop-in module whose training steps run the plan.

The wrapped module's forward runs the forward part of the plan's program (the same
instructions the simulator walked) inside one `torch.autograd.Function`
(`core.runtime.interpreter`), keeping what the plan keeps; `loss.backward()` then runs the
rest of the program, recomputing what the plan recomputes, and hands autograd the parameter
gradients, which land in the model's own `.grad`. Under `no_grad` it runs the model itself.
Every call that runs the plan is checked against what the trace baked in: the autocast state
and the submodules' plain attributes (`training`, dropout's `p`, ...); PlanMismatch names
what changed. Inputs of other sizes (a short last batch, another sequence length) run their
own plan under the same budget in bytes (`core.shapes`), each compiled once.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from core.bind import bind
from core.errors import InvalidPlan, PlanMismatch
from core.graph import Graph
from core.native.runtime import apply_native
from core.plan import Plan, SavedPlan
from core.runtime.interpreter import CompiledProgram, PlanFunction
from core.runtime.transfers import HostLane, lane_for
from core.shapes import ShapePlan, ShapePlans, Shapes, ShapeSpecError
from core.trace import Autocast, split_call, unflatten_output


class _Tensor:
    """A tensor argument, where the plan bound a value: how an error message shows it."""

    def __repr__(self) -> str:
        return "a tensor"


_TENSOR = _Tensor()


class PlannedModule(nn.Module):
    """A drop-in for `model` that trains under a plan; under no_grad it runs the model."""

    def __init__(
        self, model: nn.Module, graph: Graph, plan: Plan, loss_fn: Callable | None = None
    ) -> None:
        super().__init__()
        self.model = model
        self.loss_fn = loss_fn
        self.plan = plan
        self._graph = graph
        self._program = CompiledProgram(graph, plan)
        self._lanes: dict[torch.device, HostLane] = {}  # an offloading plan's copies, per device
        if self._program.transfers:  # an unsupported device is refused here, not mid-step
            self._lane(next((p.device for p in model.parameters()), torch.device("cpu")))
        self.host_peak = 0  # bytes the last step parked on the host at once (measured)
        trace = graph.trace
        params = dict(model.named_parameters())
        self._param_names = trace.param_names
        self._state_slots = [_slot(model, name) for name in trace.state_names]
        self._params = [params[n] for n in trace.param_names]
        self._input_specs = trace.input_specs
        self._grad_inputs = set(trace.grad_inputs)
        self._call = trace.call
        self._autocast = trace.autocast
        self._watch = trace.module_state.watch(model)
        self.shapes = ShapePlans(model, plan, loss_fn)  # every input shape's plan
        self._steps: dict[Shapes, _ShapeStep] = {}

    def plan_for(self, *args: Any, **kwargs: Any) -> ShapePlan:
        """The plan a call with these inputs runs (made now if its shapes are new), without
        running it: `planned.plan_for(ids, attention_mask=mask, targets=labels)`."""
        targets: tuple = ()
        if self._call.loss:
            given = kwargs.pop("targets", ())
            targets = (given,) if isinstance(given, torch.Tensor) else tuple(given)
        inputs = self._check_call(args, kwargs, targets)
        return self.shapes.get(self.shapes.check(inputs))

    def prepare(self, shapes: dict[str | int, Any]) -> list[ShapePlan]:
        """Plan the shapes `shapes` declares before training (`core.shapes.expand`):
        `planned.prepare({"batch": [8, 3], "seq": (16, 2048)})`."""
        return self.shapes.prepare(shapes)

    def _runner(self, inputs: Sequence[torch.Tensor]) -> Any:
        """What PlanFunction runs for these inputs: this module at the planned shapes, else
        that shape's compiled plan."""
        shapes = self.shapes.check(inputs)
        if shapes == self.shapes.first:
            return self
        if shapes not in self._steps:
            entry = self.shapes.get(shapes)
            self._steps[shapes] = _ShapeStep(self, entry.problem.graph, entry.plan)
        return self._steps[shapes]

    def _lane(self, device: torch.device) -> HostLane:
        if device not in self._lanes:
            self._lanes[device] = lane_for(device)
        return self._lanes[device]

    def _state_tensors(self) -> list[torch.Tensor]:
        """Buffers and frozen parameters, looked up each step (they may be reassigned)."""
        return [getattr(mod, attr) for mod, attr in self._state_slots]

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """The model's output, as `model(*args, **kwargs)` gives it; with a plan made with a
        loss_fn, the loss `loss_fn(output, *targets)`, targets given as `targets=` (a tensor
        or a tuple of them)."""
        targets: tuple = ()
        if self._call.loss:
            given = kwargs.pop("targets", ())
            targets = (given,) if isinstance(given, torch.Tensor) else tuple(given)
        if not torch.is_grad_enabled():
            out = self.model(*args, **kwargs)
            return self.loss_fn(out, *targets) if self.loss_fn is not None else out
        self._check_state()
        inputs = self._check_call(args, kwargs, targets)
        runner = self._runner(inputs)
        outputs = PlanFunction.apply(runner, len(self._params), *self._params, *inputs)
        return unflatten_output(list(outputs), runner._program.graph.trace.output_spec)

    def _check_state(self) -> None:
        """The caller's autocast and the model's switches must be the ones traced."""
        now = Autocast.current()
        if now != self._autocast:
            raise PlanMismatch(
                f"this call runs under {now.describe()}, the plan was made under "
                f"{self._autocast.describe()}: call it as it was analysed, or analyse the model "
                "under this autocast state and make a plan for it"
            )
        self._watch.check()

    def _check_call(self, args: tuple, kwargs: dict, targets: tuple) -> list[Any]:
        """The call's tensors, checked against the plan's call: structure, bound values."""
        inputs, call = split_call(args, kwargs, targets, self._call.loss)
        mine = self._call
        if call.tree != mine.tree or call.n_targets != mine.n_targets:
            raise PlanMismatch(
                f"the plan was made for a call {mine.describe()}, got {call.describe()}"
            )
        given = dict(call.constants)
        for i, want in mine.constants:
            got = given.pop(i, _TENSOR)
            if type(want) is not type(got) or want != got:
                raise PlanMismatch(
                    f"argument {mine.leaf_name(i)} is {got!r}, the plan was made with "
                    f"{want!r}: make a plan for this call"
                )
        for i, got in given.items():
            raise PlanMismatch(
                f"argument {mine.leaf_name(i)} is {got!r}, the plan was made with a tensor "
                "there: make a plan for this call"
            )
        self._check_inputs(inputs)
        return inputs

    def _check_inputs(self, inputs: Sequence[Any]) -> None:
        if len(inputs) != len(self._input_specs):
            raise PlanMismatch(
                f"the plan was made for {len(self._input_specs)} inputs, got {len(inputs)}"
            )
        for i, (x, spec) in enumerate(zip(inputs, self._input_specs, strict=True)):
            if not isinstance(x, torch.Tensor):
                raise PlanMismatch(f"input {i} is a {type(x).__name__}, the plan expects {spec}")
            if x.requires_grad != (i in self._grad_inputs):
                need = "requires" if i in self._grad_inputs else "does not require"
                raise PlanMismatch(f"input {i}: the plan was made for an input that {need} grad")


class _ShapeStep:
    """One other input shape's compiled plan, run by PlanFunction for the planned module
    (whose state tensors, host lanes and host peak it shares)."""

    def __init__(self, module: PlannedModule, graph: Graph, plan: Plan) -> None:
        self._module = module
        self._program = CompiledProgram(graph, plan)
        if self._program.transfers:
            self._lane(next((p.device for p in module._params), torch.device("cpu")))

    @property
    def host_peak(self) -> int:
        return self._module.host_peak

    @host_peak.setter
    def host_peak(self, value: int) -> None:
        self._module.host_peak = value

    def _state_tensors(self) -> list[torch.Tensor]:
        return self._module._state_tensors()

    def _lane(self, device: torch.device) -> HostLane:
        return self._module._lane(device)


def _slot(model: nn.Module, name: str) -> tuple[nn.Module, str]:
    module, _, attr = name.rpartition(".")
    return model.get_submodule(module), attr


RUNTIMES = ("interpreter", "native")


def apply_plan(
    model: nn.Module,
    plan: Plan | SavedPlan,
    loss_fn: Callable[..., torch.Tensor] | None = None,
    runtime: str = "interpreter",
    shapes: dict[str | int, Any] | None = None,
    optimizer: torch.optim.Optimizer | None = None,
) -> nn.Module:
    """Wrap `model` so that training steps run `plan`. The model must be the one the plan was
    made for (same parameters, same code); inputs must have the plan's shapes and dtypes, and
    be passed the same way (positions, keywords). A plan made with a loss_fn needs it again
    here when loaded from a file (the same function: its ops are checked); the module then
    returns the loss: `loss = planned(*args, **kwargs, targets=y)`.

    Nothing in the plan is trusted: `core.bind` checks it against the model (PlanMismatch,
    InvalidPlan naming the step and the reason); the module's `.plan` is the bound plan, its
    predictions recomputed on the model's own trace, not read from a file.

    runtime: "interpreter" (default) runs the plan's program exactly, as predicted, in one
    autograd Function; "native" expresses it through PyTorch's own checkpoint and selective
    policies on the model's layers and returns the model itself (or a `NativeStep` computing
    the loss), which composes with torch.compile and FSDP2; its peak is
    `core.lower(plan).prediction`, not the interpreter's (plan with method="native").

    Inputs of other sizes than the plan's (same dtypes, same call) get their own plan under
    the plan's budget in bytes, made at their first call and cached (`core.shapes`); shapes:
    sizes to plan now, before training, e.g. {"batch": [8, 3], "seq": (16, 2048)} (a range is
    planned at powers of two; see docs/shapes.md). `ShapeInfeasible` (an InfeasibleBudget)
    names a shape no plan fits.

    optimizer: for a plan that runs the optimizer inside its step (analyze's optimizer=),
    loaded from a file or applied to another model: the optimizer whose states the step
    updates, of the recorded kind and hyperparameters (PlanMismatch otherwise).
    """
    if runtime not in RUNTIMES:
        raise ValueError(f"unknown runtime {runtime!r}: use one of {', '.join(RUNTIMES)}")
    if runtime == "native" and shapes is not None:
        raise ShapeSpecError(
            "shapes= plans each shape under the budget, which only runtime='interpreter' "
            "runs; the native runtime applies one plan's checkpoints at every shape with no "
            "budget: drop shapes= or use runtime='interpreter'"
        )
    bound = bind(model, plan, loss_fn, optimizer)
    if runtime == "native" and any(op.update for op in bound.graph.ops):
        raise InvalidPlan(
            "this plan runs the optimizer's updates inside its step (analyze's optimizer=), "
            "which the native runtime does not: autograd would leave the gradients in .grad "
            "and no parameter would change; use runtime='interpreter', or analyse without "
            "optimizer= and call optimizer.step() yourself"
        )
    if runtime == "native":
        with_loss = bound.graph.trace.call.loss
        return apply_native(model, bound.plan, bound.loss_fn, with_loss)
    planned = PlannedModule(model, bound.graph, bound.plan, bound.loss_fn)
    if shapes is not None:
        planned.prepare(shapes)
    return planned
