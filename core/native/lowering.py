"""A plan lowered to native execution: which layers run under non-reentrant checkpoint with
which selective policy, what native execution cannot express (notes), and the native step's
own prediction (`core.native.simulate`), before anything is applied.

A block of the plan's chain whose forward is exactly one submodule's forward (a layer, e.g.
`transformer.h.3`) and where the plan recomputes something becomes a `Region`: the ATen ops
its policy will see, in order, and for each whether its result is saved (MUST_SAVE: the
plan keeps it through the forward) or recomputed. `core.native.runtime` installs them.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass
from typing import Any

from core.errors import InvalidPlan
from core.graph import Graph
from core.native.boundaries import forward_nodes
from core.native.lifetimes import python_lifetimes
from core.native.simulate import Checkpointed, NativeProgram, native_program
from core.native.stretch import Cover, Cutting, Stretch, covers, save_mask
from core.plan import Plan, Prediction
from core.problem import Problem, per_problem
from core.simulator import OFFLOAD
from core.trace.module_state import ModuleState


@dataclass(frozen=True)
class Region:
    """One block run as a checkpointed submodule: the ops its policy sees, in order, and
    for each whether its result is saved (True) or recomputed."""

    block: int
    module: str  # the submodule path, e.g. "transformer.h.0"
    ops: tuple[Any, ...]  # ATen OpOverloads, in execution order
    save: tuple[bool, ...]
    recomputed_ops: int  # graph ops of the block the plan recomputes
    nodes: tuple[int, ...] = ()  # the traced node of each op
    forward_nodes: frozenset[int] = frozenset()  # every traced node the module runs
    cached: frozenset[int] = frozenset()  # graph ops whose results the policy saves
    # the plain attributes of the module and its children the trace baked in (dropout's p)
    state: ModuleState = ModuleState()


@dataclass(frozen=True)
class Lowering:
    """A plan as native execution runs it: the checkpointed regions and what it leaves out."""

    regions: tuple[Region, ...]
    notes: tuple[str, ...]
    prediction: Prediction  # the native step's peak and time, simulated (not the plan's)
    recomputed_ops: int  # op runs the checkpoints' recomputes add
    # values moved to the host through saved-tensor hooks: value -> the traced forward node
    # that makes its storage (`core.native.offload` finds it as that node runs)
    offloads: tuple[tuple[int, int], ...] = ()
    # regions that are stretches of a parent's forward (`core.native.stretch`)
    stretches: tuple[Stretch, ...] = ()
    cuts: frozenset[int] = frozenset()  # the places the stretches were cut at
    nests: frozenset[int] = frozenset()  # the places nested stretches end at (`Cover.nests`)


def refuse_chunked_head(problem: Problem) -> None:
    """Native execution runs the model's own forward, whose head makes the whole logits: a
    step traced with the chunked loss head (`analyze(..., loss_head="chunked")`) is not the
    step it would run, so its figures would not be the native step's."""
    if problem.loss_head.kind == "chunked":
        raise InvalidPlan(
            "this step was analysed with the chunked loss head, which only the interpreter "
            "runs: native execution runs the model's own forward and its whole logits. Use "
            "runtime='interpreter' for this plan, or analyse with loss_head='plain' for a "
            "native plan"
        )


def lower(plan: Plan, cut_layers: bool | None = None) -> Lowering:
    """The regions, offloads and notes of `plan` (bound to its problem) under native
    execution, with the native step's prediction. Blocks no submodule runs are covered by
    stretches (`core.native.stretch`); with `cut_layers` (default: for the "native"
    method's plans) a layer may be cut into stretches too, when that peaks lower; else a
    layer runs as one checkpointed submodule, which torch.compile and FSDP2 see whole."""
    problem = plan.problem
    refuse_chunked_head(problem)
    sim = plan.simulate()
    offloaded = {v for kind, v in plan.program if kind == OFFLOAD}
    kept = sim.live_after(plan.backward_start - 1) | offloaded
    runs = {o: len(steps) for o, steps in sim.op_steps.items()}
    regions: list[Region] = []
    notes: list[str] = []
    unmoduled: list[int] = []  # blocks the plan recomputes in that no submodule runs
    for block in problem.blocks:
        recomputed = [o for o in block.forward_ops if runs.get(o, 0) > 1]
        if not recomputed:
            continue  # kept whole (or freed and never needed): runs as eager does
        module = _module_of(problem, block.index)
        if module is None:
            unmoduled.append(block.index)
            continue
        repeated = sum(1 for o in recomputed if runs[o] > 2)
        if repeated:
            notes.append(
                f"block {block.index} ({module}): the plan runs {repeated} forward ops more "
                "than twice; checkpoint recomputes them once"
            )
        regions.append(_region(problem, block.index, module, kept, len(recomputed)))
    if cut_layers is None:
        cut_layers = plan.method == "native"
    return _lower_with_stretches(plan, regions, notes, unmoduled, kept, runs, offloaded, cut_layers)


def runs_at_peak(plan: Plan) -> int:
    """The peak `plan` runs at, which its budget bounds: native execution's (`lower`) for the
    "native" method's plans, the program's (`predicted_peak`) for the others."""
    if plan.method == "native":
        return lower(plan).prediction.peak
    return plan.predicted_peak


def _lower_with_stretches(
    plan: Plan,
    regions: list[Region],
    notes: list[str],
    unmoduled: list[int],
    kept: set[int],
    runs: dict[int, int],
    offloaded: set[int],
    cut_layers: bool,
) -> Lowering:
    """The lowering with the blocks no submodule runs covered by stretches
    (`core.native.stretch`): of the candidate covers, the best by `_key` (the lowest native
    peak, then the least time; with `cut_layers`, the least time at or below the plan's
    budget); a block no stretch can cover is kept whole (a note). With `cut_layers`, the
    cuts of the lowest cover of stretches alone are then searched (`_searched_cuts`)."""
    problem = plan.problem
    held = python_held(problem)
    modules = [
        Checkpointed(r.forward_nodes, r.cached, held.passed.get(r.module, frozenset()))
        for r in regions
    ]
    recomputed = {o for o, k in runs.items() if k > 1}
    taken = _places(problem, regions)
    budget = plan.budget if cut_layers else 0
    priced = [
        _priced(plan, regions, modules, c, notes, runs, offloaded)
        for c in covers(problem, unmoduled, kept, recomputed, taken)
    ]
    alone: list[Lowering] = []  # candidates of stretches alone
    if regions and cut_layers:  # stretches in place of the submodule regions: finer cuts
        every = sorted({*unmoduled, *(r.block for r in regions)})
        alone = [
            _priced(plan, [], [], c, notes, runs, offloaded)
            for c in covers(problem, every, kept, recomputed, [])
        ]
        priced += alone
    elif cut_layers:
        alone = priced
    if cut_layers and recomputed and alone:
        # the search cuts anywhere in the forward: a stretch may hold blocks the plan
        # recomputes nothing in (its input is then all its frame holds)
        blocks = tuple(b.index for b in problem.blocks)
        start = min(alone, key=lambda low: _key(low, 0))
        every = sorted({*unmoduled, *(r.block for r in regions)})
        loose = [  # the candidates cut at loose moments too
            _priced(plan, [], [], c, notes, runs, offloaded)
            for c in covers(problem, every, kept, recomputed, [], loose=True)
        ]
        priced += loose
        found = _searched_cuts(
            problem,
            blocks,
            frozenset(kept),
            frozenset(recomputed),
            start.cuts,
            min(loose, key=lambda low: _key(low, 0)).cuts,
            frozenset(offloaded),
        )
        cutting = Cutting.of(problem, list(blocks), kept, recomputed, [], found.loose)
        cover = cutting.cover(found.cuts, cutting.joined, found.nests)
        priced.append(_priced(plan, [], [], cover, notes, runs, offloaded))
    return min(priced, key=lambda low: _key(low, budget))


def _key(low: Lowering, budget: int) -> tuple[int, float]:
    """What a lowering is chosen by: its peak (any peak within `budget` counting as the
    budget), then its time."""
    return (max(low.prediction.peak, budget), low.prediction.time)


# most native simulations one search of cuts runs (each a walk of the step: milliseconds on
# the small models, tens of them on 12-layer ones; the method searches 14 plans). 48: the
# least native peaks of mlp-batch, regnet-tiny and unet-tiny are those of 240
SEARCH_EVALUATIONS = 48


@per_problem
def _searched_cuts(
    problem: Problem,
    blocks: tuple[int, ...],
    kept: frozenset[int],
    recomputed: frozenset[int],
    start: frozenset[int],
    loose_start: frozenset[int],
    offloaded: frozenset[int],
) -> Searched:
    """Cuts of `blocks` into stretches, and the places where nested stretches end
    (`Cover.nests`), found by a local search priced by the native simulation. First, from
    `start`, each place a stretch may begin or end at is toggled in turn (a cut made or
    removed), and a change is kept when the step's native (peak, time) improves, until a
    pass changes nothing or `SEARCH_EVALUATIONS` runs out. Then, from there and from
    `loose_start`, the same over the loose moments too (`Boundaries.loose`), each place
    toggled as a cut and as the end of a nested stretch; the lowest of the three wins. It
    asks no budget, so the method's search for its least peak and the plan it returns share
    it. The candidate covers cut by weights and block groups
    (`covers`) miss cuts that hold less: mlp-batch's least native peak was 78.7% of
    store-all from them, 71.5% with cuts searched, 60.9% with nested stretches too."""
    strict = Cutting.of(problem, list(blocks), set(kept), set(recomputed), [])
    loose = Cutting.of(problem, list(blocks), set(kept), set(recomputed), [], loose=True)

    def key(cutting: Cutting, cuts: frozenset[int], nests: frozenset[int]) -> tuple[int, float]:
        cover = cutting.cover(cuts, cutting.joined, nests)
        _, native = _program(problem, [], cover, set(offloaded), [])
        walked = native.walk(problem.graph)
        return (walked.peak, walked.time)

    def search(cutting: Cutting, cuts: frozenset[int], nesting: bool) -> Searched:
        nests = frozenset[int]()
        best = key(cutting, cuts, nests)
        left = SEARCH_EVALUATIONS - 1
        changed = True
        while changed and left > 0:
            changed = False
            for p in cutting.places:
                moves = [(cuts ^ {p}, nests - {p})]
                if nesting and p not in cuts:
                    moves.append((cuts, nests ^ {p}))
                for other in moves:
                    if left <= 0:
                        break
                    left -= 1
                    found = key(cutting, *other)
                    if found < best:
                        (cuts, nests), best, changed = other, found, True
        return Searched(cuts, nests, cutting is loose, best)

    first = search(strict, start, False)
    found = [first, search(loose, first.cuts, True)]
    if loose_start != first.cuts:
        found.append(search(loose, loose_start, True))
    return min(found, key=lambda s: s.key)


@dataclass(frozen=True)
class Searched:
    """What `_searched_cuts` found: the cuts, the ends of nested stretches, whether loose
    moments are among them (`Cutting.of`'s `loose`), and the native (peak, time)."""

    cuts: frozenset[int]
    nests: frozenset[int]
    loose: bool
    key: tuple[int, float]


def _program(
    problem: Problem,
    modules: list[Checkpointed],
    cover: Cover,
    offloaded: set[int],
    notes: list[str],
) -> tuple[tuple[tuple[int, int], ...], NativeProgram]:
    """The offloads kept (`_offloads`, its notes into `notes`) and the native program of the
    submodule regions `modules` with `cover`'s stretches: what the cut search and `_priced`
    both simulate."""
    checkpointed = modules + [
        Checkpointed(
            frozenset(s.nodes),
            s.cached,
            frozenset(),
            dict(s.replay_drops),
            parent=None if s.parent is None else len(modules) + s.parent,
        )
        for s in cover.stretches
    ]
    offloads = _offloads(problem, offloaded, checkpointed, notes)
    native = native_program(
        problem.graph,
        checkpointed,
        python_held(problem).dropped,
        frozenset(v for v, _ in offloads),
        problem.link,
    )
    return offloads, native


def _priced(
    plan: Plan,
    regions: list[Region],
    modules: list[Checkpointed],
    cover: Cover,
    notes: list[str],
    runs: dict[int, int],
    offloaded: set[int],
) -> Lowering:
    """The lowering with submodule `regions` (their `modules`) and `cover`'s stretches,
    its native step simulated."""
    problem = plan.problem
    mine = list(notes)
    offloads, native = _program(problem, modules, cover, offloaded, mine)
    walked = native.walk(problem.graph)
    base = problem.store_all_time
    prediction = Prediction(walked.peak, walked.time, walked.time / base if base else 1.0)
    for b in cover.whole:
        block = problem.blocks[b]
        n = sum(1 for o in block.forward_ops if runs.get(o, 0) > 1)
        mine.append(
            f"block {b} ({block.name or 'the root'}): the plan recomputes {n} ops there, "
            "but neither a submodule nor a stretch between submodule calls runs them; "
            "native execution keeps it whole"
        )
    return Lowering(
        tuple(regions),
        tuple(mine),
        prediction,
        native.recomputed_ops,
        offloads,
        cover.stretches,
        cover.cuts,
        cover.nests,
    )


def _places(problem: Problem, regions: list[Region]) -> list[tuple[int, int]]:
    """Each submodule region's places [first, last + 1) among the traced forward ops."""
    place_of = {n: i for i, n in enumerate(forward_nodes(problem.graph.trace.nodes))}
    out = []
    for r in regions:
        places = [place_of[n] for n in r.forward_nodes if n in place_of]
        if places:
            out.append((min(places), max(places) + 1))
    return out


def _offloads(
    problem: Problem, offloaded: set[int], regions: list[Checkpointed], notes: list[str]
) -> tuple[tuple[int, int], ...]:
    """(value, the traced node making its storage) of each offloaded value the saved-tensor
    hooks can move: one made outside every checkpointed region and passed to none (inside,
    checkpoint's own hooks pack the saved tensors, and selective checkpoint's cache keeps
    its entries on the device: those values stay there, a note says how many)."""
    graph = problem.graph
    inside = {n for r in regions for n in r.nodes}
    passed = {v for r in regions for v in r.inputs}
    out: list[tuple[int, int]] = []
    stay = 0
    for v in sorted(offloaded):
        producer = graph.values[v].producer
        node = (
            next((n for n in graph.ops[producer].nodes if v in graph.trace.nodes[n].storages), None)
            if producer is not None
            else None
        )
        if node is None or node in inside or v in passed or _read_inside(graph, v, inside):
            stay += 1
        else:
            out.append((v, node))
    if stay:
        notes.append(
            f"{stay} of the {len(offloaded)} values the plan offloads are made or read inside "
            "a checkpointed layer: native execution keeps them on the device"
        )
    return tuple(out)


def _read_inside(graph: Graph, v: int, inside: set[int]) -> bool:
    """Whether a forward op run inside a checkpointed region reads `v` (its frame or its
    recompute would hold it)."""
    return any(
        graph.ops[o].phase == "forward" and graph.ops[o].nodes[0] in inside
        for o in graph.values[v].consumers
    )


@dataclass(frozen=True)
class PythonHeld:
    """What the model's Python code holds, in graph values (`core.native.lifetimes`):
    `dropped` maps a forward value to the forward op after which Python drops it; `passed`
    maps a submodule to the values it is called with."""

    dropped: dict[int, int]
    passed: dict[str, frozenset[int]]


@per_problem
def python_held(problem: Problem) -> PythonHeld:
    """The model's Python lifetimes, run once per problem; empty for a problem made without
    a model (values are then taken as dropped after their last read, a region's frame as
    holding the outer values its ops read); a RematError when its model was garbage
    collected (`Problem.live_model`)."""
    model = problem.live_model("native execution's simulation (the model's Python lifetimes)")
    if model is None:
        return PythonHeld({}, {})
    graph = problem.graph
    trace = graph.trace
    op_of = {n: op.index for op in graph.ops for n in op.nodes}
    starts = sorted((graph.ops[o].nodes[0], o) for o in graph.forward_ops)
    firsts = [n for n, _ in starts]
    lifetimes = python_lifetimes(model, trace, problem.loss_fn, problem.device_model)
    out: dict[int, int] = {}
    for made, dropped in lifetimes.dropped.items():
        v = _made_value(graph, made, op_of)
        k = bisect.bisect_right(firsts, dropped) - 1
        if v is None or k < 0:
            continue
        out[v] = max(o2 for _, o2 in starts[: k + 1])
    passed = {
        name: frozenset(
            v for v in (_made_value(graph, made, op_of) for made in storages) if v is not None
        )
        for name, storages in lifetimes.passed.items()
    }
    return PythonHeld(out, passed)


def _made_value(graph: Graph, made: tuple[int, int], op_of: dict[int, int]) -> int | None:
    """The graph value of a traced node's `i`-th tensor output, when its graph op (or the
    transient the node is, `core.graph.Transient`) makes it (a view of another op's value
    is not a value of its own)."""
    node, i = made
    storages = graph.trace.nodes[node].storages
    if i >= len(storages):
        return None
    v = storages[i]
    if node not in op_of:
        return v if v in _transient_outputs(graph).get(node, ()) else None
    return v if v in graph.ops[op_of[node]].outputs else None


def _transient_outputs(graph: Graph) -> dict[int, tuple[int, ...]]:
    """A transient's first node -> the values it makes."""
    return {t.node: t.outputs for t in graph.transients}


def module_nodes(problem: Problem, module: str) -> list[int]:
    """Traced forward nodes run inside `module` (or its children), in order."""
    prefix = module + "."
    return [
        n.index
        for n in problem.graph.trace.nodes
        if n.role == "op"
        and n.module is not None
        and (n.module == module or n.module.startswith(prefix))
    ]


def _module_of(problem: Problem, block: int) -> str | None:
    """The submodule whose forward runs exactly `block`'s ops (step constants aside), in
    one contiguous stretch of the trace; None when there is none."""
    name = problem.blocks[block].name
    if not name:
        return None
    graph, consts = problem.graph, set(problem.constant_ops)
    op_of = {n: op.index for op in graph.ops for n in op.nodes}
    nodes = module_nodes(problem, name)
    forward = [n.index for n in graph.trace.nodes if n.role == "op" and n.module is not None]
    if not nodes or forward[forward.index(nodes[0]) : forward.index(nodes[-1]) + 1] != nodes:
        return None  # interleaved with other modules' ops: called twice, or shared
    mine = {op_of[n] for n in nodes if n in op_of} - consts
    if mine != set(problem.blocks[block].forward_ops) - consts:
        return None
    return name


def _region(problem: Problem, block: int, module: str, kept: set[int], recomputed: int) -> Region:
    """The region's ops in execution order and what its policy saves: an op (with the
    aliasing and in-place nodes folded into it) is saved when the plan keeps one of its
    results through the forward. A random op is saved only when every later random op of
    the region is: a cached op draws no random numbers on recompute, so a later recomputed
    one would draw others than in the forward."""
    graph = problem.graph
    nodes = graph.trace.nodes
    op_of = {n: op.index for op in graph.ops for n in op.nodes}
    every = module_nodes(problem, module)
    order, save = save_mask(problem, every, kept, op_of)
    targets = tuple(nodes[n].target for n in order)
    cached = frozenset(op_of[n] for n, s in zip(order, save) if s and n in op_of)
    rows = graph.trace.module_state.rows
    state = ModuleState(tuple(r for r in rows if r[0] == module or r[0].startswith(module + ".")))
    return Region(
        block, module, targets, save, recomputed, tuple(order), frozenset(every), cached, state
    )
