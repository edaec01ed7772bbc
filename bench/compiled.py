"""`remat bench --compiled`: our native plan compiled with inductor against compiled eager at
the same measured peak.

Per model and budget: Rockmate's plan at that fraction of the store-all peak (its minimum when
below), applied with `runtime="native"` to a copy of the model sharing its parameters and
compiled with inductor. Its peak is measured from the CPU allocator's profile (inductor's
buffers are past the dispatcher). Then `torch._functorch.config.activation_memory_budget` of
compiled eager is searched (bisection: a larger budget saves more) for the value whose
measured peak is nearest ours. The peak is not monotone in the budget, so every budget tried
is kept and the nearest wins. Times: `reps` rounds, in each compiled eager at that budget,
compiled eager without a budget and our compiled step, in alternating order; ratios are
paired within a round, medians reported. One thread throughout (`bench_settings`).

Also per plan: graph breaks of the native-planned model (`torch._dynamo.explain`) and its
gradients against compiled eager's (bit-equal where inductor's kernels are the same) and plain
eager's (inductor's fused kernels sum in another order: a max difference).
"""

from __future__ import annotations

import argparse
import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
from torch import nn

import core
import sample_models
from bench.measure import Runner, bench_settings, bit_equal, grad_error
from bench.strategies import StepFn, _compile_backend, _eager_step, shared_copy
from core import fmt_bytes, minimum_budget

DEFAULT_MODELS = ("gpt-tiny", "gpt-small-6l")
METHOD = "rockmate"


@dataclass
class Compared:
    """Our compiled native step against compiled eager at the budget matching its peak."""

    model: str
    budget: str  # ours, asked
    peak: int  # ours compiled, measured (allocator profile)
    graph_breaks: int
    graphs: int
    eager_budget: float  # activation_memory_budget found
    eager_peak: int  # compiled eager at that budget
    tried: list[tuple[float, int]]  # (budget, peak) of every compile of the search
    grads_equal_compiled: bool  # torch.equal to compiled eager without a budget
    error_vs_eager: float  # max abs difference from plain eager's gradients
    error_vs_budget: float  # ... from compiled eager's at the found budget
    ratios: list[float] = field(default_factory=list)  # ours / compiled eager at the budget
    ratios_plain: list[float] = field(default_factory=list)  # ours / compiled eager, no budget
    times: list[float] = field(default_factory=list)  # ours, seconds

    def line(self) -> str:
        ratio = statistics.median(self.ratios) if self.ratios else float("nan")
        plain = statistics.median(self.ratios_plain) if self.ratios_plain else float("nan")
        ms = statistics.median(self.times) * 1e3 if self.times else float("nan")
        return (
            f"{self.model:<13} {self.budget:<10} {fmt_bytes(self.peak):>10} "
            f"{self.eager_budget:>7.3f} {fmt_bytes(self.eager_peak):>10} "
            f"{self.eager_peak / self.peak:>6.3f} {ms:>8.1f} {ratio:>7.3f} {plain:>7.3f} "
            f"{self.graph_breaks:>6} {'yes' if self.grads_equal_compiled else 'NO':>5} "
            f"{self.error_vs_eager:>8.1e} {self.error_vs_budget:>8.1e}"
        )


HEADER = (
    f"{'model':<13} {'ours at':<10} {'peak':>10} {'budget':>7} {'its peak':>10} "
    f"{'peak/':>6} {'ours ms':>8} {'ratio':>7} {'vs 1.0':>7} {'breaks':>6} {'equal':>5} "
    f"{'vs eager':>8} {'vs budg.':>8}"
)


def _plans(problem: core.Problem, fractions: Sequence[float]) -> dict[str, core.Plan]:
    """METHOD's plan at each fraction of the store-all peak (its minimum when below)."""
    low = minimum_budget(problem, METHOD)
    plans: dict[str, core.Plan] = {}
    for f in fractions:
        asked = int(f * problem.store_all_peak)
        label = f"{f:.0%}" if asked >= low else f"min {low / problem.store_all_peak:.0%}"
        plans.setdefault(label, core.solve(problem, max(asked, low), METHOD))
    return plans


def _compiled_eager(model: nn.Module, budget: float | None) -> StepFn:
    """Inductor on a shared copy of the model, with `activation_memory_budget` when given."""
    backend = "inductor" if budget is None else _compile_backend("inductor", budget)
    return _eager_step(torch.compile(shared_copy(model), backend=backend))


def search_budget(
    peak_at: Callable[[float], int], target: int, steps: int
) -> tuple[float, int, list[tuple[float, int]]]:
    """The budget whose peak is nearest `target` among `steps` bisection steps on (0, 1]
    (1.0 tried first): (budget, its peak, every (budget, peak) tried)."""
    tried = [(1.0, peak_at(1.0))]
    lo, hi = 0.0, 1.0
    for _ in range(steps):
        mid = (lo + hi) / 2
        peak = peak_at(mid)
        tried.append((mid, peak))
        if peak > target:
            hi = mid
        else:
            lo = mid
    best = min(tried, key=lambda t: (abs(t[1] - target), t[1] > target))
    return best[0], best[1], tried


def compare_model(
    name: str,
    fractions: Sequence[float] = (0.5,),
    reps: int = 7,
    steps: int = 5,
    log: Callable[[str], None] = print,
) -> list[Compared]:
    """Every fraction's comparison on sample model `name` (call inside `bench_settings`)."""
    import torch._dynamo as dynamo

    dynamo.reset()
    model, inputs = sample_models.build(name)
    runner = Runner(model, inputs)
    problem = core.analyze(model, inputs, costs="measured", name=name)
    eager_grads = runner.grads(_eager_step(model))
    plain = _compiled_eager(model, None)
    plain_grads = runner.grads(plain)
    out = []
    peaks: dict[float, int] = {}  # compiled eager's peak at each budget tried, for every plan

    def peak_at(budget: float) -> int:
        if budget not in peaks:
            step = _compiled_eager(model, budget)
            runner.grads(step)  # compiles
            peaks[budget] = runner.peak(step, "profiler")
        return peaks[budget]

    for label, plan in _plans(problem, fractions).items():
        native = core.apply_plan(shared_copy(model), plan, runtime="native")
        explained = dynamo.explain(native)(*inputs)
        ours = _eager_step(torch.compile(native, backend="inductor"))
        grads = runner.grads(ours)
        peak = runner.peak(ours, "profiler")
        log(f"{name} {label}: ours compiled peak {fmt_bytes(peak)}; searching the budget")

        budget, eager_peak, tried = search_budget(peak_at, peak, steps)
        log(f"{name} {label}: budget {budget:.3f} peak {fmt_bytes(eager_peak)}; tried {tried}")
        rival = _compiled_eager(model, budget)
        row = Compared(
            name,
            label,
            peak,
            explained.graph_break_count,
            explained.graph_count,
            budget,
            eager_peak,
            tried,
            bit_equal(grads, plain_grads),
            grad_error(grads, eager_grads)[0],
            grad_error(grads, runner.grads(rival))[0],
        )
        _time(runner, ours, rival, plain, reps, row)
        out.append(row)
    return out


def _time(runner: Runner, ours: StepFn, rival: StepFn, plain: StepFn, reps: int, row: Compared):
    """`reps` rounds of the three steps, alternating their order; ratios paired per round."""
    for rep in range(reps):
        order = [ours, rival, plain] if rep % 2 else [rival, plain, ours]
        times = {id(step): runner.time(step) for step in order}
        row.times.append(times[id(ours)])
        row.ratios.append(times[id(ours)] / times[id(rival)])
        row.ratios_plain.append(times[id(ours)] / times[id(plain)])


def main(argv: list[str] | None = None) -> int:
    """Print one line per model and budget."""
    p = argparse.ArgumentParser(prog="remat bench --compiled", description=__doc__)
    p.add_argument("--models", default=",".join(DEFAULT_MODELS))
    p.add_argument("--budgets", default="0.5", help="fractions of the store-all peak")
    p.add_argument("--reps", type=int, default=7)
    p.add_argument("--steps", type=int, default=5, help="bisection steps of the budget search")
    args = p.parse_args(argv)
    try:
        fractions = [float(b) for b in args.budgets.split(",")]
    except ValueError:
        p.error(f"--budgets takes fractions like 0.5,0.25; got {args.budgets!r}")
    if args.reps < 1 or args.steps < 1 or not all(0 < f <= 1 for f in fractions):
        p.error("--reps and --steps at least 1; --budgets fractions in (0, 1]")
    unknown = [m for m in args.models.split(",") if m not in sample_models.REGISTRY]
    if unknown:
        p.error(f"unknown sample models {unknown}; valid: {', '.join(sample_models.names())}")
    rows: list[Compared] = []
    with bench_settings():
        for name in args.models.split(","):
            rows += compare_model(name, fractions, args.reps, args.steps)
    print(
        f"ours: {METHOD} native plan compiled with inductor; budget: compiled eager's "
        "activation_memory_budget whose peak is nearest ours; ratio: ours / compiled eager at "
        "that budget, vs 1.0: / compiled eager without a budget (paired, medians, 1 thread); "
        "equal: gradients torch.equal to compiled eager's; vs eager / vs budg.: max gradient "
        "difference from plain eager's and from compiled eager's at the budget"
    )
    print(HEADER)
    for row in rows:
        print(row.line())
    return 0
