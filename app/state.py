"""The app's view of `core`: which models and methods exist, and cached problems and plans.

All planning is `core.analyze` / `core.solve` / `core.tradeoff`; this module only caches their
results (see `app.cache`) and reads plans back as plain numbers for the figures.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

import core
import sample_models
from app.cache import DERIVED, LRU, PLANS, PROBLEMS, check_cancelled
from app.figures import FATE_TEXT
from core.costs import DEVICES as DEVICE_SPECS
from core.errors import fmt_bytes
from core.frontier import minimum_budget
from core.simulator import OFFLOAD, PREFETCH, RUN
from core.solvers import available_methods
from core.trace.model_call import ModelCall, as_call, resolve_builder

DEFAULT_MODEL = "gpt-tiny"
BASELINES = ("store_all", "checkpoint_blocks", "sqrt_n")
CHECKMATE_MAX_OPS = (
    60  # whole-graph ILPs solve in about a second up to here (gpt-tiny, 131 ops: 60 s a budget)
)
METHOD_LABELS = {
    "rockmate": "Rockmate (block ILPs + chain DP)",
    "rotor": "Rotor (chain DP)",
    "checkmate": "Checkmate (whole-graph ILP)",
    "store_all": "Store all (plain PyTorch)",
    "checkpoint_blocks": "Checkpoint every block",
    "sqrt_n": "√n checkpoints (Chen et al.)",
    "offload": "remat + offload (Rockmate, then greedy offloads)",
    "pofo": "remat + offload (POFO chain DP)",
}
DEVICES = ("cpu", "a100", "h100", "v100", "rtx4090")
# Methods that also offload: the offload switch re-solves with one of them (the Studio's
# `offload_method`), so the method list offers only remat methods.
OFFLOAD_METHODS = ("offload", "pofo")
DEFAULT_OFFLOAD = "offload"
OFFLOAD_POINTS = 8  # budgets of the remat+offload curve (an offload solve each: seconds)

# Tracing patches process-wide state (make_fx's patcher, fake modes): two analyses in two
# threads at once failed with "CURRENT_PATCHER is None". One analysis (or measured run, whose
# dispatch mode must not see a trace) at a time.
_ANALYZE = threading.Lock()


def studio_lock() -> threading.Lock:
    """The lock analyses and measured runs take: one at a time in this process."""
    return _ANALYZE


@dataclass(frozen=True)
class Point:
    budget: int
    peak: int
    overhead: float  # predicted time / store-all time


class Studio:
    """Models the page can open, and what has been computed for them. `offload_method` is
    the solver the offload switch re-solves with."""

    def __init__(
        self,
        extra_models: dict[str, Callable] | None = None,
        offload_method: str = DEFAULT_OFFLOAD,
    ) -> None:
        if offload_method not in OFFLOAD_METHODS or offload_method not in available_methods():
            known = [m for m in OFFLOAD_METHODS if m in available_methods()]
            raise ValueError(
                f"the offload switch needs an offloading method, not {offload_method!r}: "
                f"choose one of {', '.join(known)}"
            )
        self.offload_method = offload_method
        self.builders: dict[str, Callable[[], ModelCall]] = {
            name: resolve_builder(name) for name in sample_models.names()
        }
        for name, build in (extra_models or {}).items():  # (model, inputs) or a ModelCall
            self.builders[name] = partial(_called, build, name)
        self.problems = LRU(PROBLEMS)
        self.plans = LRU(PLANS)
        self.derived = LRU(DERIVED)

    # -------------------------------------------------------------- problems

    @staticmethod
    def key(model: str, costs: str, device: str) -> str:
        return "|".join((model, costs, "here" if costs == "measured" else device))

    def describe(self, model: str) -> str:
        try:
            return sample_models.describe(model)
        except KeyError:
            return model

    def problem(self, key: str, progress: Callable[[str, float], None] | None = None):
        """The analysed problem for `key` (cached; analysed on a miss, with `progress`)."""

        def make():
            model_name, costs, device = key.split("|")
            if model_name not in self.builders:
                raise KeyError(f"unknown model {model_name!r}")
            report = progress or (lambda stage, frac: None)
            report("building the model", 0.0)
            call = self.builders[model_name]()
            report("waiting for another analysis to finish", 0.1)

            def tick(stage: str, frac: float) -> None:  # the analysis is 10-100%
                check_cancelled()
                report(stage, 0.1 + 0.9 * frac)

            with _ANALYZE:
                check_cancelled()
                return call.analyze(
                    costs=costs,
                    device="cpu" if device == "here" else device,
                    name=model_name,
                    progress=tick,
                )

        return self.problems.get_or_make(key, make)

    # -------------------------------------------------------------- methods

    def methods(self, problem) -> list[str]:
        """Remat methods offered for this problem (offloading ones are the switch's):
        whole-graph Checkmate only on small graphs."""
        out = []
        for m in available_methods():
            if m == "checkmate" and len(problem.graph.ops) >= CHECKMATE_MAX_OPS:
                continue
            if m in OFFLOAD_METHODS:
                continue
            out.append(m)
        order = ["rockmate", "rotor", "checkmate", *BASELINES]
        return sorted(out, key=lambda m: order.index(m) if m in order else len(order))

    @staticmethod
    def default_method() -> str:
        methods = available_methods()
        for m in ("rockmate", "rotor", "checkpoint_blocks"):
            if m in methods:
                return m
        return methods[0]

    # -------------------------------------------------------------- plans

    def plan(self, key: str, method: str, budget: int):
        """`core.solve` for (problem, method, budget bytes), cached. Raises InfeasibleBudget."""
        problem = self.problem(key)
        return self.plans.get_or_make(
            (key, method, int(budget)), lambda: core.solve(problem, int(budget), method)
        )

    def minimum(self, key: str, method: str) -> int:
        """Smallest budget (bytes) `method` fits."""
        return self.derived.get_or_make(
            ("minimum", key, method), lambda: minimum_budget(self.problem(key), method)
        )

    def tradeoff(self, key: str, method: str) -> list[Point]:
        """Points (budget, predicted peak, overhead) of `method`, from `core.tradeoff`."""

        def make() -> list[Point]:
            points = core.tradeoff(self.problem(key), method)
            return [Point(p.budget, p.predicted_peak, p.overhead) for p in points]

        return self.derived.get_or_make(("tradeoff", key, method), make)

    def offload_tradeoff(
        self, key: str, progress: Callable[[float], None] | None = None
    ) -> list[Point]:
        """The remat+offload curve: `core.tradeoff` with the offload method, `OFFLOAD_POINTS`
        budgets from its minimum (bisected) to the peak. Cached; seconds to compute."""

        def make() -> list[Point]:
            def step(fraction: float) -> None:
                check_cancelled()
                if progress:
                    progress(fraction)

            problem = self.problem(key)
            points = core.tradeoff(problem, self.offload_method, OFFLOAD_POINTS, step)
            return [Point(p.budget, p.predicted_peak, p.overhead) for p in points]

        return self.derived.get_or_make(("offload-tradeoff", key, self.offload_method), make)

    def tensors(self, key: str, method: str, budget: int) -> list[dict]:
        """The per-tensor view's rows for a plan (cached: the view and the peak list share it)."""

        def make() -> list[dict]:
            problem, plan = self.problem(key), self.plan(key, method, budget)
            return tensor_rows(problem, plan, live_bands(problem, plan))

        return self.derived.get_or_make(("tensors", key, method, int(budget)), make)


# ------------------------------------------------------------------ reading a plan back


def op_fates(problem, plan) -> dict[str, list[int]]:
    """Forward ops grouped by the simulator's fate: kept until the backward, recomputed in
    the backward, offloaded to host memory and brought back, or freed (the backward never
    needs them)."""
    fates: dict[str, list[int]] = {"kept": [], "recomputed": [], "offloaded": [], "freed": []}
    for o, fate in plan.simulate().fates().items():
        fates[fate].append(o)
    return fates


@dataclass(frozen=True)
class Band:
    """One storage alive over program steps [start, end) (end = len(program): to the end)."""

    value: int
    start: int
    end: int


def live_bands(problem, plan) -> list[Band]:
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


def tensor_rows(problem, plan, bands: list[Band]) -> list[dict]:
    """What the per-tensor view draws and says about each band: bytes, and in words the
    storage, the op, module path and source line that made it, and the plan's choice."""
    graph = problem.graph
    fate_of: dict[int, str] = {}
    for fate, ops in op_fates(problem, plan).items():
        fate_of.update(dict.fromkeys(ops, fate))
    rows = []
    for b in bands:
        value = graph.values[b.value]
        op = graph.ops[value.producer]
        node = graph.trace.nodes[op.nodes[0]]
        where = node.module or ("the backward" if op.phase == "backward" else "the model")
        fate = fate_of.get(op.index)
        text = (
            f"<b>{value.name}</b> · {value.kind} · {_fmt(value.nbytes)}<br>"
            f"made by {op.name} ({op.label}) in {where}"
            + (f"<br>{_html(node.source)}" if node.source else "")
            + (f"<br>{FATE_TEXT[fate]}" if fate else "")
            + f"<br>alive at steps {b.start + 1}–{b.end}"
        )
        rows.append(
            {
                "start": b.start,
                "end": b.end,
                "nbytes": value.nbytes,
                "name": value.name,
                "kind": value.kind,
                "fate": fate or value.kind,
                "text": text,
            }
        )
    return rows


def alive_at(rows: list[dict], step: int) -> list[dict]:
    """The rows alive after program step `step`, largest first."""
    return sorted((r for r in rows if r["start"] <= step < r["end"]), key=lambda r: -r["nbytes"])


def _html(text: str) -> str:
    return text.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")


def step_view(problem, plan, i: int) -> dict:
    """What the step-through shows at program step `i`: the op(s) to highlight, the forward
    ops whose results are alive, the block, and one sentence saying why the step happens."""
    graph = problem.graph
    kind, target = plan.program[i]
    sim = plan.simulate()
    live = sim.live_after(i)
    fwd_producers = {
        graph.values[v].producer
        for v in live
        if graph.values[v].producer is not None
        and graph.ops[graph.values[v].producer].phase == "forward"
    }
    blocks = problem.blocks
    step = sim.timeline[i]
    block = step.block
    bname = blocks[block].name if 0 <= block < len(blocks) else ""
    running: list[int] = []
    if kind == "run":
        op = graph.ops[target]
        ran_before = step.recompute
        if op.phase == "forward":
            running = [target]
        else:  # a backward op: highlight the forward ops whose results it reads
            running = [
                graph.values[v].producer
                for v in op.inputs
                if graph.values[v].producer is not None
                and graph.ops[graph.values[v].producer].phase == "forward"
            ]
        consumer = _backward_reader(graph, op)
        price = f"{_ms(op.time)} for {_bytes(op, graph)}"
        if ran_before:
            why = (
                f"Recompute {op.label} ({op.name}) of block {block} ({bname}): "
                f"{consumer or 'the backward'} reads it next. It was freed in the forward to "
                f"save memory; running it again costs {price}."
            )
        elif i < plan.backward_start:
            outs = op.outputs
            kept = any(v in sim.live_after(plan.backward_start - 1) for v in outs)
            runs = sum(1 for k, t in plan.program if k == "run" and t == target)
            if consumer is None:
                fate = "freed after its last use in the forward: no backward op reads it"
            elif sim.fates().get(target) == "offloaded":
                fate = (
                    f"offloaded: {consumer} in the backward reads it; the plan parks it in host "
                    f"memory and brings it back, rather than keep it or recompute it ({price})"
                )
            elif kept:
                fate = (
                    f"kept: {consumer} in the backward reads it; recomputing it would cost {price}"
                )
            elif runs > 1:
                fate = (
                    f"freed: {consumer} in the backward reads it, and the plan recomputes it "
                    f"there ({price}) rather than keep it through the forward"
                )
            else:
                fate = f"freed: {consumer} reads values recomputed from it later"
            why = (
                f"Forward of block {block} ({bname}): {op.label} ({op.name}) allocates "
                f"{_bytes(op, graph)}; {fate}."
            )
        else:
            why = (
                f"Backward of block {block} ({bname}): {op.label} ({op.name}) computes "
                f"gradients from the activations it reads (highlighted)."
            )
    elif kind in (OFFLOAD, PREFETCH):
        value = graph.values[target]
        producer = graph.ops[value.producer] if value.producer is not None else None
        why = transfer_reason(problem, plan, i)
        if producer is not None and producer.phase == "forward":
            running = [producer.index]
    else:
        value = graph.values[target]
        later = any(start > i for start, _ in sim.intervals[target])
        why = f"Free {value.name} ({value.kind}, {_fmt(value.nbytes)}): no step needs it until " + (
            "it is recomputed later." if later else "the end of the step."
        )
        if value.producer is not None and graph.ops[value.producer].phase == "forward":
            running = [value.producer]
    return {
        "running": sorted(o for o in set(running) if o is not None),
        "live": sorted(o for o in fwd_producers if o is not None),
        "block": block,
        "why": why,
        "label": f"step {i + 1} of {len(plan.program)} · {step.phase}",
    }


def link_text(problem) -> str:
    """The host link the plan's copies are timed with, in words: the device preset it comes
    from and its bandwidth each way."""
    link, device = problem.link, problem.cost_model.partition(":")[2]
    where = f"the {device} preset's" if device in DEVICE_SPECS else "an assumed PCIe 4 x16"
    return (
        f"host link: {where}, device→host {link.d2h / 1e9:g} GB/s, "
        f"host→device {link.h2d / 1e9:g} GB/s"
    )


def transfer_reason(problem, plan, i: int) -> str:
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
    reader = None
    if back is not None:
        reader = next(
            (
                j
                for j in range(back.step, end)
                if plan.program[j][0] == RUN and v in graph.ops[plan.program[j][1]].inputs
            ),
            None,
        )
    reader_name = graph.ops[plan.program[reader][1]].name if reader is not None else "the backward"
    late = 0.0  # seconds the reader waited for this copy back
    for step, ready, started in sim.waits:
        if back is not None and step == reader:
            late = max(0.0, min(started, back.end) - ready)
    out_s, in_s = value.nbytes / link.d2h, value.nbytes / link.h2d
    if kind == OFFLOAD:
        head = (
            f"Offload {value.name} ({value.kind}, {_fmt(value.nbytes)}): a copy to host memory "
            f"starts on the transfer lane ({_ms(out_s)} at {link.d2h / 1e9:g} GB/s); its device "
            f"memory is released once the copy is done, and it comes back before {reader_name} "
            "reads it."
        )
    else:
        head = (
            f"Prefetch {value.name} ({_fmt(value.nbytes)}) back from host memory for "
            f"{reader_name}: {_ms(in_s)} at {link.h2d / 1e9:g} GB/s on the transfer lane."
        )
    producer = graph.ops[value.producer] if value.producer is not None else None
    if producer is not None and producer.phase == "forward":
        why = (
            f"Why offload rather than recompute: running {producer.label} ({producer.name}) "
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
        f" The device is rid of its {_fmt(value.nbytes)} across this plan's peak "
        f"(step {sim.peak_step + 1})."
        if away_from <= sim.peak_step < away_until
        else ""
    )
    return f"{head} {why}{hidden}{at_peak}"


def peak_step(timeline) -> int:
    """The program step where live memory is highest (the first, on ties)."""
    totals = [s.activations + s.temporaries + s.gradients for s in timeline]
    return totals.index(max(totals)) if totals else 0


def next_recompute(timeline, step: int | None) -> int | None:
    """The first recomputing step after `step` (wrapping round), or None if none."""
    recomputes = [s.index for s in timeline if s.recompute]
    if not recomputes:
        return None
    return next((i for i in recomputes if step is None or i > step), recomputes[0])


def next_transfer(timeline, step: int | None) -> int | None:
    """The first offload or prefetch step after `step` (wrapping round), or None if none."""
    copies = [s.index for s in timeline if s.kind in (OFFLOAD, PREFETCH)]
    if not copies:
        return None
    return next((i for i in copies if step is None or i > step), copies[0])


def peak_hint(timeline) -> str:
    """A sentence when parameter gradients make up most of the peak: then recomputing
    activations can only move the peak a little (conv nets, small batches)."""
    if not timeline:
        return ""
    s = timeline[peak_step(timeline)]
    total = s.activations + s.temporaries + s.gradients
    if not total or s.gradients < total / 2:
        return ""
    return (
        f"At this plan's peak, {_fmt(s.gradients)} of {_fmt(total)} are parameter gradients: "
        "the backward must produce them and the budget counts them, but recomputing "
        "activations cannot shrink them, so lower budgets save little on this model."
    )


def _backward_reader(graph, op) -> str | None:
    """The name of the first backward op that reads one of `op`'s results, if any."""
    readers = [
        c for v in op.outputs for c in graph.values[v].consumers if graph.ops[c].phase == "backward"
    ]
    return graph.ops[min(readers)].name if readers else None


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.2f} ms" if seconds >= 1e-4 else f"{seconds * 1e6:.0f} µs"


def _bytes(op, graph) -> str:
    return _fmt(sum(graph.values[v].nbytes for v in op.outputs))


def _fmt(n: float) -> str:
    return fmt_bytes(n)


def percent(budget: int, peak: int) -> float:
    return 100.0 * budget / peak if peak else 100.0


def slider_minimum(minimum: int, peak: int, step: float = 0.5) -> float:
    """The slider's lowest % position at or above `minimum` bytes."""
    pct = math.ceil(percent(minimum, peak) / step - 1e-9) * step
    return min(pct, 100.0)


def _called(build: Callable, name: str) -> ModelCall:
    return as_call(build(), name)
