"""The memory/time trade-off of a method, for the app's chart and `remat bench --solvers`."""

from __future__ import annotations

import os
import statistics
import time
from dataclasses import dataclass
from unittest import mock

from core.errors import InfeasibleBudget
from core.problem import Problem
from core.schedule import Plan
from core.solvers import rockmate, solve
from core.solvers.rotor import chain_minimum


@dataclass(frozen=True)
class TradeoffPoint:
    budget: int  # bytes asked
    predicted_peak: int  # bytes the chosen plan peaks at (never above budget)
    overhead: float  # predicted time over store-all time


def minimum_budget(problem: Problem, method: str = "rockmate") -> int:
    """The smallest budget (bytes) `method` can meet on this problem."""
    if method == "rockmate":
        return rockmate.minimum(problem)
    if method == "rotor":
        return chain_minimum(problem, False)
    try:
        return solve(problem, 1, method).predicted_peak
    except InfeasibleBudget as e:
        return e.minimum


def tradeoff(problem: Problem, method: str = "rockmate", points: int = 24) -> list[TradeoffPoint]:
    """Evenly spaced budgets from the method's minimum to the store-all peak; at each, the
    fastest plan found at or below it, so the predicted time never rises with the budget."""
    low, high = minimum_budget(problem, method), problem.store_all_peak
    budgets = sorted({low + (high - low) * i // max(points - 1, 1) for i in range(points)})
    out: list[TradeoffPoint] = []
    best: Plan | None = None
    for b in budgets:
        try:
            plan = solve(problem, b, method)
        except InfeasibleBudget:
            plan = None
        if plan is not None and (best is None or plan.predicted_time < best.predicted_time):
            best = plan
        if best is not None:
            out.append(TradeoffPoint(b, best.predicted_peak, best.overhead))
    return out


def bench_solvers(
    models: tuple[str, ...] = ("gpt-1layer", "gpt-tiny", "gpt-small-6l"),
    fractions: tuple[float, ...] = (0.8, 0.6, 0.5, 0.4, 0.3),
    methods: tuple[str, ...] = ("checkpoint_blocks", "sqrt_n", "rotor", "rockmate"),
    reference_models: tuple[str, ...] = ("mlp-batch", "gpt-1layer"),
    reference_seconds: float = 30.0,
    large_reference: tuple[tuple[str, float], ...] = (("gpt-tiny", 0.5), ("gpt-small-6l", 0.5)),
    large_seconds: float = 120.0,
) -> str:
    """A printed table: per model, analysis and option time, each method's overhead at each
    budget and the median time of a new budget (table read + program + simulation); then
    Rockmate against the whole-graph ILP on graphs small enough for it, and against its
    incumbent and lower bound after `large_seconds` on larger ones; then gpt2-small's
    solver speed (analysed from the meta device: no weights are built). Block options are
    computed cold: the on-disk and in-memory option caches are off for the benchmark."""
    import torch

    import core
    from core.solvers import checkmate, options, solve
    from sample_models import REGISTRY, build

    with mock.patch.dict(os.environ, {"REMAT_CACHE": "off"}):  # options computed cold
        options.clear_memory_cache()
        lines = []
        for name in models:
            model, inputs = build(name)
            start = time.perf_counter()
            problem = core.analyze(model, inputs)
            analysed = time.perf_counter() - start
            minimum_budget(problem, "rockmate")
            prepared = time.perf_counter() - start
            lines.append(
                f"{name}: analyze {analysed:.2f} s, + block options and Rotor table {prepared:.2f} s, "
                f"store-all peak {problem.store_all_peak / 2**20:.2f} MiB"
            )
            lines.append(
                "  method             " + "".join(f"{f:>8.0%}" for f in fractions) + "   min"
            )
            for method in methods:
                cells = []
                for f in fractions:
                    try:
                        cells.append(f"{solve(problem, f, method).overhead:8.3f}")
                    except InfeasibleBudget:
                        cells.append(f"{'-':>8}")
                low = minimum_budget(problem, method) / problem.store_all_peak
                lines.append(f"  {method:<18} " + "".join(cells) + f"  {low:5.1%}")
            lines.append(f"  rockmate new budget: median {_new_budget_ms(problem):.1f} ms")

        lines.append(
            f"Rockmate against the whole-graph ILP (restricted Checkmate form, HiGHS, "
            f"{reference_seconds:.0f} s limit; * = limit hit, best schedule found, with the ILP's "
            "lower bound)"
        )
        for name in reference_models:
            model, inputs = build(name)
            problem = core.analyze(model, inputs)
            cells = []
            for f in (0.8, 0.7, 0.6, 0.55, 0.5, 0.4):
                try:
                    ours = solve(problem, f, "rockmate").overhead
                except InfeasibleBudget:
                    cells.append(f"{f:.0%}: -")
                    continue
                budget = int(f * problem.store_all_peak)
                try:
                    ref = checkmate.solve_with_bound(problem, budget, time_limit=reference_seconds)
                except InfeasibleBudget:
                    cells.append(f"{f:.0%}: {ours:.3f} vs ILP none")
                    continue
                cells.append(f"{f:.0%}: {ours:.3f} vs {_reference(*ref)}")
            lines.append(f"  {name}: " + ", ".join(cells))
        for name, f in large_reference:
            model, inputs = build(name)
            problem = core.analyze(model, inputs)
            ours = solve(problem, f, "rockmate").overhead
            budget = int(f * problem.store_all_peak)
            try:
                ref = _reference(
                    *checkmate.solve_with_bound(problem, budget, time_limit=large_seconds)
                )
            except InfeasibleBudget:
                ref = "none found"
            lines.append(f"  {name} at {f:.0%}, ILP {large_seconds:.0f} s: {ours:.3f} vs {ref}")

        preset = REGISTRY["gpt2-small"]
        with torch.device("meta"):
            model, inputs = preset.make_model(), preset.make_inputs()
        start = time.perf_counter()
        problem = core.analyze(model, inputs)
        analysed = time.perf_counter() - start
        minimum_budget(problem, "rockmate")
        prepared = time.perf_counter() - start
        half = solve(problem, 0.5, "rockmate").overhead
        lines.append(
            f"gpt2-small: analyze {analysed:.2f} s, + block options and Rotor table {prepared:.2f} s; "
            f"rockmate at 50%: {half:.3f}; new budget: median {_new_budget_ms(problem):.1f} ms"
        )
        return "\n".join(lines)


def _reference(plan: Plan, bound: float | None) -> str:
    """The whole-graph ILP's overhead, starred with its lower bound when time ran out."""
    if not plan.notes:
        return f"{plan.overhead:.3f}"
    return f"{plan.overhead:.3f}* (bound {bound:.3f})" if bound else f"{plan.overhead:.3f}*"


def _new_budget_ms(problem: Problem) -> float:
    """Median milliseconds to solve 11 budgets spread over the feasible range."""
    times = []
    low = minimum_budget(problem, "rockmate")
    for i in range(11):
        b = low + (problem.store_all_peak - low) * (2 * i + 1) // 23
        t = time.perf_counter()
        solve(problem, b, "rockmate")
        times.append(time.perf_counter() - t)
    return statistics.median(times) * 1e3
