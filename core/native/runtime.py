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
docs/native.md). A plan's offloads outside the checkpointed layers run as saved-tensor hooks
(`core.native.offload`).
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_leaves
from torch.utils.checkpoint import (
    CheckpointPolicy,
    checkpoint,
    create_selective_checkpoint_contexts,
)

from core.errors import PlanMismatch
from core.native.kv_cache import kv_cache_guard
from core.native.lowering import Lowering, Region, lower
from core.native.match import traced_as
from core.native.offload import NativeOffload
from core.native.replay import Stretches
from core.native.stretch import Stretch
from core.plan import Plan, Prediction
from core.trace.eager_branches import SCALAR_READS
from core.trace.module_state import Watch

_SAVE, _RECOMPUTE = CheckpointPolicy.MUST_SAVE, CheckpointPolicy.PREFER_RECOMPUTE
_MARK = "_remat_native"  # attribute on the model: the installed lowering (to remove it)
_UNTRACED = [0]  # depth of `untraced_ops` contexts now open


@contextlib.contextmanager
def untraced_ops() -> Iterator[None]:
    """Ops run inside are none of the trace's: a tensor-parallel layout's module hooks
    (DTensor's `from_local`, `redistribute` and its collectives, `to_local`), which one rank's
    trace, made on a replica holding local shards, does not have. The policy recomputes them
    and does not count them against the trace."""
    _UNTRACED[0] += 1
    try:
        yield
    finally:
        _UNTRACED[0] -= 1


class _Policy:
    """The selective-checkpoint policy of one run of a region: the n-th op it is asked
    about must be the region's n-th traced op."""

    def __init__(self, region: Region) -> None:
        self.region = region
        self.ops, self.save = region.ops, region.save
        self.calls = 0
        self.recomputed = 0  # torch < 2.12 asks the policy again while recomputing
        self.per_op: dict[Any, int] = {}  # under torch.compile: calls per op so far

    def __call__(self, ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
        if torch.compiler.is_compiling():
            if _UNTRACED[0] or op in SCALAR_READS:
                return _RECOMPUTE
            return self._traced(op)
        if getattr(ctx, "is_recompute", False):
            # the recompute must answer as the forward did, op for op: SAC takes a saved
            # op's output from its cache in the order the forward stored them
            return _SAVE if self._next(op, recompute=True) else _RECOMPUTE
        return _SAVE if self.saves(op) else _RECOMPUTE

    def saves(self, op: Any) -> bool:
        """Whether eager's next op of the region, `op`, is saved; PlanMismatch when the
        trace has another op there. Reads into Python and ops under `untraced_ops` are
        none of the trace's: recomputed, not counted."""
        return self._next(op, recompute=False)

    def _next(self, op: Any, recompute: bool) -> bool:
        if _UNTRACED[0]:
            return False
        ops, n = self.ops, self.recomputed if recompute else self.calls
        if n < len(ops) and ops[n] is op:  # the common case first: no hashing
            self._advance(recompute)
            return self.save[n]
        if op in SCALAR_READS:  # a read into Python: no traced node
            return False
        if n >= len(ops) or ops[n] != traced_as(op):
            want = str(ops[n]) if n < len(ops) else "the end of the block"
            when = "its recompute" if recompute else "the block"
            raise PlanMismatch(
                f"{self.region.module}: op {n} of {when} runs {op}, the trace has {want}: "
                "the model runs other ops than it did when analysed (training mode, "
                "autocast, shapes or code changed); analyse the model as it runs now"
            )
        self._advance(recompute)
        return self.save[n]

    def _advance(self, recompute: bool) -> None:
        if recompute:
            self.recomputed += 1
        else:
            self.calls += 1

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
        same = [i for i, o in enumerate(self.region.ops) if o == traced_as(op)]
        return _SAVE if k < len(same) and self.region.save[same[k]] else _RECOMPUTE

    def check_done(self) -> None:
        """Every traced op of the region ran (called after the region's forward)."""
        if self.calls != len(self.region.ops):
            raise PlanMismatch(
                f"{self.region.module}: the block ran {self.calls} ops, the trace has "
                f"{len(self.region.ops)}: analyse the model as it runs now"
            )


_STATS = ("running_mean", "running_var", "num_batches_tracked")


def _stat(norm: nn.Module, name: str) -> torch.Tensor:
    """A running-statistics buffer of a norm that tracks them (never None there)."""
    own = norm._buffers[name]
    assert own is not None, name
    return own


class _RunningStats:
    """Batch-norm's running statistics updated once per step, as eager does, though a
    recompute runs the norms' forward again: during the recompute each norm's statistics
    buffers are set aside for scratch buffers of their shape, made when the plan is applied
    (outside every step), which take the second update. The recompute runs the forward's
    ops one for one, as checkpoint requires, and allocates nothing."""

    def __init__(self, module: nn.Module) -> None:
        self.norms = [
            m
            for m in module.modules()
            if isinstance(m, nn.modules.batchnorm._NormBase) and m.track_running_stats
        ]
        self.scratch = [{n: torch.zeros_like(_stat(m, n)) for n in _STATS} for m in self.norms]

    @contextlib.contextmanager
    def aside(self) -> Iterator[None]:
        """The training norms' statistics replaced by scratch while the block runs."""
        swapped = []
        for m, scratch in zip(self.norms, self.scratch):
            if not m.training:
                continue
            for name in _STATS:
                own = _stat(m, name)
                if scratch[name].shape != own.shape or scratch[name].device != own.device:
                    scratch[name] = torch.zeros_like(own)  # the model moved since
                m._buffers[name] = scratch[name]
                swapped.append((m, name, own))
        try:
            yield
        finally:
            for m, name, own in swapped:
                m._buffers[name] = own


def _wrapped(region: Region, module: nn.Module) -> Callable[..., Any]:
    """`module.forward` run under non-reentrant checkpoint with the region's selective
    policy. The context function is a plain function (torch.compile takes it as it is; a
    partial would have to be a constant) making a fresh policy for each run. A recompute
    leaves batch-norm's running statistics alone (eager updates them once).

    A region that saves nothing runs as plain checkpoint (no policy: selective
    checkpoint's dispatch mode costs Python per op, most of a millisecond step) once a
    policy run matched its ops to the trace for the same call: the same autocast state and
    tensor arguments (`_call_signature`; the module's own state is `Watch`'s). Another
    call is matched op by op again."""
    forward = module.forward
    made: list[_Policy] = []
    refuse_kv_cache = kv_cache_guard(region.module, forward)
    stats = _RunningStats(module)
    mods = dict(module.named_modules(prefix=region.module, remove_duplicate=False))
    watch = Watch(
        region.state, tuple(mods[p].__dict__ if p in mods else {} for p, _, _ in region.state.rows)
    )

    def contexts() -> tuple[Any, Any]:
        made[:] = [_Policy(region)]
        return create_selective_checkpoint_contexts(made[0], allow_cache_entry_mutation=True)

    saves_nothing = not any(region.save)
    verified: list[tuple[Any, ...]] = []  # the call a policy run matched to the trace

    @functools.wraps(forward)
    def run(*args: Any, **kwargs: Any) -> Any:
        if not torch.is_grad_enabled():
            return forward(*args, **kwargs)
        refuse_kv_cache(args, kwargs)
        if torch.compiler.is_compiling():  # the compiled recompute mutates no buffer
            return checkpoint(forward, *args, use_reentrant=False, context_fn=contexts, **kwargs)
        runs = [0]

        def counted(*a: Any, **k: Any) -> Any:
            runs[0] += 1
            if runs[0] == 1 or not stats.norms:
                return forward(*a, **k)
            with stats.aside():  # the recompute
                return forward(*a, **k)

        call = _call_signature(args, kwargs) if saves_nothing else ()
        if saves_nothing and verified and verified[0] == call:
            out = checkpoint(counted, *args, use_reentrant=False, **kwargs)
        else:
            out = checkpoint(counted, *args, use_reentrant=False, context_fn=contexts, **kwargs)
            made[0].check_done()
            verified[:] = [call]
        watch.check()  # ops alike, other Python state: another dropout p, a switched flag
        return out

    return run


def _call_signature(args: Any, kwargs: Any) -> tuple[Any, ...]:
    """What decides a region's ops beside its module's state (which `Watch` checks): the
    autocast state and each tensor argument's shape, dtype and device."""
    tensors = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
    return (
        *((torch.is_autocast_enabled(d), torch.get_autocast_dtype(d)) for d in ("cpu", "cuda")),
        *((t.shape, t.dtype, t.device) for t in tensors),
    )


class NativeHandle:
    """The checkpoint wrappers installed on a model's submodules; `remove()` undoes them."""

    def __init__(self, model: nn.Module, plan: Plan, lowering: Lowering) -> None:
        self.plan = plan
        self.lowering = lowering
        self._restore: list[tuple[nn.Module, Any]] = []
        for region in lowering.regions:
            sub = model.get_submodule(region.module)
            self._restore.append((sub, sub.__dict__.get("forward")))
            sub.forward = _wrapped(region, sub)
        self.offload = NativeOffload(plan, lowering) if lowering.offloads else None
        if self.offload is not None:  # the hooks around the whole forward
            self._restore.append((model, model.__dict__.get("forward")))
            model.forward = self.offload.wrap(model.forward)
        self.stretches = _install_stretches(model, lowering, self._restore)
        self._model = model
        setattr(model, _MARK, self)

    @property
    def notes(self) -> tuple[str, ...]:
        return self.lowering.notes

    @property
    def prediction(self) -> Prediction:
        """The native step's simulated peak and time (`core.native.simulate`)."""
        return self.lowering.prediction

    def remove(self) -> None:
        """The model as it was before the plan was applied."""
        for sub, own in reversed(self._restore):
            if own is None:
                del sub.forward
            else:
                sub.forward = own
        self._restore.clear()
        if self.stretches is not None:
            self.stretches.remove()
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
        handle = native_handle(self.model)
        offload = handle.offload if handle is not None else None
        stretches = handle.stretches if handle is not None else None
        with contextlib.ExitStack() as stack:
            if stretches is not None:  # the loss ends the step's forward
                stack.enter_context(stretches.step())
            if offload is not None:
                stack.enter_context(offload.active())
            return self.loss_fn(self.model(*args, **kwargs), *given)


def _install_stretches(
    model: nn.Module, lowering: Lowering, restore: list[tuple[nn.Module, Any]]
) -> Stretches | None:
    """The plan's stretch regions (`core.native.replay`): hooks on the submodules where
    they begin and end, and the model's forward as the step's start and end."""
    if not lowering.stretches:
        return None
    regions = {id(s): _as_region(s) for s in lowering.stretches}
    stretches = Stretches(model, lowering.stretches, lambda s: _Policy(regions[id(s)]))
    restore.append((model, model.__dict__.get("forward")))
    forward = model.forward

    @functools.wraps(forward)
    def run(*args: Any, **kwargs: Any) -> Any:
        with stretches.step():
            return forward(*args, **kwargs)

    model.forward = run
    return stretches


def _as_region(s: Stretch) -> Region:
    """A stretch as the region its policy checks the ops against."""
    return Region(-1, s.label, s.ops, s.save, 0, s.policy_nodes, frozenset(s.nodes), s.cached)


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
            "(core.native_handle(model).remove())"
        )
    NativeHandle(model, plan, lower(plan))
    if with_loss:
        assert loss_fn is not None
        return NativeStep(model, loss_fn)
    return model
