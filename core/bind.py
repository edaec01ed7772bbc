"""Bind a plan to a model: a plan + a model (+ its loss_fn) -> a checked, bound program.

Nothing in a plan is trusted: it may come from a file someone edited. A plan not bound to
this very model is checked against the model's own trace: the recorded graph metadata
(`core.plan_io.check_graph_meta`), the model's parameters, then a retrace on fake inputs shaped
and passed as the plan records (nothing is allocated, however large the shapes) and the graph
fingerprint; an unbound plan is then bound to that trace, so its predictions are recomputed,
not read from a file. Last, its program is checked by `core.validate.check_program`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode

from core.errors import PlanMismatch, UnsupportedModel
from core.graph import Graph
from core.optimizer_step import describe_optimizer_difference, optimizer_data
from core.plan import Plan
from core.plan_io import check_graph_meta
from core.problem import Problem, analyze
from core.trace import Autocast, CallSpec, TensorSpec, describe_difference, join_call
from core.trace.loss_head import LossHead
from core.validate import check_program


@dataclass(frozen=True)
class Bound:
    """A plan checked against a model: the plan (bound to a problem), the graph of the
    model's trace its program runs on, and the loss_fn the step applies."""

    plan: Plan
    graph: Graph
    loss_fn: Callable[..., torch.Tensor] | None


def bind(
    model: nn.Module,
    plan: Plan,
    loss_fn: Callable[..., torch.Tensor] | None = None,
    optimizer: torch.optim.Optimizer | None = None,
) -> Bound:
    """`plan` checked against `model` and bound to a problem. A plan made on this very model
    in this process is used as it is (its loss_fn and optimizer the problem's unless others
    are given); any other is checked against the model's trace (PlanMismatch says what
    differs), with `optimizer` bound to the step when the plan runs one (it must be the
    recorded kind and hyperparameters). Then its program is validated (InvalidPlan names the
    step and the reason)."""
    problem = plan.problem
    same = problem is not None and problem.model_ref is not None and problem.model_ref() is model
    if same and problem is not None and optimizer is not None:  # another optimizer: retrace
        same = problem.optimizer_step is not None and problem.optimizer_step.optimizer is optimizer
    if same and problem is not None:
        graph, loss_fn = problem.graph, loss_fn or problem.loss_fn
    else:
        mine = _problem_for(model, plan, loss_fn, optimizer)
        graph = mine.graph
        if problem is None or mine.optimizer_step is not None:
            plan = plan.attach(mine)  # the step runs this optimizer, its states
        elif problem.fingerprint != mine.fingerprint:
            raise PlanMismatch(
                "the plan was made for another graph: "
                + describe_difference(mine.graph.trace, plan.graph_meta)
            )
    check_program(plan, plan.attached_problem())
    return Bound(plan, graph, loss_fn)


def _problem_for(
    model: nn.Module,
    plan: Plan,
    loss_fn: Callable[..., torch.Tensor] | None,
    optimizer: torch.optim.Optimizer | None = None,
) -> Problem:
    """Trace `model` on fake inputs shaped and passed as the plan records (nothing is
    allocated, however large the recorded shapes) and check the trace is the plan's."""
    check_graph_meta(plan.graph_meta)
    _check_params(model, plan)
    _check_optimizer(model, plan, optimizer)
    device = next((p.device for p in model.parameters()), torch.device("cpu"))
    with FakeTensorMode():
        example = [
            torch.empty(shape, dtype=getattr(torch, dtype), device=device).requires_grad_(grad)
            for shape, dtype, grad in plan.graph_meta["inputs"]
        ]
    meta = plan.graph_meta.get("call")
    kwargs: dict[str, Any]
    if meta is None:  # plans from before keyword inputs: positional tensors
        args, kwargs, targets = tuple(example), {}, ()
    elif meta["tree"] is None:
        raise PlanMismatch(
            "this plan's call holds arguments a plan file cannot carry (custom containers or "
            "objects): apply the plan in the process that made it (core.apply_plan(model, plan))"
        )
    else:
        args, kwargs, targets = join_call(example, CallSpec.from_data(meta))
        if meta["loss"] and loss_fn is None:
            raise PlanMismatch(
                "this plan was made with a loss_fn: pass the same one, "
                "core.apply_plan(model, plan, loss_fn=...)"
            )
    try:
        problem = analyze(
            model,
            args,
            kwargs,
            loss_fn if meta and meta["loss"] else None,
            targets,
            autocast=Autocast.from_data(plan.graph_meta.get("autocast", [])),
            loss_head=LossHead.from_data(plan.graph_meta.get("loss_head")),
            optimizer=optimizer,
        )
    except UnsupportedModel as e:
        raise PlanMismatch(
            f"the model cannot run on the plan's recorded inputs {plan.graph_meta['inputs']} "
            f"({e}): the plan was made for other inputs or another model"
        ) from None
    if problem.fingerprint != plan.fingerprint:
        raise PlanMismatch(
            "the model's traced operations differ from the plan's: "
            + describe_difference(problem.graph.trace, plan.graph_meta)
            + ": make a new plan for this model"
        )
    return problem


def _check_optimizer(model: nn.Module, plan: Plan, optimizer: torch.optim.Optimizer | None) -> None:
    """The optimizer given must be the one the plan runs in its step (kind, hyperparameters,
    parameters held), or none when the plan runs none."""
    theirs = plan.graph_meta.get("optimizer")
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


def _check_params(model: nn.Module, plan: Plan) -> None:
    """The model's trainable parameters, names and specs, must be the plan's."""
    mine = [[n, str(TensorSpec.of(p))] for n, p in model.named_parameters() if p.requires_grad]
    theirs = plan.graph_meta.get("params", [])
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
