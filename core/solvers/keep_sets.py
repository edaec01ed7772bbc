"""Block options from keep sets: which forward values a block keeps for its backward.

A beam search over keep sets (and values recomputed once per reading op), each state turned
into a run list by `Recompute` and simulated exactly. It finds the options the block ILP's
conservative memory rows miss, most of all in attention: keep the matmul outputs, recompute
the big pointwise results (softmax, dropout masks) just before the backward reads them.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from core.interrupt import stop_if_asked
from core.simulator import Dag, Simulated, kept_bytes, simulated

# Bytes are counted as what the forward keeps plus this fraction of the backward's peak
# above it: 0 finds the least kept, 1 the least footprint; between, a move may raise the
# backward's peak by less than it lowers what is kept (keep gelu's output, recompute its
# input), which can let later moves lower what is kept for free. Rotor pays for both, in
# proportions that depend on the rest of the chain.
WEIGHTS = (0.0, 0.25, 0.5, 0.75, 1.0)
BEAM = 8  # states each weight's beam keeps per step
# keep sets simulated per block, all weights together: bounds the search's work while keeping
# the sample models within 0.02 of the unbounded overheads (docs/tuning.md)
MAX_STATES = 6000

_State = tuple[frozenset[int], frozenset[int], Simulated]  # kept, transient, option


@dataclass
class KeepSetSearch:
    """Beam search over (kept set, transient set); each state is simulated once.

    From store-all, each step applies one more move to the states of the beam (see `moves`)
    and keeps, for each of several ways to count bytes, the children that add the least time
    per byte they free; every state a beam holds is an option. At most `max_states` keep sets
    are simulated (a share per way of counting, what one leaves unused going to the next);
    `bounded` says the bound stopped the search (checked between steps: the step under way
    finishes), so deeper (smaller) options may be missing.
    """

    dag: Dag
    max_states: int = MAX_STATES
    seen: dict[tuple, Simulated] = field(default_factory=dict)  # (kept, transient) -> option
    bounded: bool = False  # the state bound stopped a beam

    def __post_init__(self) -> None:
        self.recompute = Recompute(self.dag)

    def options(self, full: Simulated) -> list[Simulated]:
        """Every state the beams hold, from store-all (`full`)."""
        keep = frozenset(
            v
            for v in full.stats.kept
            if v in self.recompute.producer
            and self.dag.sizes.get(v, 0) > 0
            and v not in self.recompute.pinned
        )
        return self.run((keep, frozenset(), full))

    def option(self, keep: frozenset[int], transient: frozenset[int]) -> Simulated:
        if (keep, transient) not in self.seen:
            stop_if_asked()  # a page that moved on stops the search here
            runs = self.recompute.runs(keep, transient)
            self.seen[(keep, transient)] = simulated(self.recompute.dag, runs)
        return self.seen[(keep, transient)]

    def moves(self, state: _State) -> list[tuple[frozenset[int], frozenset[int]]]:
        """Drop a kept value (recomputed when the backward first needs it, then held until
        its last read), or make a kept or recomputed value transient (recomputed for each
        backward op that reads it, freed in between)."""
        dag, nf = self.recompute.dag, self.recompute.dag.n_forward
        keep, transient, current = state
        recomputed = {v for i in current.runs[nf:] if i < nf for v in dag.ops[i].outputs}
        out = [(keep - {v}, transient) for v in sorted(keep)]
        out += [
            (keep, transient | {v})
            for v in sorted((recomputed | keep) - transient)
            if dag.sizes.get(v, 0) > 0
        ]
        return out

    def run(self, start: _State) -> list[Simulated]:
        """One beam per weight; every state a beam holds is an option."""
        found = []
        for i, weight in enumerate(WEIGHTS):
            limit = self.max_states * (i + 1) // len(WEIGHTS)
            found += [option for *_, option in self.beam(start, weight, limit)]
        return found

    def beam(self, start: _State, weight: float, limit: int) -> list[_State]:
        """Apply one more move per step; keep the BEAM children that add the least time
        per byte they free (bytes counted with `weight`), until no move frees any or
        `limit` states have been simulated (then the beam so far is kept)."""
        dag, measure = self.recompute.dag, _weighted(weight)
        beam, found = [start], []
        while beam:
            if len(self.seen) >= limit:
                self.bounded = True
                break
            children: dict[tuple, tuple[float, _State]] = {}
            for parent in beam:
                before = (parent[2].time, measure(dag, parent[2]))
                for k, t in self.moves(parent):
                    option = self.option(k, t)
                    freed = before[1] - measure(dag, option)
                    if freed > 0:
                        ratio = (option.time - before[0]) / freed
                        if ratio < children.get((k, t), (float("inf"),))[0]:
                            children[(k, t)] = (ratio, (k, t, option))
            ranked = sorted(children.values(), key=lambda c: c[0])
            beam = [state for _, state in ranked[:BEAM]]
            found += beam
        return found


def _weighted(weight: float) -> Callable[[Dag, Simulated], float]:
    """Kept bytes plus `weight` times the backward's peak above them."""

    def measure(dag: Dag, option: Simulated) -> float:
        stats = option.stats
        return kept_bytes(dag, option) + weight * max(
            0, stats.backward_peak - stats.backward_start_bytes
        )

    return measure


@dataclass
class Recompute:
    """Run lists for keep sets: the forward once, then each backward op with the recomputes
    it needs just before it (recursively from what is available).

    A dropped value, once recomputed, stays available for later backward ops, unless it is
    transient: then it is recomputed for each backward op that reads it (a kept transient
    value is used from the forward once, then recomputed too). A recomputed value that the
    backward does not read itself is only held for the dropped values computed from it (QKV's
    output for q, k and v): when those are no bigger and can be computed now, they are, so it
    can go at once instead of when the last of them is needed.
    """

    dag: Dag

    def __post_init__(self) -> None:
        dag, nf = self.dag, self.dag.n_forward
        # forward value -> position of its op
        self.producer = {v: i for i, op in enumerate(dag.ops[:nf]) for v in op.outputs}
        # an op that produces a step output (the loss) must not run twice: keep all it produces
        self.pinned = frozenset(
            v for op in dag.ops[:nf] if set(op.outputs) & dag.final for v in op.outputs
        )
        self.readers: dict[int, list[int]] = {}  # value -> forward values computed from it
        for v, f in self.producer.items():
            for u in dag.ops[f].inputs:
                self.readers.setdefault(u, []).append(v)
        self.later: list[frozenset[int]] = [frozenset()] * (len(dag.ops) + 1)
        for i in range(len(dag.ops) - 1, nf - 1, -1):  # forward values ops i.. read
            self.later[i] = self.later[i + 1] | {v for v in dag.ops[i].inputs if v in self.producer}

    def runs(self, keep: frozenset[int], transient: frozenset[int] = frozenset()) -> list[int]:
        dag, producer, sizes = self.dag, self.producer, self.dag.sizes
        nf = dag.n_forward
        runs = list(range(nf))
        available = set(keep) | dag.held | self.pinned
        scratch: set[int] = set()  # transient values, available to this backward op only
        pending: set[int] = set()  # values whose inputs are being recomputed

        def ready(v: int) -> bool:
            return all(u in available or u not in producer for u in dag.ops[producer[v]].inputs)

        def ensure(v: int, later: frozenset[int]) -> None:
            if v in available or v in scratch or v in pending or v not in producer:
                return
            op = dag.ops[producer[v]]
            pending.update(op.outputs)
            for u in op.inputs:
                ensure(u, later)
            pending.difference_update(op.outputs)
            runs.append(producer[v])
            for u in op.outputs:
                (scratch if u in transient else available).add(u)
            for u in op.outputs:
                if u not in available or u in later:
                    continue
                kids = [
                    w
                    for w in self.readers.get(u, ())
                    if w not in available and w not in pending and w in later
                ]
                if kids and all(map(ready, kids)):
                    if sum(sizes.get(w, 0) for w in kids) <= sizes.get(u, 0):
                        for w in kids:
                            ensure(w, later)

        for i in range(nf, len(dag.ops)):
            start = len(runs)
            for v in dag.ops[i].inputs:
                ensure(v, self.later[i + 1])
            scratch.clear()
            runs.append(i)
            read = {u for r in runs[start:] for u in dag.ops[r].inputs}
            available -= transient & read  # kept transient values: recomputed next time
            available.update(dag.ops[i].outputs)
        return runs
