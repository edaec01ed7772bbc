"""Megatron's column -> row pairs, found in the traced graph, and a tensor-parallel replica.

A pair is one or more linear layers whose outputs reach nothing but one other linear layer
(attention's q, k, v -> its output projection; an MLP's up (and gate) -> down). Sharding the
first ones by output features (columns) and the last by input features (rows) leaves each
rank the same computation on 1/tp of the heads or hidden units, and one all-reduce of the
row layer's output (forward) and of the column layers' input gradient (backward).

Pairs are found once per kind of block (identical blocks are solved once: TAP's folding) on
the block's forward ops, and carried to the other blocks of the kind by op position. What a
rank then computes is traced again: a replica of the model whose paired linears have 1/tp of
their features, on the same inputs. Its trace is the rank's graph: activation sizes, op
costs and the remat plan come from it, and a model whose code does not run sharded (heads
inferred from a full width, a fused projection split at full width) fails that trace, and
the pair is replicated instead.
"""

from __future__ import annotations

import copy
import dataclasses
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from core.errors import UnsupportedModel
from core.graph import Graph
from core.problem import Problem, analyze
from core.trace import Ref
from core.trace.call import join_call

# ops that take part of a tensor along one dim: on the full width of a column layer's output
# they mark a fused projection (q, k and v in one layer), whose contiguous shards are wrong
_SLICING = {"split", "split_with_sizes", "slice", "chunk", "narrow", "unbind", "select"}


@dataclass(frozen=True)
class Pair:
    """Column layers (sharded by output features) feeding one row layer (by input features)."""

    columns: tuple[str, ...]  # module paths
    row: str

    @property
    def modules(self) -> tuple[str, ...]:
        return (*self.columns, self.row)


@dataclass(frozen=True)
class KindPairs:
    """The pairs of one kind of block, relative to its first block, and every block's own."""

    kind: int
    block_name: str  # the kind's first block, e.g. "transformer.h.0"
    blocks: int  # blocks of this kind
    relative: tuple[Pair, ...]  # the first block's pairs
    per_block: tuple[tuple[Pair, ...], ...]  # each block's pairs, in chain order
    refused: tuple[str, ...] = ()  # why candidate pairs were replicated


def find_pairs(problem: Problem, model: nn.Module) -> list[KindPairs]:
    """Column -> row pairs of every kind of block (those with any), found on its first block."""
    linears = {name for name, m in model.named_modules() if isinstance(m, nn.Linear)}
    graph = problem.graph
    constants = set(problem.constant_ops)
    out = []
    for kind in sorted({b.kind for b in problem.blocks}):
        members = [b for b in problem.blocks if b.kind == kind]
        first = members[0]
        pairs, refused = _block_pairs(graph, first.forward_ops, linears, constants, model)
        if not pairs and not refused:
            continue
        per_block = tuple(
            tuple(_carried(graph, first.forward_ops, b.forward_ops, p) for p in pairs)
            for b in members
        )
        out.append(
            KindPairs(kind, first.name, len(members), tuple(pairs), per_block, tuple(refused))
        )
    return out


def _module(graph: Graph, op: int) -> str | None:
    return graph.trace.nodes[graph.ops[op].nodes[0]].module


def _block_pairs(
    graph: Graph,
    ops: tuple[int, ...],
    linears: set[str],
    constants: set[int],
    model: nn.Module,
) -> tuple[list[Pair], list[str]]:
    inside = set(ops)
    linear_of = {o: m for o in ops if (m := _module(graph, o)) in linears}
    pairs, refused = [], []
    for r, row in linear_of.items():
        region, columns = _region_before(graph, r, inside, linear_of, constants)
        if region is None or not columns:
            continue
        names = tuple(dict.fromkeys(linear_of[c] for c in sorted(columns)))
        why = _unsound(graph, r, region, columns, constants) or _fused(graph, columns, model)
        if why:
            refused.append(f"{', '.join(names)} -> {row}: {why}")
            continue
        pairs.append(Pair(names, row))
    return pairs, refused


def _region_before(
    graph: Graph, row: int, inside: set[int], linear_of: dict[int, str], constants: set[int]
) -> tuple[set[int] | None, set[int]]:
    """The forward ops between the row layer and the linear layers feeding it (None when an
    op of another block, a parameter outside a linear or a step input is reached first)."""
    region: set[int] = set()
    columns: set[int] = set()
    stack = [v for v in graph.ops[row].inputs if graph.values[v].kind == "activation"]
    while stack:
        o = graph.values[stack.pop()].producer
        if o is None or o in region or o in columns or o in constants:
            continue
        if o not in inside:
            return None, columns
        if o in linear_of:
            if linear_of[o] == linear_of[row]:
                return None, columns
            columns.add(o)
            continue
        op = graph.ops[o]
        if any(graph.values[v].kind in ("param", "input") for v in op.inputs):
            return None, columns
        region.add(o)
        stack.extend(op.inputs)
    return region, columns


def _unsound(
    graph: Graph, row: int, region: set[int], columns: set[int], constants: set[int]
) -> str:
    """Why the columns' outputs reach something other than the row layer, or ''."""
    allowed = region | {row}
    for o in (*region, *columns):
        for v in graph.ops[o].outputs:
            for c in graph.values[v].consumers:
                if graph.ops[c].phase == "forward" and c not in allowed:
                    return f"{graph.ops[o].name} also feeds {graph.ops[c].name}"
    return ""


def _fused(graph: Graph, columns: set[int], model: nn.Module) -> str:
    """Why a column layer's output is split across its full width (fused q/k/v), or ''."""
    nodes = graph.trace.nodes
    for c in columns:
        width = nodes[graph.ops[c].nodes[0]].specs[0].shape[-1]
        storage = set(graph.ops[c].outputs)
        for node in nodes:
            if node.target is None or getattr(node.target, "_opname", "") not in _SLICING:
                continue
            src = node.args[0] if node.args else None
            if not isinstance(src, Ref) or not set(nodes[src.index].storages) & storage:
                continue
            shape = nodes[src.index].specs[0].shape
            dim = _dim_arg(node)
            if shape and shape[dim % len(shape)] == width:
                return f"{node.name} ({node.label}) splits its {width} output features: fused"
    return ""


_DIM_POSITION = {"split": 2, "split_with_sizes": 2, "chunk": 2}  # others: position 1


def _dim_arg(node: Any) -> int:
    pos = _DIM_POSITION.get(node.target._opname, 1)
    return int(node.args[pos]) if len(node.args) > pos else int(node.kwargs.get("dim", 0))


def _carried(graph: Graph, first: tuple[int, ...], other: tuple[int, ...], pair: Pair) -> Pair:
    """`pair` of the first block as the same op positions name it in another block."""
    where = {_module(graph, o): i for i, o in reversed(list(enumerate(first)))}

    def there(m: str) -> str:
        return _module(graph, other[where[m]]) or m

    return Pair(tuple(there(c) for c in pair.columns), there(pair.row))


def shardable(mods: dict[str, nn.Module], pair: Pair, tp: int) -> bool:
    """Whether every layer of `pair` divides into `tp` shards (features, not yet heads)."""
    ok = all(_linear(mods[c]).out_features % tp == 0 for c in pair.columns)
    return ok and _linear(mods[pair.row]).in_features % tp == 0


def _linear(m: nn.Module) -> nn.Linear:
    assert isinstance(m, nn.Linear), m
    return m


def replica(model: nn.Module, pairs: list[Pair], tp: int) -> nn.Module:
    """The model as one rank of `tp` holds it: each pair's column layers with 1/tp of their
    output features, its row layer with 1/tp of its input features (weights uninitialised,
    on the model's device; other parameters shared with the model, not copied). Their
    `in_features` and `out_features` stay the whole model's, as `parallelize_module` leaves
    them: a native plan checks those attributes against the trace's at every call."""
    memo: dict[int, Any] = {id(t): t for t in (*model.parameters(), *model.buffers())}
    rep = copy.deepcopy(model, memo)
    mods = dict(rep.named_modules())
    for pair in pairs:
        for c in pair.columns:
            _shrink(mods[c], 0, tp)
        _shrink(mods[pair.row], 1, tp)
    return rep


def _shrink(module: nn.Module, dim: int, tp: int) -> None:
    linear = _linear(module)
    w = linear.weight
    shape = list(w.shape)
    shape[dim] //= tp
    linear.weight = nn.Parameter(torch.empty(shape, dtype=w.dtype, device=w.device))
    if dim == 0 and linear.bias is not None:
        b = linear.bias
        linear.bias = nn.Parameter(torch.empty(shape[0], dtype=b.dtype, device=b.device))


def rank_problem(
    problem: Problem, model: nn.Module, groups: list[list[Pair]], tp: int, device: str
) -> tuple[Problem, list[list[Pair]], list[str]]:
    """The traced step of one rank of `tp` with as many `groups` of pairs (one group: a pair
    of a kind, in every block of it) sharded as trace: (problem, groups kept, why others were
    not). The replica runs on the problem's own call (inputs rebuilt from the trace's shapes:
    a trace reads no values), costs estimated for `device`. A group whose replica does not
    trace (heads that do not divide by `tp`) is replicated."""
    mods = dict(model.named_modules())
    groups = [g for g in groups if all(shardable(mods, p, tp) for p in g)]
    if tp == 1 or not groups:
        return problem, [], []
    try:
        return _traced(problem, model, groups, tp, device), groups, []
    except UnsupportedModel:
        if len(groups) == 1:
            return problem, [], [_refusal(groups[0], tp)]
    kept, why, last = [], [], problem
    for g in groups:  # one at a time: which group's code does not run sharded
        try:
            last = _traced(problem, model, [g], tp, device)
            kept.append(g)
        except UnsupportedModel:
            why.append(_refusal(g, tp))
    if len(kept) > 1:
        last = _traced(problem, model, kept, tp, device)
    return last, kept, why


def _refusal(group: list[Pair], tp: int) -> str:
    p = group[0]
    return f"{', '.join(p.columns)} -> {p.row}: its code does not run on 1/{tp} of the features"


def _traced(
    problem: Problem, model: nn.Module, groups: list[list[Pair]], tp: int, device: str
) -> Problem:
    args, kwargs, targets = traced_call(problem, model)
    rank_model = replica(model, [p for g in groups for p in g], tp)
    rank = analyze(
        rank_model,
        args,
        kwargs,
        problem.loss_fn,
        targets,
        device=device,
        name=f"{problem.name} tp{tp}",
        autocast=problem.graph.trace.autocast,
    )
    # the rank's problem refers to no model: its plan runs on the sharded model, where
    # DTensor's hooks run ops the replica does not, so native lowering takes no module
    # boundaries or Python lifetimes from the replica (whole layers, last reads)
    return dataclasses.replace(rank, model_ref=None)


def traced_call(problem: Problem, model: nn.Module) -> tuple[tuple, dict, tuple]:
    """(args, kwargs, targets) shaped as the problem's trace, zeros on the model's device."""
    trace = problem.graph.trace
    p = next(iter(model.parameters()), None)
    device = p.device if p is not None else torch.device("cpu")
    tensors = []
    for i, spec in enumerate(trace.input_specs):
        t = torch.zeros(spec.shape, dtype=getattr(torch, spec.dtype), device=device)
        tensors.append(t.requires_grad_() if i in trace.grad_inputs else t)
    return join_call(tensors, trace.call)
