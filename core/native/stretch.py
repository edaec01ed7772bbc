"""Regions that are no submodule: stretches of a parent's forward run under checkpoint.

A block the plan recomputes in, but whose forward no submodule runs exactly (root-level
code, `ModuleDict` blocks called from the root, a U-Net's skips), is covered by stretches:
runs of consecutive forward ops between two moments where the model calls or returns from
a submodule (`core.native.boundaries`). Each stretch runs under non-reentrant checkpoint
with the same selective policy as a submodule region (an op whose result the plan keeps
through the forward is saved, every other recomputed), and its recompute replays the ATen
ops the forward ran (`core.native.replay`), since the stretch is no function to call again.

Where to cut a block into stretches: at its ends, and inside it wherever the activations
the forward carries across, and the plan frees, weigh little: the next stretch's frame
holds them to its backward, but each recompute is shorter (it runs once, at the first
unpack, and holds what it made until used). Cuts at several weights are simulated;
`core.native.lowering.lower` keeps the one with the lowest native peak.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, replace

import torch
from torch.utils.checkpoint import SAC_IGNORED_OPS

from core.native.boundaries import Boundaries, Boundary, boundaries
from core.native.simulate import graph_facts
from core.problem import Problem, per_problem

# cut weights tried inside blocks: 0, then this many quantiles of the weights seen (8: the
# native minimum of gpt-tiny 37.0% of store-all, 4: 38.6%; mixer-tiny, unet-tiny the same)
QUANTILES = 8
# and stretches running this many consecutive blocks (mlp-batch: one layer per stretch
# saves nothing, a Linear-ReLU layer's input being what its ReLU saves anyway)
GROUPS = (2, 3, 4)


@dataclass(frozen=True)
class Stretch:
    """A region that is a stretch of the forward: it begins at moment `start` and ends at
    moment `end` (`core.native.boundaries`); `label` names it for people and errors. Its
    ops, saves and nodes are a `core.native.lowering.Region`'s (its `module` the label)."""

    start: Boundary
    end: Boundary
    nodes: tuple[int, ...]  # the traced forward nodes it runs, in order
    ops: tuple[object, ...]  # ATen OpOverloads its policy sees, in order
    save: tuple[bool, ...]
    policy_nodes: tuple[int, ...]  # the traced node of each policy op
    cached: frozenset[int]  # graph ops whose results the policy saves
    replay_drops: tuple[tuple[int, int], ...]  # value -> graph op after which the replay drops it
    # the stretch it runs inside (an index into its cover's stretches, listed before it), or
    # None: a nested stretch begins where its parent does (`Cover.nests`)
    parent: int | None = None

    @property
    def label(self) -> str:
        return f"{_moment(self.start)} .. {_moment(self.end)}"


def _moment(b: Boundary) -> str:
    return f"the step's {b.hook}" if not b.module else f"{b.module} ({b.hook}, call {b.call})"


@dataclass(frozen=True)
class Cover:
    """The stretches covering the blocks no submodule runs, and the blocks left whole."""

    stretches: tuple[Stretch, ...]
    whole: tuple[int, ...]  # blocks the plan recomputes in that no stretch covers
    cuts: frozenset[int] = frozenset()  # the places it was cut at
    # places where a stretch nested in another ends: it begins where the enclosing one does
    nests: frozenset[int] = frozenset()


def covers(
    problem: Problem,
    blocks: list[int],
    kept: set[int],
    recomputed: set[int],
    taken: list[tuple[int, int]],
    loose: bool = False,
) -> list[Cover]:
    """Candidate stretch covers of `blocks` (block indices): the coarse one (a stretch per
    block, snapped outward to moments) and covers also cut inside the blocks
    wherever the activations the forward carries across, and the plan frees, weigh at most
    a threshold (0: only kept values cross; then the quartiles of those weights, up to a
    cut at every moment). `kept`: values the plan keeps through the forward; `recomputed`:
    graph ops it runs again; `taken`: places [start, end) of submodule regions, which no
    stretch may overlap. With `loose`, at loose moments too (`Boundaries.loose`)."""
    if not blocks:
        return [Cover((), ())]
    cutting = Cutting.of(problem, blocks, kept, recomputed, taken, loose)
    spans = cutting.spans
    ends: set[int] = set()
    for _, start, end in spans:
        if start is not None and end is not None:
            ends |= {start, end}
    weight = _cut_weights(problem, cutting.bnd, kept, cutting.allowed)
    inner = {
        p: w
        for p, w in weight.items()
        if any(st is not None and en is not None and st < p < en for _, st, en in spans)
    }
    thresholds: list[float] = [-1.0]
    if inner:
        ranked = sorted(set(inner.values()))
        thresholds += sorted(
            {
                ranked[min(len(ranked) - 1, k * len(ranked) // QUANTILES)]
                for k in range(QUANTILES + 1)
            }
        )
        thresholds.append(ranked[-1])
    out = []
    for t in dict.fromkeys(thresholds):
        out.append(cutting.cover(ends | {p for p, w in inner.items() if w <= t}))
    for group in GROUPS:  # consecutive blocks as one stretch: only its first input is held
        merged = _merged(spans, group)
        if len(merged) < len(spans):
            cuts = {
                p for _, st, en in merged if st is not None and en is not None for p in (st, en)
            }
            out.append(cutting.cover(cuts, merged))
    return out


@dataclass(frozen=True, eq=False)
class Cutting:
    """What covering some blocks with stretches needs, found once: the moments, each
    block's span (snapped outward to moments; None where no moment is), and the places
    where a stretch may begin or end (`places`: those within a span). `cover(cuts)` is the
    cover cut at `cuts`, so a search can price any set of cuts."""

    problem: Problem
    bnd: Boundaries
    spans: tuple[tuple[int, int | None, int | None], ...]  # (block, start, end)
    first_at: dict[int, Boundary]
    allowed: tuple[int, ...]  # places of moments outside every submodule region
    kept: frozenset[int]
    recomputed: frozenset[int]
    taken: tuple[tuple[int, int], ...]
    op_of: dict[int, int]
    # what `cover` found of each stretch it priced, as a search prices covers differing in
    # a cut or two: (start, end) -> the graph ops of the stretch, None where it cannot be
    # one; (start, end, end of the stretch nested in it or None) -> the stretch
    pieces: dict[tuple[int, int], frozenset[int] | None] = field(default_factory=dict, repr=False)
    made: dict[tuple[int, int, int | None], Stretch] = field(default_factory=dict, repr=False)

    @staticmethod
    def of(
        problem: Problem,
        blocks: list[int],
        kept: set[int],
        recomputed: set[int],
        taken: list[tuple[int, int]],
        loose: bool = False,
    ) -> Cutting:
        """The cutting of `blocks` under a plan keeping `kept` and recomputing `recomputed`,
        around submodule regions at places `taken`; with `loose`, at the boundaries' loose
        moments too (`Boundaries.loose`)."""
        bnd = boundaries(problem)
        graph = problem.graph
        place_of = {n: i for i, n in enumerate(bnd.nodes)}
        op_of = {n: op.index for op in graph.ops for n in op.nodes}
        first_at: dict[int, Boundary] = {}
        for moment in (*bnd.moments, *(bnd.loose if loose else ())):
            first_at.setdefault(moment.place, moment)
        inside = {p for s, e in taken for p in range(s + 1, e)}
        allowed = sorted(p for p in first_at if p not in inside)
        spans: list[tuple[int, int | None, int | None]] = []
        for b in blocks:
            places = [
                place_of[n]
                for o in problem.blocks[b].forward_ops
                for n in graph.ops[o].nodes
                if n in place_of
            ]
            if not places:  # no op of its own in the forward's places
                spans.append((b, None, None))
                continue
            lo, hi = min(places), max(places) + 1
            start = max((p for p in allowed if p <= lo), default=None)
            end = min((p for p in allowed if p >= hi), default=None)
            spans.append((b, start, end))
        return Cutting(
            problem,
            bnd,
            tuple(spans),
            first_at,
            tuple(allowed),
            frozenset(kept),
            frozenset(recomputed),
            tuple(taken),
            op_of,
        )

    @property
    def joined(self) -> tuple[tuple[int, int | None, int | None], ...]:
        """The spans with overlapping or adjacent ones made one: a stretch cut within them
        may run across blocks."""
        out: list[tuple[int, int | None, int | None]] = []
        whole = sorted((st, en, b) for b, st, en in self.spans if st is not None and en is not None)
        for st, en, b in whole:
            last = out[-1] if out else None
            if last is not None and last[2] is not None and st <= last[2]:
                out[-1] = (last[0], last[1], max(en, last[2]))
            else:
                out.append((b, st, en))
        return tuple(out)

    @property
    def places(self) -> tuple[int, ...]:
        """The places a stretch may begin or end at within the blocks' spans."""
        return tuple(
            p
            for p in self.allowed
            if any(st is not None and en is not None and st <= p <= en for _, st, en in self.spans)
        )

    def cover(
        self,
        cuts: set[int] | frozenset[int],
        spans: Sequence[tuple[int, int | None, int | None]] | None = None,
        nests: frozenset[int] = frozenset(),
    ) -> Cover:
        """The cover cut at `cuts` (places), within `spans` (default: the blocks'), with a
        stretch nested in the one around each place of `nests` that is no cut, from that
        one's beginning to there."""
        return _cover(
            self, sorted(cuts), list(self.spans if spans is None else spans), nests - set(cuts)
        )


def _merged(
    spans: Sequence[tuple[int, int | None, int | None]], group: int
) -> list[tuple[int, int | None, int | None]]:
    """`spans` with runs of up to `group` adjacent ones (each ending where the next begins)
    made one."""
    out: list[tuple[int, int | None, int | None]] = []
    size = 0
    for b, st, en in spans:
        last = out[-1] if out else None
        if last is not None and last[2] is not None and last[2] == st and size < group:
            out[-1] = (last[0], last[1], en)
            size += 1
        else:
            out.append((b, st, en))
            size = 1
    return out


def _cut_weights(
    problem: Problem, bnd: Boundaries, kept: set[int], cuts: Sequence[int]
) -> dict[int, int]:
    """For each place, the bytes of the activations made before it and read by the forward
    after it that the plan does not keep (what a stretch beginning there would hold)."""
    graph = problem.graph
    place_of = {n: i for i, n in enumerate(bnd.nodes)}
    made_at: dict[int, int] = {}
    last_read: dict[int, int] = {}
    for o in graph.forward_ops:
        op = graph.ops[o]
        p = place_of.get(op.nodes[0])
        if p is None:
            continue
        for v in op.outputs:
            made_at[v] = p
        for v in op.inputs:
            last_read[v] = max(last_read.get(v, -1), max(place_of.get(n, p) for n in op.nodes))
    crossing = [
        (made_at[v], last_read[v], graph.values[v].nbytes)
        for v in made_at
        if v in last_read and v not in kept
    ]
    return {p: sum(size for m, r, size in crossing if m < p <= r) for p in cuts}


def _cover(
    cutting: Cutting,
    cuts: list[int],
    spans: list[tuple[int, int | None, int | None]],
    nests: frozenset[int] = frozenset(),
) -> Cover:
    """The stretches between consecutive `cuts` that hold an op the plan recomputes, lie in
    a block's span and write nothing made before them (a replay would write it again); in
    each, from its beginning to each place of `nests` inside it, a nested stretch (one
    holding an op the plan recomputes), each inside the next longer one."""
    problem, bnd, op_of = cutting.problem, cutting.bnd, cutting.op_of
    recomputed = cutting.recomputed
    covered: set[int] = set()
    out: list[Stretch] = []
    for s, e in zip(cuts, cuts[1:], strict=False):
        if not any(
            st is not None and en is not None and st <= s and e <= en for _, st, en in spans
        ):
            continue
        if (s, e) not in cutting.pieces:
            cutting.pieces[s, e] = _piece(cutting, s, e)
        ops = cutting.pieces[s, e]
        if ops is None:
            continue
        ends = [e] + [
            m
            for m in sorted(nests, reverse=True)
            if s < m < e and {op_of[n] for n in bnd.nodes[s:m] if n in op_of} & recomputed
        ]
        parent: int | None = None
        for k, m in enumerate(ends):
            inner_end = ends[k + 1] if k + 1 < len(ends) else None
            made = cutting.made.get((s, m, inner_end))
            if made is None:
                inner = bnd.nodes[s:inner_end] if inner_end is not None else ()
                made = cutting.made[s, m, inner_end] = _stretch(
                    problem,
                    cutting.first_at[s],
                    cutting.first_at[m],
                    bnd.nodes[s:m],
                    cutting.kept,
                    op_of,
                    inner,
                )
            out.append(made if parent is None else replace(made, parent=parent))
            parent = len(out) - 1
        covered |= ops
    whole = tuple(
        b
        for b, _, _ in spans
        if set(problem.blocks[b].forward_ops) & recomputed - covered
        and not set(problem.blocks[b].forward_ops) & covered
    )
    return Cover(tuple(out), whole, frozenset(cuts), nests)


def _piece(cutting: Cutting, s: int, e: int) -> frozenset[int] | None:
    """The graph ops of the stretch from place `s` to `e`, or None where it overlaps a
    submodule region, holds an op eager ran otherwise than traced (its policy would
    refuse), recomputes nothing, or writes outside itself (`_writes_outside`)."""
    bnd, op_of = cutting.bnd, cutting.op_of
    if any(s < ts < e or s < te < e or (ts <= s and e <= te) for ts, te in cutting.taken):
        return None
    if any(s <= p < e for p in bnd.unmatched):
        return None
    stretch_nodes = bnd.nodes[s:e]
    ops = frozenset(op_of[n] for n in stretch_nodes if n in op_of)
    inplace = graph_facts(cutting.problem.graph).inplace
    if not ops & cutting.recomputed or _writes_outside(
        cutting.problem, stretch_nodes, inplace, op_of
    ):
        return None
    return ops


def _writes_outside(
    problem: Problem, stretch: tuple[int, ...], inplace: dict[int, int], op_of: dict[int, int]
) -> bool:
    """Whether an op of the stretch writes into a tensor made before it (other than a
    buffer: the replay writes those into scratch), or is an activation eager runs in place
    (`SiLU(inplace=True)`, timm's `BatchNormAct2d`): eager dispatches it in place where the
    trace has a clone and the op out of place, so the stretch's ops would not match."""
    nodes = problem.graph.trace.nodes
    mine = set(stretch)
    for n in stretch:
        for w in nodes[n].writes:
            if w not in mine and nodes[w].role != "state":
                return True
        if op_of.get(n) in inplace:  # eager runs it in place, the trace out of place
            return True
    return False


def _stretch(
    problem: Problem,
    start: Boundary,
    end: Boundary,
    stretch: tuple[int, ...],
    kept: set[int] | frozenset[int],
    op_of: dict[int, int],
    inner: Sequence[int] = (),
) -> Stretch:
    """The stretch's policy ops and saves (as a submodule region's: an op is saved when
    the plan keeps one of its results through the forward; a random op only when every
    later random op of the stretch is; none of the `inner` nodes, a stretch nested in it,
    which saves its own) and when its replay drops each value."""
    graph = problem.graph
    nodes = graph.trace.nodes
    order, save = save_mask(
        problem, stretch, kept, op_of, frozenset(op_of[n] for n in inner if n in op_of)
    )
    cached = frozenset(op_of[n] for n, s in zip(order, save, strict=True) if s and n in op_of)
    mine = set(stretch)
    region_ops = [o for o in sorted(set(op_of[n] for n in stretch if n in op_of))]
    region_ops = [o for o in region_ops if graph.ops[o].nodes[0] in mine]
    in_region = set(region_ops)
    drops: dict[int, int] = {}
    for o in region_ops:
        for v in graph.ops[o].outputs:
            readers = [c for c in graph.values[v].consumers if c in in_region]
            drops[v] = max(readers, default=o)
    return Stretch(
        start,
        end,
        tuple(stretch),
        tuple(nodes[n].target for n in order),
        save,
        tuple(order),
        cached,
        tuple(sorted(drops.items())),
    )


def save_mask(
    problem: Problem,
    nodes: Sequence[int],
    kept: set[int] | frozenset[int],
    op_of: dict[int, int],
    unsaved: frozenset[int] = frozenset(),
) -> tuple[list[int], tuple[bool, ...]]:
    """A region's policy nodes (its ATen ops SAC sees, in order) and which of them it saves:
    an op whose result the plan keeps through the forward (but none of `unsaved`); a random
    op only when every later random op of the region is saved too, so a recompute draws as
    the forward did."""
    graph = problem.graph
    policy = _policy_nodes(problem)
    order = [n for n in nodes if n in policy]
    ops_in = sorted({op_of[n] for n in order if n in op_of})
    saved = {o for o in ops_in if kept.intersection(graph.ops[o].outputs) and o not in unsaved}
    later_recomputed = False
    for o in reversed(ops_in):
        if graph.ops[o].random:
            if later_recomputed:
                saved.discard(o)
            later_recomputed = later_recomputed or o not in saved
    return order, tuple(op_of.get(n) in saved for n in order)


@per_problem
def _policy_nodes(problem: Problem) -> frozenset[int]:
    """The traced nodes a selective policy sees: ATen ops other than checkpoint's ignored
    ones (found once per problem: every stretch of every cover asks)."""
    return frozenset(
        i
        for i, n in enumerate(problem.graph.trace.nodes)
        if isinstance(n.target, torch._ops.OpOverload) and n.target not in SAC_IGNORED_OPS
    )
