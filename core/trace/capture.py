"""Capture the joint forward+backward graph of one training step at ATen level.

The step is `outputs = model(*inputs)` followed by `autograd.grad(outputs, params, tangents)`,
traced with `make_fx` under fake tensors: no real compute, no real memory, so a model larger
than this machine can still be analysed. The graph mirrors eager PyTorch op for op (in-place
`bernoulli_` dropout masks, in-place batch-norm running statistics), which is what makes the
simulated peak equal the eager peak.
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading
from collections.abc import Callable, Iterator, Sequence
from typing import Any, Protocol

import torch
import torch.utils._pytree as pytree
from torch import nn
from torch._functorch._aot_autograd.logging_utils import setup_stacktrace_preservation_hooks
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode, unset_fake_temporarily
from torch.func import functional_call
from torch.fx.experimental.proxy_tensor import make_fx
from torch.utils import checkpoint

from core.errors import UnsupportedModel
from core.trace import cuda_autocast, fake_kernels
from core.trace.autocast import OFF, Autocast, autocast_off
from core.trace.call import CallSpec, join_call, split_call
from core.trace.convert import convert
from core.trace.device import DeviceDispatch
from core.trace.eager_branches import eager_branches
from core.trace.functionalize import functionalize_late_writes
from core.trace.loss_head import LossHeadMode
from core.trace.module_state import ModuleState
from core.trace.nodes import TensorSpec, Trace
from core.trace.scope import ModuleScope, guard

fake_kernels.register()

Named = list[tuple[str, torch.Tensor]]
Forward = Callable[[Sequence[torch.Tensor], Sequence[torch.Tensor], Sequence[torch.Tensor]], Any]


def capture(
    model: nn.Module,
    args: Sequence[Any],
    kwargs: dict[str, Any] | None = None,
    loss_fn: Callable[..., torch.Tensor] | None = None,
    targets: Sequence[torch.Tensor] = (),
    autocast: Autocast = OFF,
    head: LossHeadMode | None = None,
    optimizer: OptimizerHooks | None = None,
    device: DeviceDispatch | None = None,
) -> Trace:
    """Trace one forward+backward of `model(*args, **kwargs)` (then `loss_fn(output,
    *targets)` when given) on inputs shaped like these, the forward under `autocast`.
    Non-tensor arguments are bound as they are. The model's own non-reentrant checkpoints
    run as plain forward ops: the plan decides what to keep and recompute, and replaces them.
    The forward runs under `head` (default: a plain `LossHeadMode`), which decides how an
    LM-head loss is computed and lists the heads it met in `head.found`. With `optimizer`
    (core.optimizer_step), each parameter it updates is updated inside the backward, right
    where its gradient is complete, and its gradient is not returned. With `device`
    (core.trace.device), the forward's attention and dropout run as on its device model
    (a GPU's kernels, traced on CPU or meta tensors) and it lists the attention kernels."""
    head = head if head is not None else LossHeadMode()
    emulate = device is not None and device.model.type == "cuda" and not _on_cuda(model)
    if emulate and any(d == "cuda" for d, _ in autocast.enabled) and _on_meta(model):
        raise UnsupportedModel(
            "CUDA autocast on a model on the meta device",
            "",
            "CUDA's autocast lists are applied to CPU tensors only (on meta, torch's Python "
            "decompositions cut the loss's backward): analyse the model on the CPU, or in the "
            "dtype it trains in (model.to(torch.bfloat16)) without autocast",
        )
    with (
        _TRACING,
        _tensors_restored(model),
        _checkpoints_inlined(),
        autocast.entered(emulate_cuda=emulate),
    ):
        trace = _capture(model, args, kwargs, loss_fn, targets, head, optimizer, device)
    return dataclasses.replace(trace, autocast=autocast, module_state=ModuleState.of(model))


def _on_cuda(model: nn.Module) -> bool:
    return any(p.device.type == "cuda" for p in model.parameters())


def _on_meta(model: nn.Module) -> bool:
    return any(p.device.type == "meta" for p in model.parameters())


@contextlib.contextmanager
def _checkpoints_inlined() -> Iterator[None]:
    """Run `torch.utils.checkpoint.checkpoint(fn, ..., use_reentrant=False)` as `fn(...)` in
    this thread: its forward logic (saved-tensor hooks that drop and recompute activations,
    with fresh random draws under fake tensors) lives in a private generator, replaced once by
    one that does nothing while this thread traces a step and runs torch's own otherwise.
    Per thread, since the app traces in background threads while other threads run real
    checkpoints; transformers' `gradient_checkpointing_enable()` binds `checkpoint` itself,
    so patching that name would miss it."""
    with _INLINE_LOCK:
        if checkpoint._checkpoint_without_reentrant_generator is not _inlinable:
            global _torch_generator
            _torch_generator = checkpoint._checkpoint_without_reentrant_generator
            checkpoint._checkpoint_without_reentrant_generator = _inlinable
    was = getattr(_INLINING, "on", False)
    _INLINING.on = True
    try:
        yield
    finally:
        _INLINING.on = was


_INLINE_LOCK = threading.Lock()
# one trace at a time in a process: make_fx keeps its patcher in a module global
# (torch.fx._symbolic_trace's CURRENT_PATCHER), so two threads tracing at once (the app's
# background jobs) break each other
_TRACING = threading.RLock()
_INLINING = threading.local()  # .on: this thread is tracing a step
_torch_generator: Callable[..., Iterator[None]] = checkpoint._checkpoint_without_reentrant_generator


def _inlinable(*args: Any, **kwargs: Any) -> Iterator[None]:
    """torch's non-reentrant checkpoint generator, or nothing while this thread traces."""
    if getattr(_INLINING, "on", False):
        yield
    else:
        yield from _torch_generator(*args, **kwargs)


@contextlib.contextmanager
def _tensors_restored(model: nn.Module) -> Iterator[None]:
    """Put every parameter and buffer back afterwards: `functional_call` leaves its fake
    substitutes in a submodule registered under two names (a Siamese network's shared tower:
    `self.tower_b = self.tower_a`), and the model would then run on fake tensors."""
    saved = [
        (m, n, t)
        for m in model.modules()
        for n, t in [*m.named_parameters(recurse=False), *m.named_buffers(recurse=False)]
    ]
    try:
        yield
    finally:
        for m, n, t in saved:
            setattr(m, n, t)


def _capture(
    model: nn.Module,
    args: Sequence[Any],
    kwargs: dict[str, Any] | None,
    loss_fn: Callable[..., torch.Tensor] | None,
    targets: Sequence[torch.Tensor],
    head: LossHeadMode,
    optimizer: OptimizerHooks | None = None,
    device: DeviceDispatch | None = None,
) -> Trace:
    """Fake the parameters, state and inputs; run the forward once to learn its outputs;
    trace forward and backward together; convert the graph."""
    inputs, call = split_call(args, kwargs, targets, loss_fn is not None)
    _check_targets(inputs[len(inputs) - call.n_targets :])
    named = list(model.named_parameters())
    params = [(n, p) for n, p in named if p.requires_grad]
    state = [(n, p) for n, p in named if not p.requires_grad] + list(model.named_buffers())
    grad_inputs = [i for i, x in enumerate(inputs) if x.requires_grad]

    fake_mode = FakeTensorMode(allow_non_fake_inputs=True)
    with fake_mode:
        fparams = [_fake(fake_mode, p) for _, p in params]
        fstate = [_fake(fake_mode, b) for _, b in state]
        finputs = _distinct([_fake(fake_mode, x) for x in inputs])
    values = [b for _, b in state] + list(inputs)  # what eager's branches read
    forward = _forward_fn(model, params + state, call, loss_fn, head, values, device)

    with ModuleScope(model) as scope, fake_mode:
        out = guard(scope, lambda: forward(fparams, fstate, finputs))
        leaves, out_spec = _flatten_output(out)
        diff = [i for i, t in enumerate(leaves) if t.requires_grad]
        ftangents = [torch.empty_like(leaves[i]) for i in diff]

    step = _joint_step(forward, (len(params), len(state), len(inputs)), diff, grad_inputs)
    if optimizer is not None:
        step = _with_updates(step, len(params), optimizer)
    with ModuleScope(model) as scope, fake_mode, _kept(optimizer):
        flat = [*fparams, *fstate, *finputs, *ftangents]
        gm = guard(scope, lambda: make_fx(step, record_stack_traces=True)(*flat))
        _one_node_per_constant(gm.graph)
        functionalize_late_writes(gm.graph)

    roles = ["param"] * len(params) + ["state"] * len(state) + ["input"] * len(inputs)
    graph = convert(gm, roles + ["tangent"] * len(diff))
    return Trace(
        nodes=graph.nodes,
        storage_bytes=graph.storage_bytes,
        param_names=[n for n, _ in params],
        param_specs=[TensorSpec.of(p) for _, p in params],
        state_names=[n for n, _ in state],
        input_specs=[TensorSpec.of(x) for x in inputs],
        grad_inputs=grad_inputs,
        outputs=graph.outputs,
        output_spec=out_spec,
        diff_outputs=diff,
        tangents=[i for i, n in enumerate(graph.nodes) if n.role == "tangent"],
        grads=graph.grads,
        constants=graph.constants,
        call=call,
    )


def _check_targets(targets: Sequence[Any]) -> None:
    for i, x in enumerate(targets):
        if not isinstance(x, torch.Tensor):
            raise UnsupportedModel(f"target {i} of type {type(x).__name__}", "", "pass tensors")


def _forward_fn(
    model: nn.Module,
    tensors: Named,
    call: CallSpec,
    loss_fn: Callable[..., Any] | None,
    head: LossHeadMode,
    values: Sequence[torch.Tensor] = (),
    device: DeviceDispatch | None = None,
) -> Forward:
    """forward(params, state, inputs): the model (then the loss) on these tensors in place of
    its own parameters and buffers, called as `call` says, under the loss-head mode `head`;
    the model's branches on the state's and inputs' `values` go as in eager; attention and
    dropout run as on the device model `device` says."""
    names = [n for n, _ in tensors]

    def forward(ps: Sequence, ss: Sequence, xs: Sequence) -> Any:
        substitutes = dict(zip(names, [*ps, *ss], strict=True))
        args, kwargs, targets = join_call(xs, call)
        on = device if device is not None else contextlib.nullcontext()
        with head, eager_branches(list(zip([*ss, *xs], values))), on:
            out = functional_call(model, substitutes, args, kwargs)
            return out if loss_fn is None else _loss(loss_fn, out, targets)

    return forward


def _joint_step(
    forward: Forward, counts: tuple[int, int, int], diff: list[int], grad_inputs: list[int]
) -> Callable[..., tuple[list, list]]:
    """step(*params, *state, *inputs, *tangents) -> (outputs, gradients): what make_fx traces.
    `counts` is (params, state, inputs); `diff` the outputs that receive a tangent."""
    n_p, n_s, n_i = counts

    def step(*flat: torch.Tensor) -> tuple[list, list]:
        ps, ss = flat[:n_p], flat[n_p : n_p + n_s]
        xs, ts = flat[n_p + n_s : n_p + n_s + n_i], flat[n_p + n_s + n_i :]
        with _autocast_cache():
            leaves, _ = pytree.tree_flatten(forward(ps, ss, xs))
        # tag each backward node with the sequence number of the forward op it differentiates
        setup_stacktrace_preservation_hooks(
            [leaves[i].grad_fn for i in diff if leaves[i].grad_fn is not None]
        )
        wrt = list(ps) + [xs[i] for i in grad_inputs]
        with autocast_off():  # eager's backward runs after the autocast block
            grads = torch.autograd.grad([leaves[i] for i in diff], wrt, ts, allow_unused=True)
        return list(leaves), list(grads)

    return step


def _one_node_per_constant(graph: torch.fx.Graph) -> None:
    """make_fx reads a lifted constant anew at each use (one get_attr node each, each with
    its own fake storage); keep the first, so a constant written in place (an optimizer's
    state) is one storage whose writes later reads see."""
    first: dict[str, torch.fx.Node] = {}
    for node in list(graph.nodes):
        if node.op == "get_attr" and isinstance(node.target, str):
            if node.target in first:
                node.replace_all_uses_with(first[node.target])
                graph.erase_node(node)
            else:
                first[node.target] = node
        elif node.op == "call_function" and node.args:
            _alias_written_constant(node)


def _alias_written_constant(node: torch.fx.Node) -> None:
    """make_fx wraps a constant in a new fake tensor at each op, so an in-place op's result on
    a constant (an optimizer's state) has a fake storage of its own: give it the constant's,
    so the write allocates nothing, as it does not when run."""
    schema = getattr(node.target, "_schema", None)
    if schema is None or not schema.returns or schema.returns[0].alias_info is None:
        return
    sets = schema.returns[0].alias_info.before_set
    arg = next(
        (
            node.args[i]
            for i, a in enumerate(schema.arguments)
            if a.alias_info is not None
            and a.alias_info.is_write
            and a.alias_info.before_set == sets
            and i < len(node.args)
        ),
        None,
    )
    if not (isinstance(arg, torch.fx.Node) and arg.op == "get_attr"):
        return
    val, kept = node.meta.get("val"), arg.meta.get("val")
    if not (isinstance(val, FakeTensor) and isinstance(kept, FakeTensor)):
        return
    if val.untyped_storage()._cdata != kept.untyped_storage()._cdata:
        with kept.fake_mode:
            node.meta["val"] = kept.as_strided(val.shape, val.stride(), val.storage_offset())


class OptimizerHooks(Protocol):
    """What the capture needs of an optimizer run inside the step (core.optimizer_step)."""

    def updates(self, i: int) -> bool: ...

    def hook(self, i: int, param: torch.Tensor) -> Callable[[torch.Tensor], torch.Tensor]: ...

    def state_tensors(self) -> list[torch.Tensor]: ...


@contextlib.contextmanager
def _kept(optimizer: OptimizerHooks | None) -> Iterator[None]:
    """The optimizer's states as they were before the trace: make_fx runs an op whose inputs
    are all constants of at most one element for real (constant propagation), so an update's
    in-place step count would advance during the trace; those are restored after it."""
    small = [t for t in optimizer.state_tensors() if t.numel() <= 1] if optimizer else []
    with unset_fake_temporarily():
        saved = [t.clone() for t in small]
    try:
        yield
    finally:
        with torch.no_grad(), unset_fake_temporarily():
            for t, old in zip(small, saved, strict=True):
                t.copy_(old)


def _with_updates(
    step: Callable[..., tuple[list, list]], n_params: int, optimizer: OptimizerHooks
) -> Callable[..., tuple[list, list]]:
    """`step` with each updated parameter's update hooked on its gradient (traced where
    autograd completes it) and its gradient dropped from the step's results."""

    def stepped(*flat: torch.Tensor) -> tuple[list, list]:
        for i in range(n_params):
            if optimizer.updates(i):
                flat[i].register_hook(optimizer.hook(i, flat[i]))
        outputs, grads = step(*flat)
        return outputs, [
            None if i < n_params and optimizer.updates(i) else g for i, g in enumerate(grads)
        ]

    return stepped


@contextlib.contextmanager
def _autocast_cache() -> Iterator[None]:
    """Autocast's cache on, as in eager, for the traced forward (make_fx turns it off): a
    weight used twice (a shared tower) is cast once, and its two gradients meet in the cast's
    dtype before the cast back, as eager sums them. Cleared before and after, so no cast made
    outside the trace is reused in it."""
    enabled = torch.is_autocast_cache_enabled()
    torch.clear_autocast_cache()
    cuda_autocast.clear_cache()
    torch.set_autocast_cache_enabled(True)
    try:
        yield
    finally:
        torch.clear_autocast_cache()
        cuda_autocast.clear_cache()
        torch.set_autocast_cache_enabled(enabled)


def _loss(loss_fn: Callable[..., Any], out: Any, targets: tuple) -> torch.Tensor:
    loss = loss_fn(out, *targets)
    if not isinstance(loss, torch.Tensor) or loss.dim() != 0:
        raise UnsupportedModel(
            f"a loss_fn returning {type(loss).__name__}"
            + (f" of shape {list(loss.shape)}" if isinstance(loss, torch.Tensor) else ""),
            "",
            "loss_fn(output, *targets) must return a scalar tensor (reduce it with .mean())",
        )
    return loss


def _distinct(fakes: list[torch.Tensor]) -> list[torch.Tensor]:
    """One fake tensor per input position. A tensor passed twice (`targets=(input_ids,)`, as
    causal language models are trained) is one fake object, which the trace would record as
    one placeholder: every use would read the last position, and a later call passing two
    different tensors would feed the labels to the embedding. Call under the fake mode."""
    seen: set[int] = set()
    out = []
    for f in fakes:
        if id(f) in seen:
            twin = f
            f = torch.empty_strided(f.shape, f.stride(), dtype=f.dtype, device=f.device)
            f.requires_grad_(twin.requires_grad)
        seen.add(id(f))
        out.append(f)
    return out


def _fake(mode: FakeTensorMode, t: torch.Tensor) -> torch.Tensor:
    f = mode.from_tensor(t, static_shapes=True)
    if t.requires_grad and f.is_leaf and not f.requires_grad:
        f.requires_grad_(True)
    return f


def _flatten_output(out: Any) -> tuple[list[torch.Tensor], Any]:
    """The model's output tensors, flat, and the pytree spec that rebuilds the structure."""
    _register_dataclasses(out)
    leaves, spec = pytree.tree_flatten(out)
    for leaf in leaves:
        if not isinstance(leaf, torch.Tensor):
            raise UnsupportedModel(
                f"an output of type {type(leaf).__name__}",
                "",
                "the model must return tensors (alone, or in a tuple, list, dict or dataclass): "
                "turn that output off (Hugging Face: use_cache=False) or give analyze a "
                "loss_fn, whose scalar is then the step's only output",
            )
    if not leaves:
        raise UnsupportedModel("a model with no tensor output", "", "return the loss or logits")
    return leaves, spec


def _register_dataclasses(out: Any) -> None:
    """Let pytree see inside dataclass outputs (as Hugging Face's ModelOutput does)."""
    if dataclasses.is_dataclass(out) and not isinstance(out, type):
        cls = type(out)
        if cls not in pytree.SUPPORTED_NODES:
            pytree.register_dataclass(cls)
        for f in dataclasses.fields(out):
            _register_dataclasses(getattr(out, f.name))
    elif isinstance(out, (list, tuple)):
        for x in out:
            _register_dataclasses(x)
    elif isinstance(out, dict):
        for x in out.values():
            _register_dataclasses(x)
