"""Native execution simulated: a traced step run as eager PyTorch with some modules under
non-reentrant `torch.utils.checkpoint` and a selective policy, turned into a program over
the step's ops (plus a recomputed copy of each value a checkpoint recomputes) that the one
walker (`core.simulator.walker`) walks to its peak and time.

The rules, from `torch/utils/checkpoint.py` (torch 2.13) and autograd, each held to a
measured step by tests:
- The forward runs every op once. A value lives while Python holds it (until its last
  forward read) and while something saves it: an autograd node outside every checkpoint
  (until that node's backward, its last backward read), the selective-checkpoint cache of
  its region (a MUST_SAVE op's results: until the recompute takes them back, or until the
  region's frame dies when the recompute stops before them), or a region's frame, which
  holds the region's inputs (`save_inputs`, and the kwargs in `recompute_fn`'s closure)
  until the region's last node that saved a tensor has run its backward. Inside a region a
  saved tensor is packed into a holder: autograd does not hold it.
- In the backward, ops run in the traced order; the first node of a region that unpacks a
  saved tensor makes checkpoint re-run the region's forward: its ops in order, cached ops
  costing nothing and allocating nothing, up to the op whose node filled the region's last
  holder (early stop, `_StopRecomputationError`). A recomputed value is held by the frame's
  `recomputed` map until the last of the region's nodes that saved it has run; Python
  drops the others after their last read in the recompute.

A backward op belongs to the autograd node whose sequence number its first traced node
carries; that node was made by the first forward node with that number. A node's call (a
stretch of ops with one number) holds its incoming gradients and saved tensors until it
ends; a tensor unpacked from a checkpoint or from the host dies when the formula returns,
before `validate_outputs`' trailing sums, and so do the formula's own temporaries (C++
temporaries and locals: PowBackward0's `grad * (2 * self.pow(1))` holds both factors while
it multiplies). Gradients summed as the engine hands a node's outputs to the next nodes
(a stale call) are part of that node's call, except a sum into a parameter's `.grad`,
which AccumulateGrad runs as a call of its own.

Offloads (saved-tensor hooks, `core.native.offload`): an offloaded value is packed
to the host when autograd saves it, so only Python holds its device storage; each node
call that reads it copies it back first into a fresh device storage.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from core.graph import Graph
from core.simulator.program import FREE, RUN, Instruction, Link, step_values
from core.simulator.walker import Walk, walk


@dataclass(frozen=True)
class Checkpointed:
    """One region run under checkpoint: the traced forward nodes its module runs, the
    graph ops whose results its policy saves (MUST_SAVE) and the values its module is
    called with (its frame holds them, read or not)."""

    nodes: frozenset[int]
    cached: frozenset[int]
    inputs: frozenset[int] = frozenset()
    # a stretch's recompute replays its ops (`core.native.replay`): value -> the region op
    # after which the replay drops it, instead of the model's Python lifetimes
    replay_drops: dict[int, int] | None = None
    early_stop: bool = True  # False: the recompute runs the whole forward (torchtitan's)
    # the region this one runs inside (nested checkpoint, `core.native.replay`): an index
    # into the regions, listed before this one; None at the top
    parent: int | None = None


@dataclass(frozen=True)
class NativeOp:
    """An op of the native program: a graph op, or a recompute of one (its outputs copies)."""

    inputs: tuple[int, ...]
    outputs: tuple[int, ...]
    time: float
    source: int  # the graph op it runs


@dataclass(frozen=True)
class NativeProgram:
    """A step under native execution as a program the walker walks: `ops` are the graph's
    ops then the recomputes (copies of values numbered after the graph's)."""

    ops: tuple[NativeOp, ...]
    program: tuple[Instruction, ...]
    backward_start: int
    sizes: dict[int, int]
    recomputed_ops: int
    recompute_time: float

    def walk(self, graph: Graph) -> Walk:
        """The program walked from the step's placeholders: peak and time."""
        _, initial, arriving = step_values(graph)
        return walk(
            self.ops,
            self.program,
            self.backward_start,
            self.sizes,
            initial,
            arriving,
            graph.final_values,
        )


@dataclass
class _Region:
    """What the program needs of a region: its forward ops, its saving nodes' backward ops,
    where its recompute starts and stops."""

    ops: list[int]  # graph forward ops run in the module, in order
    cached: frozenset[int]
    inputs: frozenset[int]  # values the module is called with
    saving: set[int]  # backward ops of the region's nodes that saved a tensor
    stop: int = -1  # the last op the recompute runs (-1: nothing recomputed)
    replay_drops: dict[int, int] | None = None  # see Checkpointed
    parent: int | None = None  # see Checkpointed


def native_program(
    graph: Graph,
    regions: Sequence[Checkpointed],
    dropped: dict[int, int] | None = None,
    offloaded: frozenset[int] = frozenset(),
    link: Link | None = None,
    copied_back: Callable[[Call, int], int] | None = None,
) -> NativeProgram:
    """The native program of `graph` with `regions` checkpointed (the rules above).
    `dropped`: forward value -> the forward op after which the model's Python code drops it
    (`core.native.lifetimes`); a value missing is dropped after its last forward read.
    `offloaded`: values made and read outside every region that saved-tensor hooks move to
    the host, their copies timed over `link` (untimed without one). `copied_back(call, v)`:
    the bytes of `v` a node call copies back (0: its node saved `v` unpacked), for hooks
    that copy each saved view on its own (torchtune's); default: `v`'s storage, once."""
    nodes = graph.trace.nodes
    op_of = {n: op.index for op in graph.ops for n in op.nodes}
    inplace = in_place_ops(graph)
    clones = frozenset(inplace.values())
    forward_ops = sorted((*graph.forward_ops, *clones))
    maker: dict[int, int] = {}  # seq_nr -> the forward node that made that autograd node
    for n in nodes:
        if n.role == "op" and n.module is not None and op_of.get(n.index) not in clones:
            maker.setdefault(n.seq_nr, n.index)
    depth = _depths(regions)
    region_of_node = {  # the innermost region running a node: its saved tensors are that one's
        n: r for r in sorted(range(len(regions)), key=depth.__getitem__) for n in regions[r].nodes
    }
    existing = {
        v.index
        for v in graph.values
        if v.producer is None or _forward(graph, v) or v.producer in clones
    }
    arriving = {v.index for v in graph.values if v.kind == "tangent"}
    parts = [
        _Region(
            _ops_in(reg, graph, forward_ops),
            reg.cached,
            reg.inputs,
            set(),
            -1,
            reg.replay_drops,
            reg.parent,
        )
        for reg in regions
    ]
    calls = backward_calls(graph, clones)
    owner: dict[int, int] = {}  # backward op -> region of its node
    node_of: dict[int, int] = {}  # backward op -> the forward node that made its node
    saving: set[int] = set()  # forward nodes that made a node saving a tensor
    own: set[int] = set()  # ... saving one of its own op's results, not only its inputs
    for call in calls:
        made = maker.get(call.seq_nr) if not call.stale else None
        r = region_of_node.get(made) if made is not None else None
        if r is None or made is None:
            continue
        results = set(graph.ops[op_of[made]].outputs) if made in op_of else set()
        for b in call.ops:
            owner[b], node_of[b] = r, made
            read = [v for v in graph.ops[b].inputs if v in existing and v not in arriving]
            if read:
                saving.add(made)
            if results.intersection(read):
                own.add(made)
    for b, made in node_of.items():
        if made in saving:
            part = parts[owner[b]]
            part.saving.add(b)
            # autograd packs a node's inputs before its op runs, its results after: when
            # the last holder is an input's, the recompute stops before that op
            part.stop = max(part.stop, op_of[made] if made in own else op_of[made] - 1)
    for part in parts:  # a nested region saves its inputs to its parent as it opens: the
        # parent's recompute runs up to there at least (its ops before the nested one's)
        if part.parent is not None and part.ops:
            parent = parts[part.parent]
            before = [o for o in parent.ops if o < part.ops[0]]
            parent.stop = max(parent.stop, before[-1] if before else -1)
    for part, reg in zip(parts, regions):
        if not reg.early_stop and part.stop >= 0:
            part.stop = max(part.ops)
    builder = _Builder(graph, parts, owner, calls, dropped or {}, inplace, forward_ops)
    return builder.build(_Offloads(offloaded, link, copied_back))


def _depths(regions: Sequence[Checkpointed]) -> list[int]:
    """How many regions each region runs inside."""
    out: list[int] = []
    for reg in regions:
        out.append(0 if reg.parent is None else out[reg.parent] + 1)
    return out


def autocast_casts(graph: Graph) -> set[int]:
    """Forward ops casting a parameter under autocast: autocast caches the cast of a leaf
    that requires grad (`cached_cast`) and frees it when the outermost autocast exits, at
    the forward's end, or a checkpoint recompute's (which re-enters autocast)."""
    if not graph.trace.autocast.enabled:
        return set()
    nodes = graph.trace.nodes
    return {
        o
        for o in graph.forward_ops
        if nodes[graph.ops[o].nodes[0]].target is torch.ops.aten._to_copy.default
        and len(graph.ops[o].inputs) == 1
        and graph.values[graph.ops[o].inputs[0]].kind == "param"
    }


def in_place_ops(graph: Graph) -> dict[int, int]:
    """Forward ops eager runs in place, each with the clone autograd makes of its input
    first (the original its derivative reads: `SiLU(inplace=True)`, timm's `BatchNormAct2d`).
    The trace records the op out of place and the clone, read only by the backward, as a
    backward op; eager runs the clone in the forward and writes the result into the input's
    storage."""
    nodes = graph.trace.nodes
    out: dict[int, int] = {}
    for c in graph.backward_ops:
        clone = graph.ops[c]
        if clone.label != "aten.clone" or c + 1 >= len(graph.ops):
            continue
        op = graph.ops[c + 1]
        if (
            op.phase == "forward"
            and op.inputs[:1] == clone.inputs[:1]
            and len(op.outputs) == 1
            and nodes[op.nodes[0]].seq_nr == nodes[clone.nodes[0]].seq_nr
        ):
            out[c + 1] = c
    return out


@dataclass(frozen=True)
class Call:
    """One autograd node's backward as the engine calls it: `ops` in order, of which the
    first `formula` are the node's `apply` (its derivative formula) and the rest the
    engine's `validate_outputs` (a gradient summed to its input's broadcast shape)."""

    seq_nr: int
    ops: tuple[int, ...]
    formula: int
    stale: bool  # a gradient accumulated between nodes, labelled with an earlier node's


_VALIDATE = ("aten.sum",)  # what validate_outputs runs on a node's outputs: sum_to


def backward_calls(graph: Graph, skip: frozenset[int] = frozenset()) -> list[Call]:
    """The backward's node calls in order: each a stretch of consecutive backward ops with
    one sequence number (`skip`: ops the forward runs). A number seen before is stale (a
    node runs once)."""
    nodes = graph.trace.nodes
    stretches: list[tuple[int, list[int]]] = []
    for b in graph.backward_ops:
        if b in skip:
            continue
        seq = nodes[graph.ops[b].nodes[0]].seq_nr
        if not stretches or stretches[-1][0] != seq:
            stretches.append((seq, []))
        stretches[-1][1].append(b)
    seen: set[int] = set()
    calls = []
    for seq, ops in stretches:
        formula = len(ops)
        while formula > 1 and graph.ops[ops[formula - 1]].label in _VALIDATE:
            formula -= 1
        calls.append(Call(seq, tuple(ops), formula, seq in seen))
        seen.add(seq)
    return calls


def _forward(graph: Graph, value) -> bool:  # noqa: ANN001 - a core.graph.Value
    return graph.ops[value.producer].phase == "forward"


def _ops_in(region: Checkpointed, graph: Graph, forward_ops: list[int]) -> list[int]:
    """The graph ops the region runs: those whose allocating node is the module's (a view
    the module takes of an outer value allocates nothing, and is not recomputed)."""
    return [o for o in forward_ops if graph.ops[o].nodes[0] in region.nodes]


@dataclass(frozen=True)
class _Offloads:
    """Values the saved-tensor hooks move to the host and the link timing their copies."""

    values: frozenset[int]
    link: Link | None
    copied_back: Callable[[Call, int], int] | None = None

    def time(self, nbytes: int, to_host: bool) -> float:
        if self.link is None:
            return 0.0
        return nbytes / (self.link.d2h if to_host else self.link.h2d)


class _Builder:
    """Run positions, copies and each value's release position, then the program."""

    def __init__(
        self,
        graph: Graph,
        parts: list[_Region],
        owner: dict[int, int],
        calls: list[Call],
        dropped: dict[int, int],
        inplace: dict[int, int],
        forward_ops: list[int],
    ) -> None:
        self.graph, self.parts, self.owner, self.dropped = graph, parts, owner, dropped
        self.calls, self.inplace, self.forward_ops = calls, inplace, forward_ops
        self.aliases: list[tuple[int, int]] = []  # (storage's value, in-place result on it)
        self.ops: list[NativeOp] = [
            NativeOp(op.inputs, op.outputs, op.time, op.index) for op in graph.ops
        ]
        self.sizes, _, _ = step_values(graph)
        for o in inplace:  # the result is written into its input's storage
            base, result = graph.ops[o].inputs[0], graph.ops[o].outputs[0]
            self.sizes[result] = 0
            self.aliases.append((base, result))
        self.runs: list[int] = []  # native op per position
        self.release: dict[int, int] = {}  # value -> position after which it is freed
        self.recomputed = 0
        self.recompute_time = 0.0
        self.at: dict[int, int] = {}  # backward op -> its position
        self.casts = autocast_casts(graph)

    def _run(self, o: int) -> None:
        pos = len(self.runs)
        self.runs.append(o)
        op = self.ops[o]
        for v in op.inputs:
            if v in self.release:
                self.release[v] = max(self.release[v], pos)
        for v in op.outputs:
            self.release[v] = pos

    def _hold(self, v: int, pos: int) -> None:
        """`v` is held (by a frame or a cache) until after position `pos`."""
        if v in self.release:
            self.release[v] = max(self.release[v], pos)

    def build(self, offloads: _Offloads) -> NativeProgram:
        graph, parts = self.graph, self.parts
        at: dict[int, int] = {}
        for o in self.forward_ops:
            at[o] = len(self.runs)
            self._run(o)
            for v in graph.ops[o].outputs:
                if v in offloads.values:  # packed: copied to the host, autograd holds that
                    self._extra(NativeOp((v,), (), offloads.time(self.sizes[v], True), o))
        first = {call.ops[0]: call for call in self.calls}
        n_forward = len(self.runs)
        for o in self.casts:  # autocast's cache holds them until the forward's autocast exits
            for v in graph.ops[o].outputs:
                self._hold(v, n_forward - 1)
        for v, o in self.dropped.items():
            if o in at:
                self._hold(v, at[o])
        region_of_op = {o: r for r, p in enumerate(parts) for o in p.ops}
        last = {r: max(p.saving) for r, p in enumerate(parts) if p.saving}
        copies: dict[int, dict[int, int]] = {}
        death: dict[int, int] = {}  # region -> position after which its frame is gone
        for r, p in enumerate(parts):
            if not p.saving:  # nothing saved: the frame dies when the forward leaves it
                death[r] = max((at[o] for o in p.ops), default=-1)
        unpacked: dict[int, int] = {}  # offloaded value -> its copy back in this call
        clones = set(self.inplace.values())
        for b in graph.backward_ops:
            if b in clones:
                continue
            reg = self.owner.get(b)
            if reg is not None and reg not in copies and b in parts[reg].saving:
                # its inputs are unpacked from its parent first, which recomputes that one
                for r in self._lineage(reg):
                    if r not in copies:
                        copies[r] = self._recompute(r)
            if b in first:
                unpacked = self._unpack(first[b], offloads)
            op = graph.ops[b]
            if reg is not None and reg in copies:
                inputs = tuple(copies[reg].get(v, v) for v in op.inputs)
                self.ops[b] = NativeOp(inputs, op.outputs, op.time, b)
            elif unpacked:
                inputs = tuple(unpacked.get(v, v) for v in op.inputs)
                self.ops[b] = NativeOp(inputs, op.outputs, op.time, b)
            self._run(b)
            self.at[b] = len(self.runs) - 1
            if reg is not None and last.get(reg) == b:
                death[reg] = len(self.runs) - 1
        for r in sorted(range(len(parts)), key=lambda r: -len(self._lineage(r))):
            parent = parts[r].parent  # a nested region's frame holds its parent's (its inputs)
            if parent is not None:
                death[parent] = max(death[parent], death[r])
        for r, p in enumerate(parts):
            self._frame_holds(r, p, region_of_op, death[r])
        self._node_holds()
        for base, result in self.aliases:  # one storage: it lives while either does
            self._hold(base, self.release[result])
        return self._program(n_forward)

    def _lineage(self, r: int) -> list[int]:
        """Region `r` and the regions it runs inside, the outermost first."""
        out = [r]
        while self.parts[out[-1]].parent is not None:
            out.append(self.parts[out[-1]].parent)  # type: ignore[arg-type]
        return out[::-1]

    def _extra(self, op: NativeOp) -> None:
        """Run an op that is no graph op's run: a pack or an unpack of an offloaded value."""
        self.ops.append(op)
        self._run(len(self.ops) - 1)

    def _unpack(self, call: Call, offloads: _Offloads) -> dict[int, int]:
        """At the start of `call`, each offloaded value its ops read is copied back to a
        fresh device storage (one per call: the hooks share it while it lives)."""
        graph = self.graph
        out: dict[int, int] = {}
        for b in call.ops:
            for v in graph.ops[b].inputs:
                if v in offloads.values and v not in out:
                    nbytes = self.sizes[v]
                    if offloads.copied_back is not None:
                        nbytes = offloads.copied_back(call, v)
                        if not nbytes:
                            continue
                    out[v] = self._new_value(v)
                    self.sizes[out[v]] = nbytes
                    time = offloads.time(nbytes, False)
                    self._extra(NativeOp((), (out[v],), time, graph.values[v].producer or 0))
        return out

    def _node_holds(self) -> None:
        """A node's call holds what it reads: its incoming gradients and (outside every
        checkpoint) the saved tensors its node keeps until autograd releases them, until
        the call ends; a saved tensor unpacked from a checkpoint is a local of `apply`,
        dropped when the formula returns (before `validate_outputs`), as is what the
        formula makes and reads again. A stale call (gradients accumulated into a node's
        input buffer while the engine hands out the previous node's outputs) holds what
        that node read or made until it ends; the buffer's old sum goes as it is replaced.
        A parameter's gradient summed into its `.grad` is AccumulateGrad's own call: it
        holds nothing past the sum."""
        handed: set[int] = set()  # what the last node's call read or made
        into_grad = self._into_grad()
        for call in self.calls:
            made = {v for b in call.ops for v in self.ops[b].outputs}
            if not call.stale:
                handed = made | {v for b in call.ops for v in self.ops[b].inputs}
            end = self.at[call.ops[-1]]
            formula_end = self.at[call.ops[call.formula - 1]]
            formula_made = {v for b in call.ops[: call.formula] for v in self.ops[b].outputs}
            for k, b in enumerate(call.ops):
                if call.stale and b in into_grad:
                    continue
                region = b in self.owner
                for v in self.ops[b].inputs:
                    if v in formula_made and k < call.formula:
                        self._hold(v, formula_end)
                        continue
                    if v in made or (call.stale and v not in handed):
                        continue
                    local = v >= len(self.graph.values) or (region and self._forward_value(v))
                    self._hold(v, formula_end if local else end)

    def _into_grad(self) -> set[int]:
        """Backward ops of stale calls summing into a parameter's `.grad`: those making a
        parameter gradient, or a sum only such ops read (a parameter used three times)."""
        graph = self.graph
        stale = {b for call in self.calls if call.stale for b in call.ops}
        out: set[int] = set()
        for b in reversed(graph.backward_ops):
            if b not in stale:
                continue
            values = [graph.values[v] for v in graph.ops[b].outputs]
            if values and all(
                v.kind == "gradient" or (v.consumers and set(v.consumers) <= out) for v in values
            ):
                out.add(b)
        return out

    def _forward_value(self, v: int) -> bool:
        """A value the forward (or a recompute) made: a saved tensor, not a gradient."""
        if v >= len(self.graph.values):
            return True  # a recomputed copy
        value = self.graph.values[v]
        return value.producer is None or _forward(self.graph, value)

    def _recompute(self, r: int) -> dict[int, int]:
        """Re-run region `r`'s forward up to its last saving op; returns value -> copy."""
        part, graph = self.parts[r], self.graph
        copy: dict[int, int] = {}
        at: dict[int, int] = {}  # region op -> position of the last recompute run by then
        made: list[int] = []  # values the recompute hands Python (copies, cached results)
        for o in part.ops:
            if o > part.stop:
                break
            at[o] = len(self.runs) - 1
            if o in part.cached:
                made += graph.ops[o].outputs
                continue
            made += graph.ops[o].outputs
            at[o] = len(self.runs)
            op = graph.ops[o]
            outputs = []
            for v in op.outputs:
                copy[v] = self._new_value(v)
                outputs.append(copy[v])
            inputs = tuple(copy.get(v, v) for v in op.inputs)
            if o in self.inplace:
                self.aliases.append((inputs[0], outputs[0]))
            self.ops.append(NativeOp(inputs, tuple(outputs), op.time, o))
            self._run(len(self.ops) - 1)
            self.recomputed += 1
            self.recompute_time += op.time
        end = len(self.runs) - 1  # the recompute stops: Python drops what it still holds
        for o in self.casts.intersection(part.ops):  # cached until the recompute's autocast exits
            for v in graph.ops[o].outputs:
                self._hold(copy.get(v, v), end)
        drops = self.dropped if part.replay_drops is None else part.replay_drops
        for v in made:
            drop = drops.get(v)
            self._hold(copy.get(v, v), at.get(drop, end) if drop is not None else -1)
        return copy

    def _new_value(self, v: int) -> int:
        new = max(self.sizes) + 1
        self.sizes[new] = self.sizes.get(v, 0)
        return new

    def _frame_holds(self, r: int, part: _Region, region_of_op: dict[int, int], end: int) -> None:
        """Region `r`'s frame holds the values its module was called with and the outer
        values its ops read, and its cache the results of cached ops the recompute never
        reached, until the frame dies (after position `end`)."""
        graph = self.graph
        mine = set(part.ops)
        for v in part.inputs:
            self._hold(v, end)
        for o in part.ops:
            for v in graph.ops[o].inputs:
                producer = graph.values[v].producer
                if producer is not None and producer not in mine:
                    self._hold(v, end)
            if o in part.cached and o > part.stop:
                for v in graph.ops[o].outputs:
                    self._hold(v, end)

    def _program(self, n_forward: int) -> NativeProgram:
        graph = self.graph
        final = graph.final_values
        frees: dict[int, list[int]] = {}
        for v, pos in self.release.items():
            if v not in final:
                frees.setdefault(pos, []).append(v)
        tangents = [v.index for v in graph.values if v.kind == "tangent"]
        reads = {v: n_forward for v in tangents}
        for pos in range(n_forward, len(self.runs)):
            for v in self.ops[self.runs[pos]].inputs:
                if v in reads:
                    reads[v] = pos
        for v, pos in reads.items():
            frees.setdefault(pos, []).append(v)
        program: list[Instruction] = []
        start = 0
        for pos, o in enumerate(self.runs):
            if pos == n_forward:
                start = len(program)
            program.append((RUN, o))
            program += [(FREE, v) for v in sorted(frees.get(pos, ()))]
        return NativeProgram(
            tuple(self.ops),
            tuple(program),
            start,
            self.sizes,
            self.recomputed,
            self.recompute_time,
        )
