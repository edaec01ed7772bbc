"""Split the graph into a chain of blocks, Rockmate-style.

A separator is a forward value that every later forward op reaches only through it: once it
exists, nothing computed before it is needed by the forward again. Cutting at separators
gives a chain of blocks; each block's backward ops are those that read its activations or
the gradients its successor produced. Cuts that fall inside one module (the two residual
adds of one transformer layer) are dropped, so a GPT yields a block per layer and a ResNet a
block per residual block. Blocks identical up to renaming share a `kind`, so each kind is
timed and solved once.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

from core.graph import Graph
from core.trace import Ref


@dataclass
class Block:
    index: int
    name: str  # the module the block's forward runs in, e.g. "transformer.h.3"
    forward_ops: tuple[int, ...]
    backward_ops: tuple[int, ...]
    output_value: int | None  # the separator it ends with (None for the last block)
    kind: int  # blocks of one kind are identical up to renaming
    activation_bytes: int  # bytes its forward allocates
    forward_time: float
    backward_time: float


def find_blocks(graph: Graph) -> tuple[list[Block], list[int]]:
    """The chain of blocks and, for every op, the block it belongs to."""
    fwd = graph.forward_ops
    cuts = [i for i in _separator_positions(graph) if _between_modules(graph, fwd[i], fwd[i + 1])]
    bounds = [-1, *cuts, len(fwd) - 1]
    block_of_op = [-1] * len(graph.ops)
    separators: dict[int, int] = {}  # separator value -> block it feeds
    for b in range(len(bounds) - 1):
        for i in range(bounds[b] + 1, bounds[b + 1] + 1):
            block_of_op[fwd[i]] = b
        if b < len(bounds) - 2:
            separators[_separator_value(graph, fwd[bounds[b + 1]])] = b + 1
    n_blocks = len(bounds) - 1
    _assign_backward(graph, block_of_op, separators, n_blocks)

    blocks = []
    kinds: dict[str, int] = {}
    sep_of_block = {b - 1: v for v, b in separators.items()}
    for b in range(n_blocks):
        f = tuple(o for o in fwd if block_of_op[o] == b)
        bw = tuple(o for o in graph.backward_ops if block_of_op[o] == b)
        sig = _signature(graph, f + bw)
        blocks.append(
            Block(
                index=b,
                name=_common_module(graph, f),
                forward_ops=f,
                backward_ops=bw,
                output_value=sep_of_block.get(b),
                kind=kinds.setdefault(sig, len(kinds)),
                activation_bytes=sum(
                    graph.values[v].nbytes for o in f for v in graph.ops[o].outputs
                ),
                forward_time=sum(graph.ops[o].time for o in f),
                backward_time=sum(graph.ops[o].time for o in bw),
            )
        )
    return blocks, block_of_op


def _separator_positions(graph: Graph) -> list[int]:
    """Positions i in the forward order after which only one forward value is still needed."""
    fwd = graph.forward_ops
    pos = {o: i for i, o in enumerate(fwd)}
    end = len(fwd)
    last_use: dict[int, int] = {}  # value -> last forward position reading it
    for o in fwd:
        for v in graph.ops[o].outputs:
            users = [pos[c] for c in graph.values[v].consumers if c in pos]
            last_use[v] = end if v in graph.final_values else max(users, default=-1)
    cuts = []
    reach = -1  # furthest forward use of any value produced so far, but the latest op's
    for i, o in enumerate(fwd[:-1]):
        crossing = [v for v in graph.ops[o].outputs if last_use[v] > i]
        if reach <= i and len(crossing) == 1 and last_use[crossing[0]] != end:
            cuts.append(i)
        reach = max([reach] + [last_use[v] for v in graph.ops[o].outputs])
    return cuts


def _separator_value(graph: Graph, op: int) -> int:
    fwd = set(graph.forward_ops)
    outs = [v for v in graph.ops[op].outputs if any(c in fwd for c in graph.values[v].consumers)]
    return outs[0]


def _module_of(graph: Graph, op: int) -> str | None:
    return graph.trace.nodes[graph.ops[op].nodes[0]].module


def _between_modules(graph: Graph, a: int, b: int) -> bool:
    """True when ops a and b sit in different children of their deepest common module."""
    ma, mb = _module_of(graph, a), _module_of(graph, b)
    if ma is None or mb is None:
        return True
    pa, pb = ma.split(".") if ma else [], mb.split(".") if mb else []
    common = 0
    while common < min(len(pa), len(pb)) and pa[common] == pb[common]:
        common += 1
    return common < len(pa) and common < len(pb)


def _common_module(graph: Graph, ops: tuple[int, ...]) -> str:
    paths = [m.split(".") for o in ops if (m := _module_of(graph, o))]
    if not paths:
        return "model"
    prefix = paths[0]
    for p in paths[1:]:
        n = 0
        while n < min(len(prefix), len(p)) and prefix[n] == p[n]:
            n += 1
        prefix = prefix[:n]
    return ".".join(prefix) or "model"


def _assign_backward(
    graph: Graph, block_of_op: list[int], separators: dict[int, int], n_blocks: int
) -> None:
    """A backward op belongs to the block of the forward op it differentiates (autograd's
    sequence number links them). Others (gradient sums) go to the earliest block whose
    activations or gradients they read, a separator counting for the block it feeds; ops that
    read neither (constants of the backward) go with their latest consumer.
    """
    nodes = graph.trace.nodes
    seq_block = {
        nodes[n].seq_nr: block_of_op[o]
        for o in graph.forward_ops
        for n in graph.ops[o].nodes
        if nodes[n].seq_nr >= 0
    }
    undecided = []
    for o in graph.backward_ops:
        linked = [
            seq_block[nodes[n].seq_nr] for n in graph.ops[o].nodes if nodes[n].seq_nr in seq_block
        ]
        if linked:
            block_of_op[o] = linked[0]
            continue
        candidates = []
        for v in graph.ops[o].inputs:
            value = graph.values[v]
            if v in separators:
                candidates.append(separators[v])
            elif value.producer is not None:
                candidates.append(block_of_op[value.producer])
        if candidates:
            block_of_op[o] = min(candidates)
        else:
            undecided.append(o)
    for o in reversed(undecided):
        users = [c for v in graph.ops[o].outputs for c in graph.values[v].consumers]
        block_of_op[o] = max((block_of_op[c] for c in users), default=n_blocks - 1)


def _signature(graph: Graph, ops: tuple[int, ...]) -> str:
    """Hash of the ops' ATen calls with references renumbered relative to the block."""
    nodes = graph.trace.nodes
    local: dict[int, int] = {}
    parts = []

    def norm(arg):
        if isinstance(arg, Ref):
            n = nodes[arg.index]
            if arg.index in local:
                return ("L", local[arg.index])
            return ("X", n.role, n.specs)  # from outside the block: compare by shape only
        if isinstance(arg, (tuple, list)):
            return tuple(norm(a) for a in arg)
        if isinstance(arg, dict):
            return tuple((k, norm(a)) for k, a in sorted(arg.items()))
        return repr(arg)

    for o in ops:
        for n in graph.ops[o].nodes:
            node = nodes[n]
            local[n] = len(local)
            parts.append(
                (node.label, str(node.target), norm(node.args), norm(node.kwargs), node.specs)
            )
    return hashlib.sha256(repr(parts).encode()).hexdigest()
