"""The app's explanations in words: why each program step happens, why a value travels to
host memory, what each storage is, what sets the peak.

Text comes back without markup: sentences as plain strings, and a storage's description as
a `Note` (lines of `Span`s) that each view renders its own way (plotly hover HTML in
`app.figures`, a tooltip's plain text in `app.callbacks`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from app.readback import Band, fate_of_ops, peak_step
from app.reasons import comparison
from core import DEVICES as DEVICE_SPECS
from core import OFFLOAD, PREFETCH, RUN, fmt_bytes, op_name

FATE_TEXT = {
    "kept": "kept from the forward to the backward",
    "recomputed": "freed in the forward, recomputed in the backward",
    "offloaded": "sent to host memory in the forward, brought back for the backward",
    "freed": "freed after its last use (the backward does not need it)",
}


@dataclass(frozen=True)
class Span:
    """A run of text; `strong` ones are the line's subject (drawn bold where a view can)."""

    text: str
    strong: bool = False


@dataclass(frozen=True)
class Note:
    """Lines of spans, no markup. `str(note)` is its plain text, one line per line, and
    `"x" in note` searches that text."""

    lines: tuple[tuple[Span, ...], ...]

    def plain(self) -> str:
        return "\n".join("".join(s.text for s in line) for line in self.lines)

    def __str__(self) -> str:
        return self.plain()

    def __contains__(self, text: str) -> bool:
        return text in self.plain()


def line(*parts: str | Span) -> tuple[Span, ...]:
    """One line of a `Note`: plain strings and spans."""
    return tuple(p if isinstance(p, Span) else Span(p) for p in parts)


# ------------------------------------------------------------------ the per-tensor view


def tensor_rows(problem: Any, plan: Any, bands: list[Band]) -> list[dict]:
    """What the per-tensor view draws and says about each band: bytes, and in a `Note` the
    storage, the op, module path and source line that made it, and the plan's choice."""
    graph = problem.graph
    fate_of = fate_of_ops(problem, plan)
    rows = []
    for b in bands:
        value = graph.values[b.value]
        op = graph.ops[value.producer]
        node = graph.trace.nodes[op.nodes[0]]
        where = node.module or ("the backward" if op.phase == "backward" else "the model")
        fate = fate_of.get(op.index)
        lines = [
            line(Span(value.name, strong=True), f" · {value.kind} · {fmt_bytes(value.nbytes)}"),
            line(f"made by {op_name(graph, op.index).words} ({op.label}, {op.name}) in {where}"),
            *([line(node.source)] if node.source else []),
            *([line(FATE_TEXT[fate])] if fate else []),
            line(f"alive at steps {b.start + 1}–{b.end}"),
        ]
        rows.append(
            {
                "start": b.start,
                "end": b.end,
                "nbytes": value.nbytes,
                "value": b.value,
                "name": value.name,
                "words": op_name(graph, op.index).words,
                "kind": value.kind,
                "fate": fate or value.kind,
                "text": Note(tuple(lines)),
            }
        )
    return rows


# ------------------------------------------------------------------ the step-through


def step_view(problem: Any, plan: Any, i: int) -> dict:
    """What the step-through shows at program step `i`: the op(s) to highlight, the forward
    ops whose results are alive, the block, and one sentence saying why the step happens."""
    graph = problem.graph
    kind, target = plan.program[i]
    sim = plan.simulate()
    fwd_producers = {p for v in sim.live_after(i) if (p := _forward_producer(graph, v)) is not None}
    step = sim.timeline[i]
    if kind == "run":
        running, why = _run_reason(problem, plan, i)
    elif kind in (OFFLOAD, PREFETCH):
        running, why = _forward_of(graph, target), transfer_reason(problem, plan, i)
    else:
        value = graph.values[target]
        later = any(start > i for start, _ in sim.intervals[target])
        why = (
            f"Free {value.name} ({value.kind}, {fmt_bytes(value.nbytes)}): no step needs it "
            "until " + ("it is recomputed later." if later else "the end of the step.")
        )
        running = _forward_of(graph, target)
    return {
        "running": sorted(o for o in set(running) if o is not None),
        "live": sorted(fwd_producers),
        "block": step.block,
        "why": why,
        "label": f"step {i + 1} of {len(plan.program)} · {step.phase}",
    }


def _forward_producer(graph: Any, v: int) -> int | None:
    """The forward op that produced value `v`, or None (an input, or a backward value)."""
    p = graph.values[v].producer
    return p if p is not None and graph.ops[p].phase == "forward" else None


def _forward_of(graph: Any, v: int) -> list[int]:
    """[the forward op that produced `v`], or [] when none did."""
    p = _forward_producer(graph, v)
    return [] if p is None else [p]


def _block_words(problem: Any, block: int) -> str:
    blocks = problem.blocks
    return f"block {block} ({blocks[block].name if 0 <= block < len(blocks) else ''})"


def _run_reason(problem: Any, plan: Any, i: int) -> tuple[list[int], str]:
    """The ops to highlight at run step `i` and why the op runs there."""
    graph, sim = problem.graph, plan.simulate()
    target = plan.program[i][1]
    op, step = graph.ops[target], sim.timeline[i]
    block = _block_words(problem, step.block)
    if op.phase == "forward":
        running = [target]
    else:  # a backward op: highlight the forward ops whose results it reads
        running = [p for v in op.inputs if (p := _forward_producer(graph, v)) is not None]
    consumer = _backward_reader(graph, op)
    price = f"{_ms(op.time)} for {_bytes(op, graph)}"
    if step.recompute:
        why = (
            f"Recompute {_said(graph, op)} of {block}: "
            f"{consumer or 'the backward'} reads it next. It was freed in the forward to "
            f"save memory; running it again costs {price}. "
            + comparison(problem, plan, target, step.block)
        ).strip()
    elif i < plan.backward_start:
        why = (
            f"Forward of {block}: {_said(graph, op)} allocates "
            f"{_bytes(op, graph)}; {_forward_fate(plan, graph, target, consumer, price)}. "
            + comparison(problem, plan, target, step.block)
        ).strip()
    else:
        why = (
            f"Backward of {block}: {_said(graph, op)} computes "
            f"gradients from the activations it reads (highlighted)."
        )
    return running, why


def _forward_fate(plan: Any, graph: Any, target: int, consumer: str | None, price: str) -> str:
    """What the plan does with forward op `target`'s results, and why."""
    sim = plan.simulate()
    kept = any(v in sim.live_after(plan.backward_start - 1) for v in graph.ops[target].outputs)
    runs = sum(1 for k, t in plan.program if k == "run" and t == target)
    if consumer is None:
        return "freed after its last use in the forward: no backward op reads it"
    if sim.fates().get(target) == "offloaded":
        return (
            f"offloaded: {consumer} in the backward reads it; the plan parks it in host "
            f"memory and brings it back, rather than keep it or recompute it ({price})"
        )
    if kept:
        return f"kept: {consumer} in the backward reads it; recomputing it would cost {price}"
    if runs > 1:
        return (
            f"freed: {consumer} in the backward reads it, and the plan recomputes it "
            f"there ({price}) rather than keep it through the forward"
        )
    return f"freed: {consumer} reads values recomputed from it later"


# ------------------------------------------------------------------ transfers


def link_text(problem: Any) -> str:
    """The host link the plan's copies are timed with, in words: the device preset it comes
    from and its bandwidth each way."""
    link, device = problem.link, problem.cost_model.partition(":")[2]
    where = f"the {device} preset's" if device in DEVICE_SPECS else "an assumed PCIe 4 x16"
    return (
        f"host link: {where}, device→host {link.d2h / 1e9:g} GB/s, "
        f"host→device {link.h2d / 1e9:g} GB/s"
    )


def transfer_reason(problem: Any, plan: Any, i: int) -> str:
    """Why program step `i` (an offload or a prefetch) is there, from the plan and its
    simulation: the value's bytes, the time to run its producer again against the time of
    its two copies, whether the device is rid of it at the peak, and whether the copy back
    hid behind compute or stalled it."""
    graph, sim, link = problem.graph, plan.simulate(), problem.link
    kind, v = plan.program[i]
    value, end = graph.values[v], len(plan.program)
    copies = [t for t in sim.transfers if t.value == v]
    off = [t for t in copies if t.kind == OFFLOAD and t.step <= i][-1]
    back = next((t for t in copies if t.kind == PREFETCH and t.step > off.step), None)
    reader = _reader_after(plan, graph, v, back.step) if back is not None else None
    reader_name = graph.ops[plan.program[reader][1]].name if reader is not None else "the backward"
    late = 0.0  # seconds the reader waited for this copy back
    for step, ready, started in sim.waits:
        if back is not None and step == reader:
            late = max(0.0, min(started, back.end) - ready)
    out_s, in_s = value.nbytes / link.d2h, value.nbytes / link.h2d
    if kind == OFFLOAD:
        head = (
            f"Offload {value.name} ({value.kind}, {fmt_bytes(value.nbytes)}): a copy to host "
            f"memory starts on the transfer lane ({_ms(out_s)} at {link.d2h / 1e9:g} GB/s); its "
            f"device memory is released once the copy is done, and it comes back before "
            f"{reader_name} reads it."
        )
    else:
        head = (
            f"Prefetch {value.name} ({fmt_bytes(value.nbytes)}) back from host memory for "
            f"{reader_name}: {_ms(in_s)} at {link.h2d / 1e9:g} GB/s on the transfer lane."
        )
    producer = graph.ops[value.producer] if value.producer is not None else None
    if producer is not None and producer.phase == "forward":
        why = (
            f"Why offload rather than recompute: running {_said(graph, producer)} "
            f"again would add {_ms(producer.time)} to the compute lane, while the copies out "
            f"and back take {_ms(out_s + in_s)} on the transfer lane, beside compute"
        )
    else:
        why = f"Why offload: the copies out and back take {_ms(out_s + in_s)} on the transfer lane"
    if back is None:
        hidden = "."
    elif late > 0:
        hidden = (
            f"; here the copy back arrives late and {reader_name} waits {_ms(late)} for it "
            "(a stall, counted in the step's time)."
        )
    else:
        hidden = (
            f"; the copy back is done before {reader_name} needs it, so they cost no time: "
            "they hide behind compute."
        )
    away_from = off.release if off.release >= 0 else end
    away_until = back.step if back is not None else end
    at_peak = (
        f" The device is rid of its {fmt_bytes(value.nbytes)} across this plan's peak "
        f"(step {sim.peak_step + 1})."
        if away_from <= sim.peak_step < away_until
        else ""
    )
    return f"{head} {why}{hidden}{at_peak}"


def _reader_after(plan: Any, graph: Any, v: int, start: int) -> int | None:
    """The first program step from `start` on that runs an op reading value `v`."""
    program = plan.program
    return next(
        (
            j
            for j in range(start, len(program))
            if program[j][0] == RUN and v in graph.ops[program[j][1]].inputs
        ),
        None,
    )


# ------------------------------------------------------------------ the peak


def peak_hint(timeline: Sequence[Any]) -> str:
    """A sentence when parameter gradients make up most of the peak: then recomputing
    activations can only move the peak a little (conv nets, small batches)."""
    if not timeline:
        return ""
    s = timeline[peak_step(timeline)]
    total = s.activations + s.temporaries + s.gradients
    if not total or s.gradients < total / 2:
        return ""
    return (
        f"At this plan's peak, {fmt_bytes(s.gradients)} of {fmt_bytes(total)} are parameter "
        "gradients: the backward must produce them and the budget counts them, but "
        "recomputing activations cannot shrink them, so lower budgets save little on this model."
    )


def _backward_reader(graph: Any, op: Any) -> str | None:
    """The name of the first backward op that reads one of `op`'s results, if any."""
    readers = [
        c for v in op.outputs for c in graph.values[v].consumers if graph.ops[c].phase == "backward"
    ]
    return op_name(graph, min(readers)).words if readers else None


def _said(graph: Any, op: Any) -> str:
    """An op as the step text names it: module and kind, then ATen op and trace name."""
    return f"{op_name(graph, op.index).words} ({op.label}, {op.name})"


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.2f} ms" if seconds >= 1e-4 else f"{seconds * 1e6:.0f} µs"


def _bytes(op: Any, graph: Any) -> str:
    return fmt_bytes(sum(graph.values[v].nbytes for v in op.outputs))
