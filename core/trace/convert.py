"""The traced fx graph as `AtenNode`s: placeholders given their roles, ops with `Ref`
arguments, what each writes in place, the module and source line behind it, and the storages
of every returned tensor numbered 0..S-1 with their sizes."""

from __future__ import annotations

from typing import Any, NamedTuple

import torch

from core.errors import UnsupportedModel
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
    placeholders = 0
    for fx_node in gm.graph.nodes:
        if fx_node.op == "output":
            leaves, grad_leaves = fx_node.args[0]
            outputs = [index[n] for n in leaves]
            grads = [index[g] if isinstance(g, torch.fx.Node) else None for g in grad_leaves]
            continue
        tensors = _tensors_of(fx_node.meta.get("val"))
        i = index[fx_node] = len(nodes)
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
    return Converted(nodes, storages.bytes, outputs, grads, constants)


def _fill_op(node: AtenNode, fx_node: torch.fx.Node, index: dict[torch.fx.Node, int]) -> None:
    """An op node's target, arguments, reads and writes, and where in the model it came from."""
    node.target = fx_node.target
    node.args = torch.fx.node.map_arg(fx_node.args, lambda n: Ref(index[n]))
    node.kwargs = dict(torch.fx.node.map_arg(fx_node.kwargs, lambda n: Ref(index[n])))
    node.reads = tuple(index[n] for n in fx_node.all_input_nodes)
    node.writes = written_args(fx_node, index)
    node.random = torch.Tag.nondeterministic_seeded in getattr(fx_node.target, "tags", ())
    node.module = (fx_node.meta.get("custom") or {}).get("module")
    node.seq_nr = int(fx_node.meta.get("seq_nr", -1))
    node.source = user_frame(fx_node.meta.get("stack_trace"))


def _tensors_of(val: Any) -> list[torch.Tensor]:
    if isinstance(val, torch.Tensor):
        return [val]
    if isinstance(val, (list, tuple)):
        return [t for t in val if isinstance(t, torch.Tensor)]
    return []
