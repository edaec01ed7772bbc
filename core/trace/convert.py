"""The traced fx graph as `AtenNode`s: placeholders given their roles, ops with `Ref`
arguments, what each writes in place, the module and source line behind it, and the storages
of every returned tensor numbered 0..S-1 with their sizes.

A storage's size is what the op's real kernel allocates, asked of the kernel itself
(`real_storage_bytes`): fake tensors give every new result a storage just large enough for its
shape, but a real kernel may return a view of a larger buffer it allocated (on CPU, `mse_loss`
reduces in place into an input-sized buffer and returns it as a 0-dim tensor), and the run
holds that whole buffer.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any, NamedTuple

import torch
from torch.utils._python_dispatch import _disable_current_modes
from torch.utils._pytree import tree_map

from core.errors import UnsupportedModel
from core.trace.attention import REPLAYS_SAVED_SEED
from core.trace.nodes import AtenNode, Ref, TensorSpec
from core.trace.op_schema import user_frame, written_args


class Converted(NamedTuple):
    """What `convert` reads off an fx graph."""

    nodes: list[AtenNode]
    storage_bytes: dict[int, int]  # storage number -> its size in bytes
    outputs: list[int]  # node of each flattened output
    grads: list[int | None]  # node of each gradient (None: unused)
    constants: dict[int, torch.Tensor]  # lifted constants (get_attr nodes): node -> value


class _Storages:
    """Numbers storages 0..S-1 in the order first seen, with their sizes in bytes."""

    def __init__(self) -> None:
        self.ids: dict[int, int] = {}
        self.bytes: dict[int, int] = {}

    def of(self, tensors: list[torch.Tensor]) -> tuple[int, ...]:
        numbers = []
        for t in tensors:
            s = t.untyped_storage()
            sid = self.ids.setdefault(s._cdata, len(self.ids))
            self.bytes[sid] = int(s.nbytes())
            numbers.append(sid)
        return tuple(numbers)


def convert(gm: torch.fx.GraphModule, roles: list[str]) -> Converted:
    """fx graph -> AtenNodes; `roles` names the placeholders in order."""
    storages = _Storages()
    index: dict[torch.fx.Node, int] = {}
    constants: dict[int, torch.Tensor] = {}
    nodes: list[AtenNode] = []
    outputs: list[int] = []
    grads: list[int | None] = []
    vals: dict[int, Any] = {}  # node -> its fake result, for `real_storage_bytes`
    placeholders = 0
    for fx_node in gm.graph.nodes:
        if fx_node.op == "output":
            leaves, grad_leaves = fx_node.args[0]
            outputs = [index[n] for n in leaves]
            grads = [index[g] if isinstance(g, torch.fx.Node) else None for g in grad_leaves]
            continue
        tensors = _tensors_of(fx_node.meta.get("val"))
        i = index[fx_node] = len(nodes)
        vals[i] = fx_node.meta.get("val")
        node = AtenNode(
            index=i,
            name=fx_node.name,
            role="op",
            specs=tuple(TensorSpec.of(t) for t in tensors),
            storages=storages.of(tensors),
            strides=tuple(tuple(int(x) for x in t.stride()) for t in tensors),
        )
        if fx_node.op == "placeholder":
            node.role = roles[placeholders]
            placeholders += 1
        elif fx_node.op == "get_attr":
            node.role = "constant"
            value = getattr(gm, fx_node.target).detach()
            constants[i] = value.to(tensors[0].device) if tensors else value
        elif fx_node.op == "call_function":
            _fill_op(node, fx_node, index)
        else:
            raise UnsupportedModel(f"an fx node of kind {fx_node.op}", "", "")
        nodes.append(node)
    sizes = real_storage_bytes(nodes, storages.bytes, vals)
    return Converted(nodes, sizes, outputs, grads, constants)


def _fill_op(node: AtenNode, fx_node: torch.fx.Node, index: dict[torch.fx.Node, int]) -> None:
    """An op node's target, arguments, reads and writes, and where in the model it came from."""
    node.target = fx_node.target
    node.args = torch.fx.node.map_arg(fx_node.args, lambda n: Ref(index[n]))
    node.kwargs = dict(torch.fx.node.map_arg(fx_node.kwargs, lambda n: Ref(index[n])))
    node.reads = tuple(index[n] for n in fx_node.all_input_nodes)
    node.writes = written_args(fx_node, index)
    seeded = torch.Tag.nondeterministic_seeded in getattr(fx_node.target, "tags", ())
    node.random = seeded and fx_node.target not in REPLAYS_SAVED_SEED
    node.module = (fx_node.meta.get("custom") or {}).get("module")
    node.seq_nr = int(fx_node.meta.get("seq_nr", -1))
    node.source = user_frame(fx_node.meta.get("stack_trace"))


def _tensors_of(val: Any) -> list[torch.Tensor]:
    if isinstance(val, torch.Tensor):
        return [val]
    if isinstance(val, (list, tuple)):
        return [t for t in val if isinstance(t, torch.Tensor)]
    return []


# --- the storages real kernels allocate ----------------------------------------------------


def real_storage_bytes(
    nodes: list[AtenNode], traced: dict[int, int], vals: dict[int, Any]
) -> dict[int, int]:
    """Each storage's size as the real kernel allocates it on the traced device: `traced`
    (the fake tensors' sizes) with every storage an op allocates replaced by the size of the
    storage its kernel really returns. `vals` holds each node's fake result.

    The fake result's storage only covers its shape; the real one can hold more (a view of a
    buffer the kernel allocated), and depends on the kernel and the device, not on a list of
    ops: so each op that allocates is run once, on zero-filled stand-ins of its inputs with
    their traced shapes, strides, dtypes and devices, and its result's storage asked its
    size. Ops with the same signature (identical layers, the same op in forward and backward)
    share one run. Sizes depend on shapes, not values, in a static-shape trace. Skipped:
    results on the meta device (nothing real to ask), ops outside the `aten` namespace
    (collectives, custom ops with effects beyond their results) and a run that raises on
    its stand-ins; those keep the traced size. The caller's random streams, autocast and
    dispatch modes do not reach the runs, nor do the runs reach them.
    """
    sizes = dict(traced)
    host = {node.storages[p] for node in nodes for p in _host_results(node)}
    for storage in host:  # results that live on the host: no device bytes, probed or not
        sizes[storage] = 0
    runs: dict[tuple, list[tuple[int, int]] | None] = {}
    with _probing(vals):
        for node in nodes:
            fresh = _fresh_outputs(node, nodes)
            if not fresh or not _probeable(node, vals):
                continue
            key = _signature(node, vals)
            if key not in runs:
                runs[key] = _probe(node, vals)
            real = runs[key]
            if real is None:
                continue
            for storage, positions in fresh.items():
                if storage in host:
                    continue
                distinct = {real[i][0]: real[i][1] for i in positions}
                if -1 not in distinct:  # a result aliasing an input: keep the traced size
                    sizes[storage] = sum(distinct.values())
    return sizes


# CUDA's memory-efficient attention returns its dropout seed and offset as CPU tensors
# outside CUDA graph capture, dropout or not (`_efficient_attention_forward` in
# ATen/native/transformers/cuda/attention.cu: `device = in_capture_stream ? kCUDA : kCPU`);
# torch's meta kernel leaves them on the meta device. Measured on an H200 (torch 2.11, GPT-2
# and Llama at their default attention, fp32): counted as device bytes they put every
# prediction 512 B per seed and offset above the measured peak (docs/validate.md).
_HOST_RESULT_NAMES = frozenset({"philox_seed", "philox_offset"})
_HOST_RESULT_OPS = ("_scaled_dot_product_efficient_attention", "_efficient_attention_forward")


def _host_results(node: AtenNode) -> list[int]:
    """The result positions of `node` that its CUDA kernel places on the host."""
    target = node.target
    if node.role != "op" or not isinstance(target, torch._ops.OpOverload):
        return []
    if (
        target.namespace != "aten"
        or target._schema.name.removeprefix("aten::") not in _HOST_RESULT_OPS
    ):
        return []
    tensors = [r for r in target._schema.returns if "Tensor" in str(r.type)]
    return [i for i, r in enumerate(tensors) if r.name in _HOST_RESULT_NAMES]


def _fresh_outputs(node: AtenNode, nodes: list[AtenNode]) -> dict[int, list[int]]:
    """The storages `node` allocates (none of its inputs has them) -> its result positions on
    each."""
    if node.role != "op" or not isinstance(node.target, torch._ops.OpOverload):
        return {}
    read = {s for r in node.reads for s in nodes[r].storages}
    fresh: dict[int, list[int]] = {}
    for position, storage in enumerate(node.storages):
        if storage not in read:
            fresh.setdefault(storage, []).append(position)
    return fresh


def _probeable(node: AtenNode, vals: dict[int, Any]) -> bool:
    if node.target.namespace != "aten":
        return False
    if any(a.name in _HOST_READ for a in node.target._schema.arguments):
        return False
    tensors = [t for n in (node.index, *node.reads) for t in _tensors_of(vals[n])]
    return all(t.device.type != "meta" for t in tensors)


# arguments a kernel reads on the host: the attention backward kernels read the dropout
# seed and offset their forward left on the CPU, where a trace places them on the device, so a
# stand-in there would be read through a device pointer (a crash); their results are the
# gradients of their inputs, sized as the trace sizes them
_HOST_READ = frozenset({"philox_seed", "philox_offset"})


def _signature(node: AtenNode, vals: dict[int, Any]) -> tuple:
    """What the sizes an op allocates depend on: its target, its constant arguments, and the
    shape, stride, dtype and device of every tensor it reads."""

    def key(a: Any) -> Any:
        if isinstance(a, Ref):
            return tuple(
                (tuple(t.shape), t.stride(), t.dtype, t.device) for t in _tensors_of(vals[a.index])
            )
        return repr(a)

    return (node.target, repr(tree_map(key, (node.args, node.kwargs))))


def _probe(node: AtenNode, vals: dict[int, Any]) -> list[tuple[int, int]] | None:
    """Run `node` on stand-ins: per result tensor, (an id of its real storage, its bytes);
    id -1 where it is an input's storage. None when the run raises."""
    env = {r: tree_map(_stand_in, vals[r]) for r in node.reads}
    inputs = {t.untyped_storage()._cdata for v in env.values() for t in _tensors_of(v)}
    args, kwargs = tree_map(
        lambda a: env[a.index] if isinstance(a, Ref) else a, (node.args, node.kwargs)
    )
    try:
        out = node.target(*args, **kwargs)
    except Exception:  # a kernel that checks its values (stand-ins are zeros): keep the traced size
        return None
    real = []
    for t in _tensors_of(out):
        s = t.untyped_storage()
        real.append((-1 if s._cdata in inputs else s._cdata, int(s.nbytes())))
    return real


def _stand_in(val: Any) -> Any:
    """A real zero-filled tensor shaped, strided, typed and placed as a fake one."""
    if not isinstance(val, torch.Tensor):
        return val
    extent = 1 + sum((n - 1) * st for n, st in zip(val.shape, val.stride())) if val.numel() else 0
    base = torch.zeros(extent, dtype=val.dtype, device=val.device)
    return base.as_strided(val.shape, val.stride())


@contextlib.contextmanager
def _probing(vals: dict[int, Any]) -> Iterator[None]:
    """No gradients, autocast or dispatch modes; the random streams of every traced device
    restored afterwards (dropout's kernels draw from them). One CPU thread, as op costs are
    measured: a kernel sizes its result before splitting the work, and most probed ops are
    so small that more threads only wait on each other (gpt-tiny on 2 busy cores: 40 ms
    on one thread, 950 ms on two)."""
    cuda = sorted(
        {t.device for v in vals.values() for t in _tensors_of(v) if t.device.type == "cuda"},
        key=str,
    )
    threads = torch.get_num_threads()
    with contextlib.ExitStack() as stack:
        stack.callback(torch.set_num_threads, threads)
        torch.set_num_threads(1)
        stack.enter_context(torch.random.fork_rng(devices=cuda))
        stack.enter_context(torch.no_grad())
        stack.enter_context(_disable_current_modes())
        for device_type in {"cpu", *(d.type for d in cuda)}:
            stack.enter_context(torch.autocast(device_type, enabled=False))
        yield
