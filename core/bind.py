"""Bind a plan to a model: a plan + a model (+ its loss_fn) -> a checked, simulated program.

Nothing in a plan is trusted: it may come from a file someone edited. A plan made on this very
model in this process is bound as it is. Any other (a `SavedPlan` read from a file, or a plan
made on another model) is checked against the model: the recorded graph metadata
(`core.plan_io.check_graph_meta`), the model's parameters and optimizer, then the one retrace
(`core.problem.trace_recorded`: fake inputs shaped and passed as recorded, under the recorded
autocast, loss head and costs) and its graph fingerprint. The plan's program is then walked on
that problem: a plan file's recorded figures must come out the same, since the costs are its
own. Last, its program is checked by `core.validate.check_program`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from core.costs import detected_model
from core.errors import CostsDiffer, PlanMismatch, UnsupportedModel, fmt_bytes
from core.graph import Graph
from core.graph_meta import GraphMeta
from core.optimizer_step import describe_optimizer_difference, optimizer_data
from core.plan import Plan, SavedPlan
from core.plan_io import check_graph_meta
from core.problem import Problem, trace_recorded
from core.simulator import Simulation
from core.trace import TensorSpec, describe_difference, other_libraries
from core.trace.device import DeviceModel
from core.validate import check_program


@dataclass(frozen=True)
class BoundPlan:
    """A plan checked against a model: the plan, the problem (the model's trace) its program
    runs on, its simulation there, and the loss_fn the step applies."""

    plan: Plan
    problem: Problem
    simulation: Simulation
    loss_fn: Callable[..., torch.Tensor] | None

    @property
    def graph(self) -> Graph:
        return self.problem.graph


def bind(
    model: nn.Module,
    plan: Plan | SavedPlan,
    loss_fn: Callable[..., torch.Tensor] | None = None,
    optimizer: torch.optim.Optimizer | None = None,
) -> BoundPlan:
    """`plan` checked against `model` and bound to its trace. A plan made on this very model
    in this process is used as it is (its loss_fn and optimizer the problem's unless others
    are given); any other is traced again from what it records (PlanMismatch says what
    differs), with `optimizer` bound to the step when the plan runs one (it must be the
    recorded kind and hyperparameters). Then its program is validated (InvalidPlan names the
    step and the reason)."""
    _check_device(model, plan.graph_meta.device)
    if isinstance(plan, Plan) and _made_on(plan, model, optimizer):
        check_program(plan, plan.problem)
        return BoundPlan(plan, plan.problem, plan.simulate(), loss_fn or plan.problem.loss_fn)
    saved = plan if isinstance(plan, SavedPlan) else _saved(plan)
    bound = saved.on(retrace(model, saved, loss_fn, optimizer))
    check_program(bound, bound.problem)
    _check_figures(bound, saved)
    return BoundPlan(bound, bound.problem, bound.simulate(), loss_fn)


def retrace(
    model: nn.Module,
    plan: SavedPlan,
    loss_fn: Callable[..., torch.Tensor] | None = None,
    optimizer: torch.optim.Optimizer | None = None,
) -> Problem:
    """`model`'s step traced as `plan` records it (inputs, call, autocast, loss head, under
    the recorded costs), checked to be the plan's step (the fingerprint); PlanMismatch says
    what differs."""
    meta = plan.graph_meta
    check_graph_meta(meta.to_data())
    _check_params(model, plan)
    _check_optimizer(model, plan, optimizer)
    if meta.call is not None and meta.call_spec is None:
        raise PlanMismatch(
            "this plan's call holds arguments a plan file cannot carry (custom containers or "
            "objects): apply the plan in the process that made it (core.apply_plan(model, plan))"
        )
    if meta.call is not None and meta.call["loss"] and loss_fn is None:
        raise PlanMismatch(
            "this plan was made with a loss_fn: pass the same one, "
            "core.apply_plan(model, plan, loss_fn=...)"
        )
    try:
        problem = trace_recorded(
            model,
            meta.inputs,
            meta.call_spec,
            loss_fn,
            values=meta.values,
            costs=meta.costs if meta.costs is not None else "estimated",
            autocast=meta.autocast,
            loss_head=meta.loss_head,
            optimizer=optimizer,
            device=meta.device.name,
            attention=meta.device.attention,
        )
    except CostsDiffer as e:
        raise PlanMismatch(
            "the model's traced operations differ from the plan's: "
            + describe_difference(e.trace, meta.trace_data())
            + _other_torch(meta)
            + other_libraries(meta.libraries, model)
            + ": make a new plan for this model here"
        ) from None
    except UnsupportedModel as e:
        raise PlanMismatch(
            f"the model cannot run on the plan's recorded inputs {list(meta.inputs)} "
            f"({e}): the plan was made for other inputs or another model"
        ) from None
    if problem.fingerprint != plan.fingerprint:
        raise PlanMismatch(
            "the model's traced operations differ from the plan's: "
            + describe_difference(problem.graph.trace, meta.trace_data())
            + _other_torch(meta)
            + other_libraries(meta.libraries, model)
            + ": make a new plan for this model"
        )
    return problem


def _other_torch(meta: GraphMeta) -> str:
    """'; the plan was traced with torch 2.13.0, this is torch 2.11.0' where they differ:
    another torch can dispatch other ops (autocast's casts, attention kernels)."""
    if not meta.torch_version or meta.torch_version == torch.__version__:
        return ""
    return (
        f"; the plan was traced with torch {meta.torch_version}, this is torch {torch.__version__}"
    )


def _check_device(model: nn.Module, planned: DeviceModel) -> None:
    """A plan runs on the device it was traced for (its kernels: flash attention is no CPU
    op): PlanMismatch names both where the model is on another."""
    on = next((p.device for p in model.parameters()), torch.device("cpu"))
    mine = detected_model(on)
    if (mine.type, mine.capability) != (planned.type, planned.capability):
        raise PlanMismatch(
            f"this plan was made for {planned.describe()}, the model is on {on} "
            f"({mine.describe()}): apply it on {planned.name}, or make a plan for this device "
            f"(core.analyze(..., device={mine.name!r}))"
        )


def _made_on(plan: Plan, model: nn.Module, optimizer: torch.optim.Optimizer | None) -> bool:
    """Whether `plan` was made on this very model (and runs this optimizer, when given)."""
    problem = plan.problem
    if problem.model_ref is None or problem.model_ref() is not model:
        return False
    if optimizer is None:
        return True
    return problem.optimizer_step is not None and problem.optimizer_step.optimizer is optimizer


def _saved(plan: Plan) -> SavedPlan:
    """A plan made on another model, as its file would hold it."""
    return SavedPlan.from_data(plan.to_data(), f"the {plan.method} plan")


def _check_figures(plan: Plan, saved: SavedPlan) -> None:
    """A plan bound under its own recorded costs predicts what it recorded, or the binding
    is not the plan that was shown: PlanMismatch says both."""
    if saved.graph_meta.costs is None:  # a version 1 file: figured under estimated cpu costs
        return
    mine, theirs = plan.prediction, saved.prediction
    if (mine.peak, mine.time) != (theirs.peak, theirs.time):
        raise PlanMismatch(
            f"the plan records a peak of {fmt_bytes(theirs.peak)} and {theirs.time * 1e3:.3f} "
            f"ms, but walks to {fmt_bytes(mine.peak)} and {mine.time * 1e3:.3f} ms on this "
            "model under the plan's own costs: the file was edited or made by another "
            "version; make the plan again"
        )


def _check_optimizer(
    model: nn.Module, plan: SavedPlan, optimizer: torch.optim.Optimizer | None
) -> None:
    """The optimizer given must be the one the plan runs in its step (kind, hyperparameters,
    parameters held), or none when the plan runs none."""
    theirs = plan.graph_meta.optimizer
    if theirs is None and optimizer is not None:
        raise PlanMismatch(
            "this plan does not run an optimizer in its step: apply it without optimizer= and "
            "step the optimizer yourself, or make a plan with core.analyze(..., optimizer=opt)"
        )
    if theirs is not None and optimizer is None:
        raise PlanMismatch(
            f"this plan runs {theirs['kind']} inside its step: pass that optimizer, "
            "core.apply_plan(model, plan, optimizer=opt)"
        )
    if optimizer is None or theirs is None:
        return
    mine = optimizer_data(optimizer, [p for p in model.parameters() if p.requires_grad])
    if mine != theirs:
        raise PlanMismatch(
            describe_optimizer_difference(mine, theirs)
            + ": pass the optimizer the plan was made with, or make a new plan with this one"
        )


def _check_params(model: nn.Module, plan: Plan | SavedPlan) -> None:
    """The model's trainable parameters, names and specs, must be the plan's."""
    mine = [[n, str(TensorSpec.of(p))] for n, p in model.named_parameters() if p.requires_grad]
    theirs = [list(p) for p in plan.graph_meta.params]
    if mine != theirs:
        names_mine, names_theirs = {m[0] for m in mine}, {t[0] for t in theirs}
        if names_mine != names_theirs:
            extra = sorted(names_mine - names_theirs)[:3]
            missing = sorted(names_theirs - names_mine)[:3]
            raise PlanMismatch(
                f"the model's parameters differ from the plan's: the model has {extra or 'no'} "
                f"extra and lacks {missing or 'none'} of the plan's: this plan is for another model"
            )
        for (n, a), (_, b) in zip(sorted(mine), sorted(theirs)):
            if a != b:
                raise PlanMismatch(
                    f"parameter {n} is {a}, the plan was made for {b}: make a plan for this model"
                )
