"""A plan read back as plain numbers for the views: each op's fate, each storage's live
steps, the steps worth jumping to, and budgets as slider percentages."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from core import OFFLOAD, PREFETCH


def op_fates(problem: Any, plan: Any) -> dict[str, list[int]]:
    """Forward ops grouped by the simulator's fate: kept until the backward, recomputed in
    the backward, offloaded to host memory and brought back, or freed (the backward never
    needs them)."""
    fates: dict[str, list[int]] = {"kept": [], "recomputed": [], "offloaded": [], "freed": []}
    for o, fate in plan.simulate().fates().items():
        fates[fate].append(o)
    return fates


def fate_of_ops(problem: Any, plan: Any) -> dict[int, str]:
    """`op_fates` turned round: each forward op's fate."""
    fate_of: dict[int, str] = {}
    for fate, ops in op_fates(problem, plan).items():
        fate_of.update(dict.fromkeys(ops, fate))
    return fate_of


@dataclass(frozen=True)
class Band:
    """One storage alive over program steps [start, end) (end = len(program): to the end)."""

    value: int
    start: int
    end: int


LAYER_FATES = ("recomputed", "offloaded", "kept", "freed")  # the first present names a block


def block_fates(problem: Any, plan: Any) -> dict[str, list[int]]:
    """Blocks grouped by the fate that matters most among their forward ops (recomputed,
    then offloaded, kept, freed): how a closed block in the graph is outlined."""
    fate_of = fate_of_ops(problem, plan)
    out: dict[str, list[int]] = {fate: [] for fate in LAYER_FATES}
    for block in problem.blocks:
        mine = {fate_of.get(o) for o in block.forward_ops}
        first = next((f for f in LAYER_FATES if f in mine), None)
        if first is not None:
            out[first].append(block.index)
    return out


def live_bands(problem: Any, plan: Any) -> list[Band]:
    """Every activation, temporary and gradient storage's live intervals, in allocation order.

    At each step the bytes of the bands alive there sum to the timeline's stacked total. The
    one place the per-tensor view reads liveness from: the simulator's intervals.
    """
    graph = problem.graph
    counted = {"activation", "temporary", "gradient"}
    bands = [
        Band(v, start, end)
        for v, spans in plan.simulate().intervals.items()
        if graph.values[v].kind in counted
        for start, end in spans
    ]
    return sorted(bands, key=lambda b: (b.start, b.value))


def fate_at(sim: Any, value: int, fate: str, step: int) -> str:
    """What a storage of `value`, made by an op of `fate`, is at program step `step`.

    An op's fate says what happens to its results over the whole program; at one step an
    offloaded op's storage may still be on the device (before its copy out, or while the
    copy is in flight) or back on it (prefetched). Only a storage parked on the host at
    `step` (its device copy released, its prefetch not yet issued) reads "offloaded"; the
    others say where they are, from the simulation's transfers.
    """
    if fate != "offloaded":
        return fate
    mine = [t for t in sim.transfers if t.value == value]
    if not any(t.kind == OFFLOAD for t in mine):  # another output of an offloaded op
        return "kept" if value in sim.live_after(sim.backward_start - 1) else "freed"
    last = max((t for t in mine if t.step <= step), key=lambda t: t.step, default=None)
    if last is None:
        return "not yet offloaded"
    if last.kind == PREFETCH:
        return "prefetched back"
    if last.release < 0 or step < last.release:
        return "copying to host"
    return "offloaded"


def alive_at(rows: list[dict], step: int) -> list[dict]:
    """The rows alive after program step `step`, largest first."""
    return sorted((r for r in rows if r["start"] <= step < r["end"]), key=lambda r: -r["nbytes"])


def peak_step(timeline: Sequence[Any]) -> int:
    """The program step where live memory is highest (the first, on ties)."""
    totals = [s.activations + s.temporaries + s.gradients for s in timeline]
    return totals.index(max(totals)) if totals else 0


def next_recompute(timeline: Sequence[Any], step: int | None) -> int | None:
    """The first recomputing step after `step` (wrapping round), or None if none."""
    recomputes = [s.index for s in timeline if s.recompute]
    if not recomputes:
        return None
    return next((i for i in recomputes if step is None or i > step), recomputes[0])


def next_transfer(timeline: Sequence[Any], step: int | None) -> int | None:
    """The first offload or prefetch step after `step` (wrapping round), or None if none."""
    copies = [s.index for s in timeline if s.kind in (OFFLOAD, PREFETCH)]
    if not copies:
        return None
    return next((i for i in copies if step is None or i > step), copies[0])


def percent(budget: int, peak: int) -> float:
    """`budget` as a percentage of `peak` (100 when there is no peak)."""
    return 100.0 * budget / peak if peak else 100.0


def slider_minimum(minimum: int, peak: int, step: float = 0.5) -> float:
    """The slider's lowest % position at or above `minimum` bytes."""
    pct = math.ceil(percent(minimum, peak) / step - 1e-9) * step
    return min(pct, 100.0)
