"""In-place ops rewritten out of place where the graph needs it: an op that writes a tensor
another op already read (a router's `w /= w.sum()`, a mask compared and then written) becomes
its out-of-place form, and every later reader reads the new result. Values stay eager's; the
graph's ops then own their storages, so each can run and be recomputed as a unit."""

from __future__ import annotations

from typing import Any

import torch

from core.errors import UnsupportedModel
from core.trace.op_schema import aliases_schema_write


def functionalize_late_writes(graph: torch.fx.Graph) -> None:
    """Rewrite, in `graph`, every in-place op on a tensor an earlier op read (see the module
    docstring). Runs under the trace's fake mode."""
    fixed = {s for n in graph.nodes if n.op in ("placeholder", "get_attr") for s in _storages_of(n)}
    read: set[int] = set()  # storages an op read without aliasing or writing them
    latest: dict[torch.fx.Node, torch.fx.Node] = {}  # written tensor -> its new version
    retired: set[int] = set()  # storages replaced by a new version
    for node in list(graph.nodes):
        if node.op != "call_function":
            continue
        for old in node.all_input_nodes:
            if old in latest:
                node.replace_input_with(old, latest[old])
        stale = [a for a in node.all_input_nodes if _storages_of(a) & retired]
        if stale:
            raise UnsupportedModel(
                f"a view of a tensor ({stale[0].name}) read after an in-place op changed it",
                _module_path(node),
                "use out-of-place ops (x = x / y instead of x /= y)",
            )
        if _storages_of(node) & retired:  # a view of the new version: its storage is the new one
            args = torch.fx.node.map_arg((node.args, node.kwargs), lambda n: n.meta.get("val"))
            node.meta["val"] = node.target(*args[0], **args[1])
        writes = aliases_schema_write(node.target)
        mine = _storages_of(node)
        written = [node.args[p] for p, _ in writes if p < len(node.args)]
        late = [
            w for w in written if isinstance(w, torch.fx.Node) and (_storages_of(w) & read) - fixed
        ]
        for a in node.all_input_nodes:
            if a not in written and not (_storages_of(a) & mine):
                read.update(_storages_of(a))
        if late:
            new = _out_of_place(graph, node, late[0], len(written))
            latest[late[0]] = latest[node] = new
            retired.update(_storages_of(late[0]))


def _out_of_place(
    graph: torch.fx.Graph, node: torch.fx.Node, target: torch.fx.Node, n_written: int
) -> torch.fx.Node:
    """Replace the in-place `node` (writing `target`) by its out-of-place overload."""
    op: Any = node.target  # an OpOverload: only those write in place
    schema = op._schema
    packet = getattr(torch.ops.aten, schema.name.split("::")[-1].rstrip("_"), None)
    overload = getattr(packet, op._overloadname, None) if packet else None
    before = target.meta.get("val")
    if overload is None or n_written != 1 or before is None:
        raise _in_place_on_read(node, schema.name)
    fake = torch.fx.node.map_arg((node.args, node.kwargs), lambda n: n.meta.get("val"))
    after = overload(*fake[0], **fake[1])
    if not isinstance(after, torch.Tensor) or (after.shape, after.dtype) != (
        before.shape,
        before.dtype,
    ):
        raise _in_place_on_read(node, schema.name)
    with graph.inserting_after(node):
        new = graph.call_function(overload, node.args, node.kwargs)
    new.meta = {**node.meta, "val": after}
    node.replace_all_uses_with(new, delete_user_cb=lambda user: user is not new)
    graph.erase_node(node)
    return new


def _in_place_on_read(node: torch.fx.Node, op_name: str) -> UnsupportedModel:
    return UnsupportedModel(
        f"the in-place op {node.name} ({op_name}) on a tensor read before it",
        _module_path(node),
        "use the out-of-place form (x = x / y instead of x /= y)",
    )


def _storages_of(node: torch.fx.Node) -> set[int]:
    val = node.meta.get("val")
    vals = val if isinstance(val, (list, tuple)) else [val]
    return {t.untyped_storage()._cdata for t in vals if isinstance(t, torch.Tensor)}


def _module_path(node: torch.fx.Node) -> str:
    return (node.meta.get("custom") or {}).get("module") or ""
