"""Split the graph into a chain of blocks, Rockmate-style.

A separator is a forward value that every later forward op reaches only through it: once it
exists, nothing computed before it is needed by the forward again. Cutting at separators
gives a chain of blocks; each block's backward ops are those that read its activations or
the gradients its successor produced. Cuts that fall inside one module (the two residual
adds of one transformer layer) are dropped, so a GPT yields a block per layer and a ResNet a
block per residual block. Blocks identical up to renaming share a `kind`, so each kind is
timed and solved once.

Step constants are forward values that need no gradient and come only from inputs, buffers
and constants (causal masks, position ids, rotary tables, attention biases): real models
compute them once and hand them to every layer, so no cut would have a single crossing value.
They belong to no block: they run first, any block may read them, and they live for the step
(until their last read). Cuts are found on the other values, the ones gradients flow through.
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


def constant_ops(graph: Graph) -> tuple[int, ...]:
    """Forward ops computed from inputs that need no gradient, buffers and constants only
    (never random, never updating state): the step constants, in forward order."""
    const_kinds = {"state", "constant"}
    grad_inputs = {graph.trace.nodes[n].storages[0] for n in _grad_input_nodes(graph)}
    constant_values = {
        v.index
        for v in graph.values
        if v.kind in const_kinds or (v.kind == "input" and v.index not in grad_inputs)
    }
    out = []
    for o in graph.forward_ops:
        op = graph.ops[o]
        if op.random or op.state_update or not set(op.inputs) <= constant_values:
            continue
        out.append(o)
        constant_values.update(op.outputs)
    return tuple(out)


def find_blocks(graph: Graph) -> tuple[list[Block], list[int]]:
    """The chain of blocks and, for every op, the block it belongs to (a step constant: the
    first block that reads it)."""
    constants = set(constant_ops(graph))
    fwd = [o for o in graph.forward_ops if o not in constants]
    cuts = [
        i for i in _separator_positions(graph, fwd) if _between_modules(graph, fwd[i], fwd[i + 1])
    ]
    while True:
        block_of_op, separators = _assign(graph, fwd, cuts)
        merge = _cross_block_read(graph, block_of_op, separators, constants)
        if merge is None:
            break
        lo, hi = merge  # blocks lo..hi become one: drop the cuts between them
        cuts = cuts[:lo] + cuts[hi:]
    n_blocks = len(cuts) + 1
    for o in sorted(constants):
        readers = [block_of_op[c] for v in graph.ops[o].outputs for c in graph.values[v].consumers]
        block_of_op[o] = min((b for b in readers if b >= 0), default=0)

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


def _grad_input_nodes(graph: Graph) -> list[int]:
    trace = graph.trace
    inputs = [n.index for n in trace.nodes if n.role == "input"]
    return [inputs[i] for i in trace.grad_inputs]


def _assign(graph: Graph, fwd: list[int], cuts: list[int]) -> tuple[list[int], dict[int, int]]:
    """Blocks of forward ops between the cuts, then of backward ops; separator -> block fed."""
    bounds = [-1, *cuts, len(fwd) - 1]
    block_of_op = [-1] * len(graph.ops)
    separators: dict[int, int] = {}
    for b in range(len(bounds) - 1):
        for i in range(bounds[b] + 1, bounds[b + 1] + 1):
            block_of_op[fwd[i]] = b
        if b < len(bounds) - 2:
            separators[_separator_value(graph, fwd[bounds[b + 1]])] = b + 1
    _assign_backward(graph, block_of_op, separators, len(bounds) - 1)
    return block_of_op, separators


def _cross_block_read(
    graph: Graph, block_of_op: list[int], separators: dict[int, int], constants: set[int]
) -> tuple[int, int] | None:
    """Two blocks to merge when a forward value of one is read by another (other than a
    separator by the block it feeds), or None when the chain is sound."""
    for o in graph.forward_ops:
        if o in constants:
            continue
        s = block_of_op[o]
        for v in graph.ops[o].outputs:
            allowed = {s, separators[v]} if v in separators else {s}
            for c in graph.values[v].consumers:
                r = block_of_op[c]
                if r not in allowed:
                    return min(s, r), max(s, r)
    return None


def _separator_positions(graph: Graph, fwd: list[int]) -> list[int]:
    """Positions i in `fwd` after which only one value produced in `fwd` is still needed."""
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
    """A backward op belongs to a block its forward reads allow: the block of each activation
    it reads, either side of a separator. Among those, the block of the forward op it
    differentiates (autograd's sequence number links them; a number can be shared by ops in
    two blocks, as a dropout right after a LayerNorm carries the LayerNorm's). Ops that read no
    forward value take their linked block; others (gradient sums) the earliest block whose
    gradients they read; ops that read neither (constants of the backward) go with their
    latest consumer.
    """
    nodes = graph.trace.nodes
    seq_blocks: dict[int, set[int]] = {}
    for o in graph.forward_ops:
        if block_of_op[o] >= 0:
            for n in graph.ops[o].nodes:
                if nodes[n].seq_nr >= 0:
                    seq_blocks.setdefault(nodes[n].seq_nr, set()).add(block_of_op[o])
    undecided = []
    for o in graph.backward_ops:
        linked = set().union(*(seq_blocks.get(nodes[n].seq_nr, ()) for n in graph.ops[o].nodes))
        allowed: set[int] | None = None
        grads = []
        for v in graph.ops[o].inputs:
            value = graph.values[v]
            if value.producer is None:
                continue
            b = block_of_op[value.producer]
            if graph.ops[value.producer].phase == "backward":
                grads.append(b)
            elif b >= 0:  # a step constant (-1 here) binds no block
                here = {b, separators[v]} if v in separators else {b}
                allowed = here if allowed is None else allowed & here
        if allowed:
            block_of_op[o] = max((allowed & linked) or allowed)
        elif linked:
            block_of_op[o] = max(linked)
        elif grads:
            block_of_op[o] = min(grads)
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
