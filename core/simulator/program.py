"""Programs: the instructions a plan is made of, how a run list becomes one, and the rules of a
traced step that liveness alone does not cover.

A program is a list of instructions, plain data: `("run", op)` computes an op (the first time,
or again: a recompute), `("free", value)` drops a storage, `("offload", value)` starts copying a
storage to host memory and `("prefetch", value)` starts copying it back into a fresh device
storage. Instructions before `backward_start` run in the forward pass; the rest when
`loss.backward()` reaches the model.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Literal, Protocol

from core.errors import InvalidPlan
from core.graph import Graph

RUN: Literal["run"] = "run"
FREE: Literal["free"] = "free"
OFFLOAD: Literal["offload"] = "offload"
PREFETCH: Literal["prefetch"] = "prefetch"
KINDS = (RUN, FREE, OFFLOAD, PREFETCH)
_VERBS = {FREE: "frees", OFFLOAD: "offloads", PREFETCH: "prefetches"}
Instruction = tuple[str, int]
COLUMNS = ("activation", "temporary", "gradient")  # the kinds of value a budget counts


@dataclass(frozen=True)
class Link:
    """The host link: bytes/s copied device-to-host (offload) and host-to-device (prefetch)."""

    d2h: float
    h2d: float

    def __post_init__(self) -> None:
        if not (self.d2h > 0 and self.h2d > 0):
            raise ValueError(f"link bandwidths must be positive bytes/s, not {self}")


class OpLike(Protocol):
    """What the simulator reads of an op: graph ops (`core.graph.Op`) and `DagOp`s."""

    @property
    def inputs(self) -> tuple[int, ...]: ...
    @property
    def outputs(self) -> tuple[int, ...]: ...
    @property
    def time(self) -> float: ...


def program_from_runs(
    ops: Sequence[OpLike],
    runs: Sequence[int],
    n_forward: int,
    final: Iterable[int],
    held: frozenset[int] = frozenset(),
    arriving: frozenset[int] = frozenset(),
) -> tuple[list[Instruction], int]:
    """The program of a sequence of op runs under free-after-last-read: each value produced
    by a run is freed right after its last read before it is produced again (or after its
    producing run when nothing reads it), unless it is `final`. `held` values live at least
    until the forward ends; `arriving` values (live from the backward's start) are freed
    after their last read in the backward. Returns the program and its `backward_start`;
    the first `n_forward` runs are the forward pass."""
    final = frozenset(final)
    last_read: dict[int, int] = {}  # value -> run position of its latest read so far
    produced: dict[int, int] = {}
    frees_after: dict[int, list[int]] = {}

    def retire(v: int) -> None:
        pos = last_read.pop(v, produced[v])
        if v in held:
            pos = max(pos, n_forward - 1)
        frees_after.setdefault(pos, []).append(v)

    for pos, o in enumerate(runs):
        op = ops[o]
        for v in op.inputs:
            if v in produced or v in arriving:
                last_read[v] = pos
        for v in op.outputs:
            if v in produced:
                retire(v)
            produced[v] = pos
    for v in arriving:
        frees_after.setdefault(max(last_read.pop(v, n_forward), n_forward), []).append(v)
    for v in produced:
        if v not in final:
            retire(v)

    program: list[Instruction] = []
    start = None
    for pos, o in enumerate(runs):
        if pos == n_forward:
            start = len(program)
        program.append((RUN, o))
        frees = frees_after.get(pos)
        if frees:
            frees.sort()
            program += [(FREE, v) for v in frees]
    return program, len(program) if start is None else start


def store_all_program(graph: Graph) -> tuple[list[Instruction], int]:
    """Plain PyTorch: every op once, forward then backward, each value freed after its last
    use. Returns the program and its backward start."""
    return program_from_runs(
        graph.ops,
        graph.forward_ops + graph.backward_ops,
        len(graph.forward_ops),
        graph.final_values,
    )


def step_values(graph: Graph) -> tuple[dict[int, int], list[int], list[int]]:
    """The step's sizes (0 for what a budget does not count), initial and arriving values."""
    values = graph.values
    sizes = {v.index: (v.nbytes if v.kind in COLUMNS else 0) for v in values}
    initial = [v.index for v in values if v.is_placeholder and v.kind != "tangent"]
    return sizes, initial, [v.index for v in values if v.kind == "tangent"]


def check_rules(graph: Graph, program: Sequence[Instruction], backward_start: int) -> None:
    """The rules of a traced step that liveness does not cover: backward ops run in the
    backward, random and state-updating ops first run in the forward in traced order, only
    activations, temporaries and gradients are freed, every op runs."""
    values, ops = graph.values, graph.ops
    sticky = iter(o.index for o in ops if o.random or o.state_update)
    expected = next(sticky, None)
    done: set[int] = set()
    for i, (kind, target) in enumerate(program):
        if kind == RUN:
            op = ops[target]
            if op.phase == "backward" and i < backward_start:
                raise InvalidPlan(f"step {i}: backward op {op.name} runs in the forward pass")
            if target not in done and target == expected:
                if i >= backward_start:
                    raise InvalidPlan(
                        f"step {i}: {op.name} (random or state update) must first run in forward"
                    )
                expected = next(sticky, None)
            elif target not in done and (op.random or op.state_update):
                raise InvalidPlan(f"step {i}: random/state op {op.name} runs out of traced order")
            done.add(target)
        elif kind != RUN and values[target].kind not in COLUMNS:
            raise InvalidPlan(
                f"step {i}: {_VERBS[kind]} {values[target].name}, which is not a live activation"
            )
    never = [op.name for op in ops if op.index not in done]
    if never:
        raise InvalidPlan(f"ops never run: {never[:5]}{'...' if len(never) > 5 else ''}")
