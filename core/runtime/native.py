"""A plan expressed through PyTorch's own mechanisms: `apply_native(model, bound)`.

Each block of the plan's chain whose forward is exactly one submodule's forward (a layer,
e.g. `transformer.h.3`) and where the plan recomputes something runs inside non-reentrant
`torch.utils.checkpoint.checkpoint`, with a selective policy
(`create_selective_checkpoint_contexts`): the ops whose results the plan keeps through the
forward are MUST_SAVE, the others PREFER_RECOMPUTE. Blocks the plan keeps whole run as they
are. Autograd runs the backward and checkpoint the recomputes; the parameters stay the
model's own, so `fully_shard` and `torch.compile` apply afterwards. Dropout replays exactly
(checkpoint's `preserve_rng_state`).

The policy sees the block's ATen ops in the order they run; the trace recorded the same ops
in the same order (`core.trace` mirrors eager op for op), so the n-th op the policy sees is
the n-th traced op of that module (python `getitem`s and the `detach`es checkpoint ignores
left out). A run whose ops do not line up with the trace raises PlanMismatch rather than
guess.

What native execution does not express is reported, not hidden (`Lowering.notes`): a block
that recomputes but is no submodule's forward (the embeddings and the loss of a model that
computes it in its root forward) runs as eager does; a plan running a forward op more than
twice (Rotor's repeated forwards) recomputes it once; checkpoint recomputes a region when its
first saved value is unpacked, up to the last one needed (early stop), not op by op as the
plan's program does, so the measured peak differs from the plan's prediction (see
docs/native.md). Offloading plans are refused (InvalidPlan).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import (
    SAC_IGNORED_OPS,
    CheckpointPolicy,
    checkpoint,
    create_selective_checkpoint_contexts,
)

from core.errors import InvalidPlan, PlanMismatch
from core.plan import Plan
from core.problem import Problem
from core.runtime.kv_cache import kv_cache_guard
from core.simulator import OFFLOAD, PREFETCH

_SAVE, _RECOMPUTE = CheckpointPolicy.MUST_SAVE, CheckpointPolicy.PREFER_RECOMPUTE
# make_fx records `lift_fresh` (a tensor made from Python data) as `lift_fresh_copy`
# (torch/fx/experimental/proxy_tensor.py): eager dispatch shows the former
_TRACED_AS = {torch.ops.aten.lift_fresh.default: torch.ops.aten.lift_fresh_copy.default}
_MARK = "_remat_native"  # attribute on the model: the installed lowering (to remove it)


@dataclass(frozen=True)
class Region:
    """One block run as a checkpointed submodule: the ops its policy sees, in order, and
    for each whether its result is saved (True) or recomputed."""

    block: int
    module: str  # the submodule path, e.g. "transformer.h.0"
    ops: tuple[Any, ...]  # ATen OpOverloads, in execution order
    save: tuple[bool, ...]
    recomputed_ops: int  # graph ops of the block the plan recomputes


@dataclass(frozen=True)
class Lowering:
    """A plan as native execution runs it: the checkpointed regions and what it leaves out."""

    regions: tuple[Region, ...]
    notes: tuple[str, ...]


class _Policy:
    """The selective-checkpoint policy of one run of a region: the n-th op it is asked
    about must be the region's n-th traced op."""

    def __init__(self, region: Region) -> None:
        self.region = region
        self.calls = 0
        self.per_op: dict[Any, int] = {}  # under torch.compile: calls per op so far

    def __call__(self, ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
        if torch.compiler.is_compiling():
            return self._traced(op)
        region, n = self.region, self.calls
        if n >= len(region.ops) or region.ops[n] != _TRACED_AS.get(op, op):
            want = str(region.ops[n]) if n < len(region.ops) else "the end of the block"
            raise PlanMismatch(
                f"{region.module}: op {n} of the block runs {op}, the trace has {want}: the "
                "model runs other ops than it did when analysed (training mode, autocast, "
                "shapes or code changed); analyse the model as it runs now"
            )
        self.calls += 1
        return _SAVE if region.save[n] else _RECOMPUTE

    def _traced(self, op: Any) -> CheckpointPolicy:
        """The policy while torch.compile traces the region: its ops are decomposed otherwise
        than eager's (dropout as `native_dropout`, other views), so the k-th call of an op
        is matched to the k-th traced call of the same op, as SAC itself counts them; ops
        the trace lacks are recomputed, and random ops are saved, since a compiled
        recompute would draw fresh random numbers."""
        if torch.Tag.nondeterministic_seeded in op.tags:
            return _SAVE
        k = self.per_op.get(op, 0)
        self.per_op[op] = k + 1
        same = [i for i, o in enumerate(self.region.ops) if o == _TRACED_AS.get(op, op)]
        return _SAVE if k < len(same) and self.region.save[same[k]] else _RECOMPUTE

    def check_done(self) -> None:
        """Every traced op of the region ran (called after the region's forward)."""
        if self.calls != len(self.region.ops):
            raise PlanMismatch(
                f"{self.region.module}: the block ran {self.calls} ops, the trace has "
                f"{len(self.region.ops)}: analyse the model as it runs now"
            )


def lower(plan: Plan) -> Lowering:
    """The regions and notes of `plan` (bound to its problem) under native execution.
    InvalidPlan when the plan offloads (native execution does not move values yet)."""
    problem = plan.attached_problem()
    if any(kind in (OFFLOAD, PREFETCH) for kind, _ in plan.program):
        raise InvalidPlan(
            "this plan offloads activations to the host; native execution does not express "
            "offloads yet: apply it with runtime='interpreter', or make a plan without offload"
        )
    sim = plan.simulate()
    kept = sim.live_after(plan.backward_start - 1)
    runs = {o: len(steps) for o, steps in sim.op_steps.items()}
    regions: list[Region] = []
    notes: list[str] = []
    for block in problem.blocks:
        recomputed = [o for o in block.forward_ops if runs.get(o, 0) > 1]
        if not recomputed:
            continue  # kept whole (or freed and never needed): runs as eager does
        module = _module_of(problem, block.index)
        if module is None:
            notes.append(
                f"block {block.index} ({block.name or 'the root'}): the plan recomputes "
                f"{len(recomputed)} ops there, but no submodule runs exactly this block; "
                "native execution keeps it whole"
            )
            continue
        repeated = sum(1 for o in recomputed if runs[o] > 2)
        if repeated:
            notes.append(
                f"block {block.index} ({module}): the plan runs {repeated} forward ops more "
                "than twice; checkpoint recomputes them once"
            )
        regions.append(_region(problem, block.index, module, kept, len(recomputed)))
    return Lowering(tuple(regions), tuple(notes))


def _module_nodes(problem: Problem, module: str) -> list[int]:
    """Traced forward nodes run inside `module` (or its children), in order."""
    prefix = module + "."
    return [
        n.index
        for n in problem.graph.trace.nodes
        if n.role == "op"
        and n.module is not None
        and (n.module == module or n.module.startswith(prefix))
    ]


def _module_of(problem: Problem, block: int) -> str | None:
    """The submodule whose forward runs exactly `block`'s ops (step constants aside), in
    one contiguous stretch of the trace; None when there is none."""
    name = problem.blocks[block].name
    if not name:
        return None
    graph, consts = problem.graph, set(problem.constant_ops)
    op_of = {n: op.index for op in graph.ops for n in op.nodes}
    nodes = _module_nodes(problem, name)
    forward = [n.index for n in graph.trace.nodes if n.role == "op" and n.module is not None]
    if not nodes or forward[forward.index(nodes[0]) : forward.index(nodes[-1]) + 1] != nodes:
        return None  # interleaved with other modules' ops: called twice, or shared
    mine = {op_of[n] for n in nodes if n in op_of} - consts
    if mine != set(problem.blocks[block].forward_ops) - consts:
        return None
    return name


def _region(problem: Problem, block: int, module: str, kept: set[int], recomputed: int) -> Region:
    """The region's ops in execution order and what its policy saves: an op (with the
    aliasing and in-place nodes folded into it) is saved when the plan keeps one of its
    results through the forward. A random op is saved only when every later random op of
    the region is: a cached op draws no random numbers on recompute, so a later recomputed
    one would draw others than in the forward."""
    graph = problem.graph
    nodes = graph.trace.nodes
    op_of = {n: op.index for op in graph.ops for n in op.nodes}
    order = [
        n
        for n in _module_nodes(problem, module)
        if isinstance(nodes[n].target, torch._ops.OpOverload)
    ]
    order = [n for n in order if nodes[n].target not in SAC_IGNORED_OPS]
    ops_in = sorted({op_of[n] for n in order if n in op_of})
    saved = {o for o in ops_in if kept.intersection(graph.ops[o].outputs)}
    later_recomputed = False
    for o in reversed(ops_in):
        if graph.ops[o].random:
            if later_recomputed:
                saved.discard(o)
            later_recomputed = later_recomputed or o not in saved
    save = tuple(op_of.get(n) in saved for n in order)
    return Region(block, module, tuple(nodes[n].target for n in order), save, recomputed)


def _wrapped(region: Region, forward: Callable[..., Any]) -> Callable[..., Any]:
    """`forward` run under non-reentrant checkpoint with the region's selective policy. The
    context function is a plain function (torch.compile takes it as it is; a partial would
    have to be a constant) making a fresh policy for each run."""
    made: list[_Policy] = []
    refuse_kv_cache = kv_cache_guard(region.module, forward)

    def contexts() -> tuple[Any, Any]:
        made[:] = [_Policy(region)]
        return create_selective_checkpoint_contexts(made[0], allow_cache_entry_mutation=True)

    @functools.wraps(forward)
    def run(*args: Any, **kwargs: Any) -> Any:
        if not torch.is_grad_enabled():
            return forward(*args, **kwargs)
        refuse_kv_cache(args, kwargs)
        out = checkpoint(forward, *args, use_reentrant=False, context_fn=contexts, **kwargs)
        if not torch.compiler.is_compiling():
            made[0].check_done()
        return out

    return run


class NativeHandle:
    """The checkpoint wrappers installed on a model's submodules; `remove()` undoes them."""

    def __init__(self, model: nn.Module, plan: Plan, lowering: Lowering) -> None:
        self.plan = plan
        self.lowering = lowering
        self._restore: list[tuple[nn.Module, Any]] = []
        for region in lowering.regions:
            sub = model.get_submodule(region.module)
            self._restore.append((sub, sub.__dict__.get("forward")))
            sub.forward = _wrapped(region, sub.forward)
        self._model = model
        setattr(model, _MARK, self)

    @property
    def notes(self) -> tuple[str, ...]:
        return self.lowering.notes

    def remove(self) -> None:
        """The model as it was before the plan was applied."""
        for sub, own in reversed(self._restore):
            if own is None:
                del sub.forward
            else:
                sub.forward = own
        self._restore.clear()
        if getattr(self._model, _MARK, None) is self:
            delattr(self._model, _MARK)


class NativeStep(nn.Module):
    """`loss_fn(model(*args, **kwargs), *targets)` for a plan made with a loss_fn: the
    planned module's call, `loss = step(*args, **kwargs, targets=y)`."""

    def __init__(self, model: nn.Module, loss_fn: Callable[..., torch.Tensor]) -> None:
        super().__init__()
        self.model = model
        self.loss_fn = loss_fn

    def forward(self, *args: Any, targets: Any = (), **kwargs: Any) -> torch.Tensor:
        given = (targets,) if isinstance(targets, torch.Tensor) else tuple(targets)
        return self.loss_fn(self.model(*args, **kwargs), *given)


def native_handle(model: nn.Module) -> NativeHandle | None:
    """The native plan installed on `model` (or a NativeStep's model), if any."""
    inner = model.model if isinstance(model, NativeStep) else model
    return getattr(inner, _MARK, None)


def apply_native(
    model: nn.Module, plan: Plan, loss_fn: Callable[..., torch.Tensor] | None, with_loss: bool
) -> nn.Module:
    """Install `plan` (bound to `model`) on the model's submodules: the model itself, or a
    `NativeStep` computing the loss when the plan was made with a loss_fn."""
    if native_handle(model) is not None:
        raise PlanMismatch(
            "a plan is already applied natively to this model: remove it first "
            "(core.runtime.native.native_handle(model).remove())"
        )
    NativeHandle(model, plan, lower(plan))
    if with_loss:
        assert loss_fn is not None
        return NativeStep(model, loss_fn)
    return model
