"""The optimizer inside the step: each parameter updated as soon as its gradient is complete.

`OptimizerStep(optimizer, params)` describes the update of SGD, Adam or AdamW (single-tensor
math) for each parameter the optimizer holds; the capture registers `hook(i)` on each traced
parameter, so the update's ops are traced inside the backward right where autograd completes
the gradient, and the gradient is no longer a value the step returns: the plan frees it
after its update. Optimizer states (moments, momentum buffers, the step count) are the
optimizer's own tensors, created here in `optimizer.state` and lifted into the trace as
constants: persistent, like parameters, outside every peak, updated in place each step.

Parameters and states are written in place, in torch's single-tensor sequence, so an update
holds the temporaries torch's holds. The graph (core.graph) makes every write of a tensor and
every later read of it one op, so whatever order a solver picks keeps each read on its side
of each write.

What it cannot honour raises `UnsupportedOptimizer`, saying what to do instead: gradient
clipping by global norm (it needs every gradient before any update), accumulation across
micro-batches, learning rates that change between steps (a per-batch LR scheduler: the rate
is traced into the step), and options outside the single-tensor math here.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from core.errors import RematError

_SUPPORTED = (torch.optim.SGD, torch.optim.Adam, torch.optim.AdamW)


class UnsupportedOptimizer(RematError, ValueError):
    """An optimizer, or an option of it, the step cannot run inside the backward."""


@dataclass(frozen=True)
class _Hyper:
    """One parameter group's hyperparameters, as traced into the step."""

    kind: str  # "sgd", "adam", "adamw"
    lr: float
    weight_decay: float
    momentum: float = 0.0
    nesterov: bool = False
    maximize: bool = False
    beta1: float = 0.9
    beta2: float = 0.999
    eps: float = 1e-8


class OptimizerStep:
    """The per-parameter updates of `optimizer` over `params` (the step's trainable
    parameters, in trace order); `hook(i)` is what the capture registers on parameter i."""

    def __init__(self, optimizer: torch.optim.Optimizer, params: Sequence[nn.Parameter]) -> None:
        _check_optimizer(optimizer)
        self.optimizer = optimizer
        self.params = list(params)
        group_of = {id(p): g for g in optimizer.param_groups for p in g["params"]}
        self.hyper: list[_Hyper | None] = []
        self.states: list[dict[str, torch.Tensor]] = []
        for p in params:
            group = group_of.get(id(p))
            self.hyper.append(None if group is None else _hyper(optimizer, group))
            self.states.append({} if group is None else _init_state(optimizer, group, p))

    def to_data(self) -> dict[str, Any]:
        """What a plan file records of the optimizer (`optimizer_data`)."""
        return optimizer_data(self.optimizer, self.params)

    def state_tensors(self) -> list[torch.Tensor]:
        """Every state tensor the step updates (moments, buffers, step counts)."""
        return [t for states in self.states for t in states.values()]

    def updates(self, i: int) -> bool:
        """Whether parameter i is updated in the step (it is in the optimizer)."""
        return self.hyper[i] is not None

    def check_unchanged(self) -> None:
        """Raise if a hyperparameter changed since the step was traced (an LR scheduler
        stepping per batch), or if a gradient waits in `.grad` (accumulation)."""
        group_of = {id(p): g for g in self.optimizer.param_groups for p in g["params"]}
        for p, h in zip(self.params, self.hyper, strict=True):
            if h is None:
                continue
            if id(p) not in group_of or _hyper(self.optimizer, group_of[id(p)]) != h:
                raise UnsupportedOptimizer(
                    "the optimizer's hyperparameters changed since the step was planned (a "
                    "learning-rate scheduler stepping per batch?): they are traced into the "
                    "step; analyse and plan again after changing them, or pass optimizer=None "
                    "and step the optimizer yourself"
                )
            if p.grad is not None:
                raise UnsupportedOptimizer(
                    "a parameter holds a gradient from an earlier backward: accumulation "
                    "across micro-batches cannot run with the optimizer in the step (each "
                    "step updates at once); set .grad to None, or pass optimizer=None and "
                    "accumulate with a plan of the step alone"
                )

    def hook(self, i: int, param: torch.Tensor) -> Callable[[torch.Tensor], torch.Tensor]:
        """The gradient hook that updates parameter i (traced) and passes the gradient on."""

        def update(grad: torch.Tensor) -> torch.Tensor:
            h = self.hyper[i]
            assert h is not None
            with torch.no_grad():
                if h.kind == "sgd":
                    _sgd(param, grad, self.states[i], h)
                else:
                    _adam(param, grad, self.states[i], h)
            return grad

        return update


HYPER_FIELDS = tuple(f for f in _Hyper.__dataclass_fields__ if f != "kind")


def optimizer_data(
    optimizer: torch.optim.Optimizer, params: Sequence[torch.Tensor]
) -> dict[str, Any]:
    """The optimizer as a plan file records it, plain data only: its kind, each distinct
    group's hyperparameters and, per trainable parameter (trace order), the index of its
    group (-1: not updated). Creates no state; raises UnsupportedOptimizer as analyze does."""
    _check_optimizer(optimizer)
    group_of = {id(p): g for g in optimizer.param_groups for p in g["params"]}
    groups: list[dict[str, Any]] = []
    of: list[int] = []
    for p in params:
        g = group_of.get(id(p))
        if g is None:
            of.append(-1)
            continue
        h = _hyper(optimizer, g)
        entry = {f: getattr(h, f) for f in HYPER_FIELDS}
        if entry not in groups:
            groups.append(entry)
        of.append(groups.index(entry))
    return {"kind": _hyper_kind(optimizer), "groups": groups, "of": of}


def describe_optimizer_difference(mine: dict[str, Any], theirs: dict[str, Any]) -> str:
    """What differs between two `optimizer_data` records, in words."""
    if mine["kind"] != theirs["kind"]:
        return f"the optimizer is {mine['kind']}, the plan's is {theirs['kind']}"
    if mine["of"] != theirs["of"]:
        return "the optimizer holds other parameters (or groups) than the plan's"
    for a, b in zip(mine["groups"], theirs["groups"], strict=False):
        diff = [f"{k} {a[k]!r} (plan: {b[k]!r})" for k in HYPER_FIELDS if a.get(k) != b.get(k)]
        if diff:
            return "the optimizer's " + ", ".join(diff)
    return "the optimizer's parameter groups differ from the plan's"


def _hyper_kind(optimizer: torch.optim.Optimizer) -> str:
    if isinstance(optimizer, torch.optim.SGD):
        return "sgd"
    return "adamw" if isinstance(optimizer, torch.optim.AdamW) else "adam"


def _check_optimizer(optimizer: torch.optim.Optimizer) -> None:
    if type(optimizer) not in _SUPPORTED:
        raise UnsupportedOptimizer(
            f"{type(optimizer).__name__} cannot run inside the step (SGD, Adam and AdamW "
            "can): step it yourself after backward, with analyze's optimizer=None"
        )
    for g in optimizer.param_groups:
        bad = [k for k in ("amsgrad", "capturable", "differentiable", "fused") if g.get(k)]
        if isinstance(optimizer, torch.optim.SGD) and g["momentum"] and g["dampening"]:
            bad.append("dampening with momentum")
        if any(isinstance(g.get(k), torch.Tensor) for k in ("lr", "betas", "weight_decay")):
            bad.append("tensor hyperparameters")
        if bad:
            raise UnsupportedOptimizer(
                f"{type(optimizer).__name__} with {', '.join(bad)} cannot run inside the "
                "step: turn it off, or step the optimizer yourself (optimizer=None)"
            )


def _hyper(optimizer: torch.optim.Optimizer, g: dict[str, Any]) -> _Hyper:
    if isinstance(optimizer, torch.optim.SGD):
        return _Hyper(
            "sgd", g["lr"], g["weight_decay"], g["momentum"], g["nesterov"], g["maximize"]
        )
    kind = _hyper_kind(optimizer)
    b1, b2 = g["betas"]
    return _Hyper(kind, g["lr"], g["weight_decay"], 0.0, False, g["maximize"], b1, b2, g["eps"])


def _init_state(
    optimizer: torch.optim.Optimizer, group: dict[str, Any], p: torch.Tensor
) -> dict[str, torch.Tensor]:
    """The optimizer's state for p, created as torch's first step would, in its own dict."""
    state = optimizer.state[p]
    if isinstance(optimizer, torch.optim.SGD):
        if not group["momentum"]:
            return {}
        if "momentum_buffer" not in state or state["momentum_buffer"] is None:
            state["momentum_buffer"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        return {"momentum_buffer": state["momentum_buffer"]}
    if "step" not in state:
        state["step"] = torch.tensor(0.0, dtype=torch.float64)
        state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
    if state["step"].dtype != torch.float64:  # torch's own float32 count: keep it exact
        state["step"] = state["step"].to(torch.float64)
    return {k: state[k] for k in ("step", "exp_avg", "exp_avg_sq")}


def _sgd(p: torch.Tensor, grad: torch.Tensor, state: dict[str, torch.Tensor], h: _Hyper) -> None:
    """torch.optim.SGD's single-tensor update, in place on p and the buffer as torch's."""
    g = -grad if h.maximize else grad
    if h.weight_decay:
        g = g.add(p, alpha=h.weight_decay)
    if h.momentum:
        buf = state["momentum_buffer"]
        buf.mul_(h.momentum).add_(g)  # a zero buffer's first step gives g, as torch's clone
        g = g.add(buf, alpha=h.momentum) if h.nesterov else buf
    p.add_(g, alpha=-h.lr)


def _adam(p: torch.Tensor, grad: torch.Tensor, state: dict[str, torch.Tensor], h: _Hyper) -> None:
    """torch.optim.Adam/AdamW's single-tensor update, in place on p and each state as torch's
    (bias corrections from the float64 step count: traced, they change every step)."""
    g = -grad if h.maximize else grad
    step = state["step"].add_(1)
    if h.weight_decay and h.kind == "adamw":
        p.mul_(1 - h.lr * h.weight_decay)
    elif h.weight_decay:
        g = g.add(p, alpha=h.weight_decay)
    exp_avg, exp_avg_sq = state["exp_avg"], state["exp_avg_sq"]
    exp_avg.lerp_(g, 1 - h.beta1)
    exp_avg_sq.mul_(h.beta2).addcmul_(g, g, value=1 - h.beta2)
    bias1 = 1 - torch.pow(h.beta1, step)
    bias2_sqrt = (1 - torch.pow(h.beta2, step)).sqrt()
    step_size = (h.lr / bias1).neg()
    denom = exp_avg_sq.sqrt().div_(bias2_sqrt).add_(h.eps)
    update = exp_avg.mul(step_size).div_(denom)  # torch's addcdiv_: p + (value * m) / denom
    del denom
    p.add_(update)
