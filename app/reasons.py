"""Reasons, not prices: why the plan keeps one activation and recomputes another, and why the
peak sits where it does, in one sentence each (reading a solved plan; no solving here).

The solver trades time for bytes: recomputing an op costs its time and frees its outputs'
bytes until the backward reads them. So each keep or recompute is compared with the other
choice the plan made in the same block, in microseconds per 100 KiB.
"""

from __future__ import annotations

from typing import Any

from app.readback import fate_of_ops, peak_step
from core import fmt_bytes, op_name

PER = 100 << 10  # prices are per 100 KiB


def _nbytes(graph: Any, o: int) -> int:
    return sum(graph.values[v].nbytes for v in graph.ops[o].outputs)


def _price(graph: Any, o: int) -> float:
    """Microseconds to recompute op `o` per 100 KiB it frees, to the 3 digits shown (so
    "less than" is never said of two prices that read the same)."""
    nbytes = _nbytes(graph, o)
    return float(f"{graph.ops[o].time * 1e6 * PER / nbytes:.3g}") if nbytes else float("inf")


def _us(price: float) -> str:
    return f"{price:g} µs per 100 KiB"


def comparison(problem: Any, plan: Any, target: int, block: int) -> str:
    """Why forward op `target` of `block` is kept or recomputed, against the other choice
    the plan made in the same block; "" when the block offers no comparison."""
    graph = problem.graph
    fates = fate_of_ops(problem, plan)
    fate = fates.get(target)
    if fate not in ("kept", "recomputed") or not 0 <= block < len(problem.blocks):
        return ""
    mine = _price(graph, target)
    others = [o for o in problem.blocks[block].forward_ops if o != target and _nbytes(graph, o)]
    if fate == "recomputed":
        kept = [o for o in others if fates.get(o) == "kept"]
        if not kept:
            return f"Recomputing it costs {_us(mine)}; the plan keeps nothing else of this block."
        pricier = [o for o in kept if _price(graph, o) > mine]
        if pricier:
            other = min(pricier, key=lambda o: _price(graph, o))
            return (
                f"Recomputing it costs {_us(mine)}, less than the {_us(_price(graph, other))} "
                f"of the {op_name(graph, other).kind} ({graph.ops[other].name}) it kept."
            )
        other = max(kept, key=lambda o: _price(graph, o))
        return (
            f"Recomputing it costs {_us(mine)}, no less than the {_us(_price(graph, other))} of "
            f"the {op_name(graph, other).kind} ({graph.ops[other].name}) it kept: the solver "
            "also weighs what each recompute needs alive, not the price per byte alone."
        )
    dropped = [o for o in others if fates.get(o) == "recomputed"]
    if not dropped:
        return (
            f"Recomputing it would cost {_us(mine)}; at this budget the plan recomputes "
            "nothing in this block."
        )
    cheaper = [o for o in dropped if _price(graph, o) < mine]
    other = (
        max(cheaper, key=lambda o: _price(graph, o))
        if cheaper
        else min(dropped, key=lambda o: _price(graph, o))
    )
    relation = "more than" if cheaper else "although that is no more than"
    return (
        f"Recomputing it would cost {_us(mine)}, {relation} the {_us(_price(graph, other))} of "
        f"the {op_name(graph, other).kind} ({graph.ops[other].name}) the plan recomputes instead."
    )


def peak_reason(problem: Any, plan: Any) -> str:
    """One sentence on why the plan's peak is at its step: what is alive there and why."""
    timeline = plan.timeline
    if not timeline:
        return ""
    i = peak_step(timeline)
    s = timeline[i]
    parts = (
        f"{fmt_bytes(s.activations)} of activations, {fmt_bytes(s.temporaries)} of "
        f"temporaries and {fmt_bytes(s.gradients)} of gradients"
    )
    kind, target = plan.program[i]
    doing = f" while {op_name(problem.graph, target).words} runs" if kind == "run" else ""
    start, n = plan.backward_start, len(timeline)
    if i < start:
        return (
            f"The peak is in the forward, at step {i + 1}{doing}: {parts} are alive, more "
            "than the backward ever holds, because this plan keeps more there than it frees."
        )
    if i - start <= max(2, (n - start) // 10):
        return (
            f"The peak is at the start of the backward (step {i + 1}){doing}: every activation "
            f"kept for the backward is still alive, and the backward's first ops add their "
            f"temporaries and gradients: {parts}."
        )
    return (
        f"The peak is in the backward, at step {i + 1}{doing}: {parts} are alive; activations "
        "recomputed for this part of the backward meet the gradients made so far."
    )
