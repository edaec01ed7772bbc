"""The traced step as a graph of compute ops over storages: what solvers, simulator and runtime share.

Memory is owned by storages, not tensors: a view, a `detach`, an in-place op or a `getitem`
returns a storage that already exists. So each op here is one allocating ATen op together with
every ATen node that only aliases or mutates what it produced (views, in-place updates,
getitems), and each value is one storage. Nodes that only alias parameters or buffers (such as
`t(weight)`) allocate nothing and run once at the start of a step (the prologue).
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass
from functools import cached_property
from typing import Literal, cast

from core.errors import UnsupportedModel
from core.trace import Trace

PLACEHOLDER_KINDS = ("param", "state", "input", "tangent", "constant")
Phase = Literal["forward", "backward"]
ValueKind = Literal[
    "param", "state", "input", "tangent", "constant", "activation", "temporary", "gradient"
]


@dataclass
class Value:
    """One storage. Placeholders (params, state, inputs, tangents) exist before the step."""

    index: int
    name: str
    nbytes: int
    kind: ValueKind
    producer: int | None = None  # op that allocates it
    consumers: tuple[int, ...] = ()  # ops that read it

    @property
    def is_placeholder(self) -> bool:
        return self.kind in PLACEHOLDER_KINDS


@dataclass
class Op:
    """One compute op: an allocating ATen node and the nodes that alias or mutate its result."""

    index: int
    name: str
    label: str  # e.g. "aten.mm"
    nodes: tuple[int, ...]  # ATen nodes run, in order
    inputs: tuple[int, ...]  # values read (never its own outputs)
    outputs: tuple[int, ...]  # values allocated
    phase: Phase
    random: bool = False  # replays its random numbers when recomputed
    state_update: bool = False  # updates model state (batch-norm statistics): once per step
    # an optimizer's write of a parameter or its state, in the backward once its gradient is
    # complete (core.optimizer_step); `writes` are the placeholder storages it writes
    update: bool = False
    writes: tuple[int, ...] = ()
    time: float = 0.0  # seconds, from the cost model


@dataclass(frozen=True)
class Transient:
    """A forward op whose results nothing reads (a cast autocast makes and the code never
    uses): no op of the graph, since no plan needs it, but eager runs it and holds its
    results until the code lets them go, so native execution (eager's code) allocates them
    for a while."""

    node: int  # its first ATen node: where in the forward it runs
    outputs: tuple[int, ...]  # the values it allocates
    label: str


@dataclass(eq=False)  # compared (and hashed) by identity: facts are memoised per graph
class Graph:
    trace: Trace
    ops: list[Op]
    values: list[Value]
    prologue: tuple[int, ...]  # ATen nodes aliasing params, state or inputs only
    tangent_prologue: tuple[int, ...]  # ATen nodes aliasing the incoming gradients only
    final_values: frozenset[int]  # live at the end of the step: model outputs, gradients
    # the forward's dead allocating ops, in trace order (`Transient`)
    transients: tuple[Transient, ...] = ()

    @cached_property
    def forward_ops(self) -> list[int]:
        return [op.index for op in self.ops if op.phase == "forward"]

    @cached_property
    def backward_ops(self) -> list[int]:
        return [op.index for op in self.ops if op.phase == "backward"]

    @cached_property
    def read_versions(self) -> dict[tuple[int, int], int]:
        """(op, placeholder storage an optimizer's update writes) -> how many update writes
        of it precede the op's read in trace order: the version the op must read. An update
        writes parameters and states in place (as torch's single-tensor step), so each read
        keeps its place among the writes: before them (the forward, the gradients) or after
        the write it follows (the update's own later ops)."""
        writers: dict[int, list[int]] = {}
        for op in self.ops:
            for s in op.writes if op.update else ():
                writers.setdefault(s, []).append(op.nodes[0])
        out: dict[tuple[int, int], int] = {}
        for op in self.ops:
            for s in op.inputs:
                if s in writers:
                    out[op.index, s] = sum(w < op.nodes[0] for w in writers[s])
        return out

    @cached_property
    def value_nodes(self) -> dict[int, tuple[int, ...]]:
        """ATen nodes whose results alias each value: dropped together when it is freed."""
        out: dict[int, list[int]] = {}
        for op in self.ops:
            for n in op.nodes:
                node = self.trace.nodes[n]
                if len(node.storages) == 1:
                    out.setdefault(node.storages[0], []).append(n)
        return {v: tuple(ns) for v, ns in out.items()}


def build_graph(trace: Trace) -> Graph:
    """Fold ATen nodes into ops over storages, classify phases, drop dead nodes."""
    nodes = trace.nodes
    values = [
        Value(index=s, name="", nbytes=b, kind="temporary")
        for s, b in sorted(trace.storage_bytes.items())
    ]
    group_of: dict[int, int] = {}  # aten node -> group
    owner: dict[int, int] = {}  # storage -> group that allocates it
    groups: list[list[int]] = []
    prologue: list[int] = []
    placeholder_storage: set[int] = set()

    backward_begins = first_backward_node(trace)
    updating: dict[int, int] = {}  # placeholder storage written in the backward -> its group

    for node in nodes:
        if node.role != "op":
            for s in node.storages:
                placeholder_storage.add(s)
                values[s].kind, values[s].name = cast(ValueKind, node.role), node.name
            continue
        new = [s for s in node.storages if s not in owner and s not in placeholder_storage]
        joins = {owner[s] for s in node.storages if s in owner}
        if node.label == "getitem":
            joins = {group_of[node.reads[0]]}
        if len(joins) > 1:
            raise UnsupportedModel(f"the op {node.label} aliasing several tensors", "")
        written = [w for w in _written_storages(trace, node) if w in placeholder_storage]
        if node.index > backward_begins and (written or _reads_any(trace, node, updating)):
            # an optimizer's in-place update: with every other write of, and later read of,
            # the same parameter or state, one op (so every order a solver picks is right)
            joins |= {updating[s] for s in _read_storages(trace, node) if s in updating}
            joins |= {updating[s] for s in written if s in updating}
            g = _merge(sorted(joins), groups, group_of, owner, updating) if joins else len(groups)
            if g == len(groups):
                groups.append([])
            updating.update({s: g for s in written})
        elif joins:
            g = joins.pop()
        elif new or any(w in placeholder_storage for w in _written_storages(trace, node)):
            g = len(groups)
            groups.append([])
        else:
            prologue.append(node.index)
            continue
        groups[g].append(node.index)
        group_of[node.index] = g
        for s in new:
            owner[s] = g
            values[s].name = node.name

    if any(not m for m in groups):  # folded into others by _merge
        keep = {g: i for i, g in enumerate(g for g, m in enumerate(groups) if m)}
        groups = [m for m in groups if m]
        group_of = {n: keep[g] for n, g in group_of.items()}
        owner = {s: keep[g] for s, g in owner.items()}
    _check_no_write_after_foreign_read(trace, groups, group_of)
    ops = _make_ops(trace, groups, owner, placeholder_storage)
    model_outputs = {nodes[n].storages[0] for n in trace.outputs}
    final = model_outputs | {nodes[g].storages[0] for g in trace.grads if g is not None}
    ops, dead = _drop_dead_and_classify(ops, final, model_outputs, backward_begins)
    transients = tuple(
        Transient(op.nodes[0], op.outputs, op.label)
        for op in dead
        if op.outputs and op.nodes[0] < backward_begins
    )
    for op in ops:
        for v in op.outputs:
            values[v].producer = op.index
            if op.phase == "forward":
                values[v].kind = "activation"
        for v in op.inputs:
            values[v].consumers += (op.index,)
    for grad in trace.grads:
        if grad is not None and not values[nodes[grad].storages[0]].is_placeholder:
            values[nodes[grad].storages[0]].kind = "gradient"
    tangent_storage = {v.index for v in values if v.kind == "tangent"}
    of_tangent = tuple(n for n in prologue if nodes[n].storages[0] in tangent_storage)
    rest = tuple(n for n in prologue if n not in of_tangent)
    return Graph(trace, ops, values, rest, of_tangent, frozenset(final), transients)


def first_backward_node(trace: Trace) -> int:
    """The first node reading the incoming gradient (the tangents): every op before it is
    the forward's, the loss's included."""
    nodes = trace.nodes
    tangents = {s for n in nodes if n.role == "tangent" for s in n.storages}
    return next(
        (
            n.index
            for n in nodes
            if n.role == "op" and any(s in tangents for r in n.reads for s in nodes[r].storages)
        ),
        len(nodes),
    )


def _read_storages(trace: Trace, node) -> set[int]:
    return {s for r in node.reads for s in trace.nodes[r].storages}


def _reads_any(trace: Trace, node, storages: dict[int, int]) -> bool:
    return any(s in storages for s in _read_storages(trace, node))


def _merge(
    targets: list[int],
    groups: list[list[int]],
    group_of: dict[int, int],
    owner: dict[int, int],
    updating: dict[int, int],
) -> int:
    """Fold groups `targets[1:]` into `targets[0]` (nodes kept in traced order); emptied
    groups stay as empty lists, dropped when ops are made."""
    g = targets[0]
    for h in targets[1:]:
        groups[g] = sorted(groups[g] + groups[h])
        for n in groups[h]:
            group_of[n] = g
        groups[h] = []
        for table in (owner, updating):
            for s, x in table.items():
                if x == h:
                    table[s] = g
    return g


def _written_storages(trace: Trace, node) -> list[int]:
    return [s for w in node.writes for s in trace.nodes[w].storages]


def _check_no_write_after_foreign_read(trace: Trace, groups, group_of) -> None:
    """An in-place op must not change an activation another op already read: ops run as units.

    Model state (buffers) is exempt: it is written once per step, by the forward.
    """
    placeholders = {s for n in trace.nodes if n.role != "op" for s in n.storages}
    first_write: dict[int, int] = {}
    for node in trace.nodes:
        for s in _written_storages(trace, node):
            if s not in placeholders:
                first_write.setdefault(s, node.index)
    for node in trace.nodes:
        for r in node.reads if node.index in group_of else ():
            for s in trace.nodes[r].storages:
                w = first_write.get(s)
                if w is not None and node.index < w and group_of[w] != group_of[node.index]:
                    raise UnsupportedModel(
                        f"the in-place op {trace.nodes[w].name} ({trace.nodes[w].label}) on a "
                        f"tensor that {node.name} read before it",
                        "",
                        "use the out-of-place form (x = x + y instead of x += y)",
                    )


def _make_ops(trace: Trace, groups, owner, placeholder_storage) -> list[Op]:
    nodes = trace.nodes
    owned: list[list[int]] = [[] for _ in groups]
    for s, g in owner.items():
        owned[g].append(s)
    raw = []
    for g, members in enumerate(groups):
        outputs = tuple(sorted(owned[g]))
        reads = {s for n in members for r in nodes[n].reads for s in nodes[r].storages}
        writes = {s for n in members for s in _written_storages(trace, nodes[n])}
        anchor = nodes[members[0]]
        raw.append(
            Op(
                index=-1,
                name=anchor.name,
                label=anchor.label,
                nodes=tuple(members),
                inputs=tuple(sorted(reads - set(outputs))),
                outputs=outputs,
                phase="forward",  # set by _drop_dead_and_classify
                random=any(nodes[n].random for n in members),
                state_update=bool(writes & placeholder_storage),
                writes=tuple(sorted(writes & placeholder_storage)),
            )
        )
    return _topological(raw, owner)


def _topological(raw: list[Op], owner: dict[int, int]) -> list[Op]:
    """Order ops so each runs after what it reads; ties keep the traced order."""
    deps = [{owner[v] for v in op.inputs if v in owner} for op in raw]
    users: list[list[int]] = [[] for _ in raw]
    for g, ds in enumerate(deps):
        for d in ds:
            users[d].append(g)
    missing = [len(ds) for ds in deps]
    heap = [(raw[g].nodes[0], g) for g in range(len(raw)) if missing[g] == 0]
    heapq.heapify(heap)
    order = []
    while heap:
        _, g = heapq.heappop(heap)
        order.append(g)
        for u in users[g]:
            missing[u] -= 1
            if missing[u] == 0:
                heapq.heappush(heap, (raw[u].nodes[0], u))
    if len(order) != len(raw):
        raise UnsupportedModel("a cycle between in-place ops", "", "use out-of-place ops")
    return [raw[g] for g in order]


def _drop_dead_and_classify(
    ops: list[Op], final: set[int], model_outputs: set[int], backward_begins: int
) -> tuple[list[Op], list[Op]]:
    """Keep the ops the step needs and split them into phases; also returns the dropped
    ones, in trace order.

    Forward: what the model outputs need, plus random and state-updating ops (they run once,
    in the forward, in traced order). Everything else is backward, including forward-region
    ops read only by the backward, so they run lazily when the backward needs them. A state
    update traced in the backward (at or after node `backward_begins`, the first to read the
    incoming gradient: an optimizer's update) is a backward op the step needs, as a final
    value is.
    """
    producer = {v: i for i, op in enumerate(ops) for v in op.outputs}
    updates = {i for i, op in enumerate(ops) if op.state_update and op.nodes[0] > backward_begins}
    for i in updates:
        ops[i].state_update, ops[i].update = False, True

    def ancestors(roots: set[int]) -> set[int]:
        seen: set[int] = set()
        stack = list(roots)
        while stack:
            i = stack.pop()
            if i not in seen:
                seen.add(i)
                stack.extend(producer[v] for v in ops[i].inputs if v in producer)
        return seen

    sticky = {i for i, op in enumerate(ops) if op.random or op.state_update}
    forward = ancestors(sticky | {producer[v] for v in model_outputs if v in producer})
    needed = forward | ancestors({producer[v] for v in final if v in producer} | updates)
    out: list[Op] = []
    for i in sorted(needed):
        op = ops[i]
        op.index = len(out)
        op.phase = "forward" if i in forward else "backward"
        out.append(op)
    dead = sorted((op for i, op in enumerate(ops) if i not in needed), key=lambda o: o.nodes[0])
    return out, dead
