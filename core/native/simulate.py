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

import bisect
import weakref
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
    """An op of the native program: a graph op, or a recompute of one (its outputs copies),
    or a transient: a forward op whose results nothing reads, which eager runs anyway
    (`core.graph.Transient`; its source the graph op it follows), its results freed where
    the model's Python lets them go."""

    inputs: tuple[int, ...]
    outputs: tuple[int, ...]
    time: float
    source: int  # the graph op it runs (a transient: the one it runs after)
    transient: bool = False


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
        facts = graph_facts(graph)
        return walk(
            self.ops,
            self.program,
            self.backward_start,
            self.sizes,
            facts.initial,
            facts.arriving,
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
    facts = graph_facts(graph)
    op_of = facts.op_of
    depth = _depths(regions)
    region_of_node = {  # the innermost region running a node: its saved tensors are that one's
        n: r for r in sorted(range(len(regions)), key=depth.__getitem__) for n in regions[r].nodes
    }
    parts = [
        _Region(
            _ops_in(reg, facts),
            reg.cached,
            reg.inputs,
            set(),
            -1,
            reg.replay_drops,
            reg.parent,
        )
        for reg in regions
    ]
    owner: dict[int, int] = {}  # backward op -> region of its node
    node_of: dict[int, int] = {}  # backward op -> the forward node that made its node
    saving: set[int] = set()  # forward nodes that made a node saving a tensor
    own: set[int] = set()  # ... saving one of its own op's results, not only its inputs
    for call, made, saves, saves_own in facts.makers:
        r = region_of_node.get(made) if made is not None else None
        if r is None or made is None:
            continue
        for b in call.ops:
            owner[b], node_of[b] = r, made
        if saves:
            saving.add(made)
        if saves_own:
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
    builder = _Builder(graph, facts, parts, owner, dropped or {})
    return builder.build(_Offloads(offloaded, link, copied_back))


@dataclass(frozen=True)
class GraphFacts:
    """What every native program of a graph needs of the graph alone, found once per graph
    (`graph_facts`): the cut search builds thousands of programs of one graph. Op times are
    checked against the graph's at each build (a graph is timed as it is analysed)."""

    op_of: dict[int, int]  # traced node -> the graph op running it
    inplace: dict[int, int]  # `in_place_ops`
    clones: frozenset[int]  # the clones of `inplace`: ops the forward runs
    forward_ops: tuple[int, ...]  # the forward's ops, clones included, in order
    # the forward's runs: `forward_ops` with the transients (native ops past the graph's,
    # `ops`) each after the op it follows; and op -> the transients right after it
    forward_runs: tuple[int, ...]
    after: dict[int, tuple[int, ...]]
    starting: dict[int, tuple[int, ...]]  # node -> the ops of `forward_ops` it allocates in
    calls: tuple[Call, ...]  # `backward_calls`, clones skipped
    # each call, the forward node that made its node (None: stale, or no module's), whether
    # the node saves a tensor, and whether one of its own op's results
    makers: tuple[tuple[Call, int | None, bool, bool], ...]
    first: dict[int, Call]  # a call's first op -> the call
    backward_runs: tuple[int, ...]  # the backward's ops, clones skipped, in order
    made: tuple[frozenset[int], ...]  # per call: what its ops make
    formula_made: tuple[frozenset[int], ...]  # ... what its formula's ops make
    into_grad: frozenset[int]  # `_into_grad`
    casts: frozenset[int]  # `autocast_casts`
    sizes: dict[int, int]  # `step_values`' sizes, an in-place result's 0 (copied per build)
    aliases: tuple[tuple[int, int], ...]  # (input's storage, in-place result written into it)
    initial: tuple[int, ...]  # `step_values`' initial values
    arriving: tuple[int, ...]  # ... and arriving ones (the tangents)
    tangent_readers: dict[int, tuple[int, ...]]  # tangent -> the backward runs reading it
    forward_value: tuple[bool, ...]  # per graph value: made by the forward (or a placeholder)
    producer: tuple[int | None, ...]  # per graph value: the op making it
    ops: tuple[NativeOp, ...]  # the graph's ops as native ops, timed by `times`, then transients
    times: list[float]
    # the forward's ops run in order (no offloads): each one's position, and each value's
    # release position after them (`_Builder._run`)
    forward_at: dict[int, int]
    forward_release: dict[int, int]


_FACTS: weakref.WeakKeyDictionary[Graph, GraphFacts] = weakref.WeakKeyDictionary()


def graph_facts(graph: Graph) -> GraphFacts:
    """The graph's `GraphFacts`, memoised per graph (by identity; the memo goes with it)."""
    facts = _FACTS.get(graph)
    if facts is None:
        facts = _FACTS[graph] = _facts(graph)
    return facts


def _facts(graph: Graph) -> GraphFacts:
    """The graph's `GraphFacts`, from its ops, values and trace."""
    nodes = graph.trace.nodes
    op_of = {n: op.index for op in graph.ops for n in op.nodes}
    inplace = in_place_ops(graph)
    clones = frozenset(inplace.values())
    forward_ops = tuple(sorted((*graph.forward_ops, *clones)))
    maker: dict[int, int] = {}  # seq_nr -> the forward node that made that autograd node
    for n in nodes:
        if n.role == "op" and n.module is not None and op_of.get(n.index) not in clones:
            maker.setdefault(n.seq_nr, n.index)
    existing = {
        v.index
        for v in graph.values
        if v.producer is None or _forward(graph, v) or v.producer in clones
    }
    arriving = {v.index for v in graph.values if v.kind == "tangent"}
    calls = tuple(backward_calls(graph, clones))
    makers = []
    for call in calls:
        made = maker.get(call.seq_nr) if not call.stale else None
        results = (
            set(graph.ops[op_of[made]].outputs) if made is not None and made in op_of else set()
        )
        saves = saves_own = False
        for b in call.ops:
            read = [v for v in graph.ops[b].inputs if v in existing and v not in arriving]
            saves = saves or bool(read)
            saves_own = saves_own or bool(results.intersection(read))
        makers.append((call, made, saves, saves_own))
    sizes, initial, tangents = step_values(graph)
    aliases = []
    for o in inplace:  # the result is written into its input's storage
        base, result = graph.ops[o].inputs[0], graph.ops[o].outputs[0]
        sizes[result] = 0
        aliases.append((base, result))
    backward_runs = tuple(b for b in graph.backward_ops if b not in clones)
    readers: dict[int, list[int]] = {v: [] for v in tangents}
    for b in backward_runs:
        for v in graph.ops[b].inputs:
            if v in readers:
                readers[v].append(b)
    starting: dict[int, tuple[int, ...]] = {}
    for o in forward_ops:
        starting[graph.ops[o].nodes[0]] = (*starting.get(graph.ops[o].nodes[0], ()), o)
    ops = [NativeOp(op.inputs, op.outputs, op.time, op.index) for op in graph.ops]
    after, forward_runs = _transients(graph, forward_ops, ops)
    release: dict[int, int] = {}
    for pos, o in enumerate(forward_runs):
        for v in ops[o].inputs:
            if v in release:
                release[v] = pos
        for v in ops[o].outputs:
            release[v] = pos
    return GraphFacts(
        op_of=op_of,
        inplace=inplace,
        clones=clones,
        forward_ops=forward_ops,
        forward_runs=forward_runs,
        after=after,
        starting=starting,
        calls=calls,
        makers=tuple(makers),
        first={call.ops[0]: call for call in calls},
        backward_runs=backward_runs,
        made=tuple(frozenset(v for b in c.ops for v in graph.ops[b].outputs) for c in calls),
        formula_made=tuple(
            frozenset(v for b in c.ops[: c.formula] for v in graph.ops[b].outputs) for c in calls
        ),
        into_grad=frozenset(_into_grad(graph, calls)),
        casts=frozenset(autocast_casts(graph)),
        sizes=sizes,
        aliases=tuple(aliases),
        initial=tuple(initial),
        arriving=tuple(tangents),
        tangent_readers={v: tuple(bs) for v, bs in readers.items()},
        forward_value=tuple(v.producer is None or _forward(graph, v) for v in graph.values),
        producer=tuple(v.producer for v in graph.values),
        ops=tuple(ops),
        times=[op.time for op in graph.ops],
        forward_at={o: pos for pos, o in enumerate(forward_runs)},
        forward_release=release,
    )


def _transients(
    graph: Graph, forward_ops: Sequence[int], ops: list[NativeOp]
) -> tuple[dict[int, tuple[int, ...]], tuple[int, ...]]:
    """The graph's transients as native ops appended to `ops`, each after the forward op
    that starts last before it in the trace: (op -> its transients, the forward's runs)."""
    firsts = sorted((graph.ops[o].nodes[0], o) for o in forward_ops)
    starts = [n for n, _ in firsts]
    after: dict[int, list[int]] = {}
    for t in graph.transients:
        k = bisect.bisect_left(starts, t.node) - 1
        prev = firsts[k][1] if k >= 0 else -1  # -1: before every forward op
        after.setdefault(prev, []).append(len(ops))
        ops.append(NativeOp((), t.outputs, 0.0, max(prev, 0), transient=True))
    runs = list(after.get(-1, ()))
    for o in forward_ops:
        runs.append(o)
        runs.extend(after.get(o, ()))
    return {o: tuple(ts) for o, ts in after.items()}, tuple(runs)


def _into_grad(graph: Graph, calls: Sequence[Call]) -> set[int]:
    """Backward ops of stale calls summing into a parameter's `.grad`: those making a
    parameter gradient, or a sum only such ops read (a parameter used three times)."""
    stale = {b for call in calls if call.stale for b in call.ops}
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


def _ops_in(region: Checkpointed, facts: GraphFacts) -> list[int]:
    """The graph ops the region runs: those whose allocating node is the module's (a view
    the module takes of an outer value allocates nothing, and is not recomputed)."""
    starting = facts.starting
    return sorted(o for n in region.nodes if n in starting for o in starting[n])


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
        facts: GraphFacts,
        parts: list[_Region],
        owner: dict[int, int],
        dropped: dict[int, int],
    ) -> None:
        self.graph, self.facts, self.parts, self.owner = graph, facts, parts, owner
        self.dropped, self.calls, self.inplace = dropped, facts.calls, facts.inplace
        # (storage's value, in-place result on it)
        self.aliases: list[tuple[int, int]] = list(facts.aliases)
        times = [op.time for op in graph.ops]
        self.ops: list[NativeOp] = (
            list(facts.ops)
            if times == facts.times  # (a graph's op times are set as it is analysed)
            else [NativeOp(op.inputs, op.outputs, op.time, op.index) for op in graph.ops]
            + list(facts.ops[len(graph.ops) :])
        )
        self.sizes = dict(facts.sizes)
        self.next_value = max(self.sizes) + 1  # the number a new value (a copy) takes
        self.runs: list[int] = []  # native op per position
        self.release: dict[int, int] = {}  # value -> position after which it is freed
        self.recomputed = 0
        self.recompute_time = 0.0
        self.at: dict[int, int] = {}  # backward op -> its position
        self.casts = facts.casts

    def _run(self, o: int) -> None:
        op = self.ops[o]
        self._ran(o, op.inputs, op.outputs)

    def _ran(self, o: int, inputs: tuple[int, ...], outputs: tuple[int, ...]) -> int:
        """Native op `o`, reading `inputs` and making `outputs`, runs next: its position,
        where its outputs are released unless held, and its inputs at the latest."""
        pos = len(self.runs)
        self.runs.append(o)
        release = self.release
        for v in inputs:
            held = release.get(v)
            if held is not None and held < pos:
                release[v] = pos
        for v in outputs:
            release[v] = pos
        return pos

    def _hold(self, v: int, pos: int) -> None:
        """`v` is held (by a frame or a cache) until after position `pos`."""
        held = self.release.get(v)
        if held is not None and held < pos:
            self.release[v] = pos

    def build(self, offloads: _Offloads) -> NativeProgram:
        graph, parts, facts = self.graph, self.parts, self.facts
        at: dict[int, int] = {}  # forward op -> its position
        if offloads.values:
            for o in facts.forward_runs:
                at[o] = len(self.runs)
                self._run(o)
                for v in self.ops[o].outputs:
                    if v in offloads.values:  # packed: copied to the host, autograd holds that
                        self._extra(NativeOp((v,), (), offloads.time(self.sizes[v], True), o))
        else:  # the forward's ops alone, run as `_run` does: the same for every program
            at = facts.forward_at
            self.runs = list(facts.forward_runs)
            self.release = dict(facts.forward_release)
        first = facts.first
        n_forward = len(self.runs)
        for o in self.casts:  # autocast's cache holds them until the forward's autocast exits
            for v in graph.ops[o].outputs:
                self._hold(v, n_forward - 1)
        for v, o in self.dropped.items():
            if o in at:
                self._hold(v, at[o])
        last = {r: max(p.saving) for r, p in enumerate(parts) if p.saving}
        copies: dict[int, dict[int, int]] = {}
        death: dict[int, int] = {}  # region -> position after which its frame is gone
        for r, p in enumerate(parts):
            if not p.saving:  # nothing saved: the frame dies when the forward leaves it
                death[r] = max((at[o] for o in p.ops), default=-1)
        unpacked: dict[int, int] = {}  # offloaded value -> its copy back in this call
        owner, ops, positions = self.owner, self.ops, self.at
        for b in facts.backward_runs:
            reg = owner.get(b)
            if reg is not None and reg not in copies and b in parts[reg].saving:
                # its inputs are unpacked from its parent first, which recomputes that one
                for r in self._lineage(reg):
                    if r not in copies:
                        copies[r] = self._recompute(r)
            if b in first:
                unpacked = self._unpack(first[b], offloads)
            op = graph.ops[b]
            inputs = op.inputs
            if reg is not None and reg in copies:
                copy = copies[reg]
                inputs = tuple(copy.get(v, v) for v in op.inputs)
                ops[b] = NativeOp(inputs, op.outputs, op.time, b)
            elif unpacked:
                inputs = tuple(unpacked.get(v, v) for v in op.inputs)
                ops[b] = NativeOp(inputs, op.outputs, op.time, b)
            pos = positions[b] = self._ran(b, inputs, op.outputs)
            if reg is not None and last.get(reg) == b:
                death[reg] = pos
        for r in sorted(range(len(parts)), key=lambda r: -len(self._lineage(r))):
            parent = parts[r].parent  # a nested region's frame holds its parent's (its inputs)
            if parent is not None:
                death[parent] = max(death[parent], death[r])
        for r, p in enumerate(parts):
            self._frame_holds(p, death[r])
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
        out: dict[int, int] = {}
        if not offloads.values:
            return out
        graph = self.graph
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
        facts = self.facts
        handed: set[int] | frozenset[int] = set()  # what the last node's call read or made
        into_grad, owner, ops, at = facts.into_grad, self.owner, self.ops, self.at
        forward_value, n_values = facts.forward_value, len(facts.forward_value)
        release = self.release
        for call, made, formula_made in zip(self.calls, facts.made, facts.formula_made):
            stale = call.stale
            if not stale:
                handed = made.union(*(ops[b].inputs for b in call.ops))
            end = at[call.ops[-1]]
            formula_end = at[call.ops[call.formula - 1]]
            for k, b in enumerate(call.ops):
                if stale and b in into_grad:
                    continue
                region = b in owner
                in_formula = k < call.formula
                for v in ops[b].inputs:
                    if in_formula and v in formula_made:
                        pos = formula_end
                    elif v in made or (stale and v not in handed):
                        continue
                    elif v >= n_values or (region and forward_value[v]):
                        pos = formula_end
                    else:
                        pos = end
                    held = release.get(v)
                    if held is not None and held < pos:
                        release[v] = pos

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
                if o < part.stop:  # eager's recompute passes the dead ops after it too
                    made += self._transients_after(o, copy)
                continue
            made += graph.ops[o].outputs
            op = graph.ops[o]
            outputs = []
            for v in op.outputs:
                copy[v] = self._new_value(v)
                outputs.append(copy[v])
            inputs = tuple(copy.get(v, v) for v in op.inputs)
            if o in self.inplace:
                self.aliases.append((inputs[0], outputs[0]))
            self.ops.append(NativeOp(inputs, tuple(outputs), op.time, o))
            at[o] = self._ran(len(self.ops) - 1, inputs, tuple(outputs))
            self.recomputed += 1
            self.recompute_time += op.time
            if o < part.stop:
                made += self._transients_after(o, copy)
        end = len(self.runs) - 1  # the recompute stops: Python drops what it still holds
        for o in self.casts.intersection(part.ops):  # cached until the recompute's autocast exits
            for v in graph.ops[o].outputs:
                self._hold(copy.get(v, v), end)
        drops = self.dropped if part.replay_drops is None else part.replay_drops
        for v in made:
            drop = drops.get(v)
            self._hold(copy.get(v, v), at.get(drop, end) if drop is not None else -1)
        return copy

    def _transients_after(self, o: int, copy: dict[int, int]) -> list[int]:
        """The recompute runs the transients that follow op `o`, into fresh values (`copy`
        maps each transient value to its own), released as the forward's are; returns the
        transient values."""
        made: list[int] = []
        for t in self.facts.after.get(o, ()):
            for v in self.ops[t].outputs:
                copy[v] = self._new_value(v)
                made.append(v)
            outputs = tuple(copy[v] for v in self.ops[t].outputs)
            self.ops.append(NativeOp((), outputs, 0.0, o, transient=True))
            self._ran(len(self.ops) - 1, (), outputs)
        return made

    def _new_value(self, v: int) -> int:
        new = self.next_value
        self.next_value += 1
        self.sizes[new] = self.sizes.get(v, 0)
        return new

    def _frame_holds(self, part: _Region, end: int) -> None:
        """A region's frame holds the values its module was called with and the outer
        values its ops read, and its cache the results of cached ops the recompute never
        reached, until the frame dies (after position `end`)."""
        graph, producer = self.graph, self.facts.producer
        mine = set(part.ops)
        for v in part.inputs:
            self._hold(v, end)
        for o in part.ops:
            for v in graph.ops[o].inputs:
                made_by = producer[v]
                if made_by is not None and made_by not in mine:
                    self._hold(v, end)
            if o in part.cached and o > part.stop:
                for v in graph.ops[o].outputs:
                    self._hold(v, end)

    def _program(self, n_forward: int) -> NativeProgram:
        final = self.graph.final_values
        frees: dict[int, list[int]] = {}
        for v, pos in self.release.items():
            if v not in final:
                frees.setdefault(pos, []).append(v)
        # a tangent goes after its last read: only the graph's backward ops read one
        for v, readers in self.facts.tangent_readers.items():
            pos = max((self.at[b] for b in readers), default=n_forward)
            frees.setdefault(pos, []).append(v)
        program: list[Instruction] = []
        start = 0
        for pos, o in enumerate(self.runs):
            if pos == n_forward:
                start = len(program)
            program.append((RUN, o))
            freed = frees.get(pos)
            if freed:
                freed.sort()
                program.extend([(FREE, v) for v in freed])
        return NativeProgram(
            tuple(self.ops),
            tuple(program),
            start,
            self.sizes,
            self.recomputed,
            self.recompute_time,
        )
