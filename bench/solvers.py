"""`remat bench --solvers`: solver quality and speed on the sample models and on the zoo of
Hugging Face models (`sample_models.hf_zoo`, needs transformers), block options cold."""

from __future__ import annotations

import os
import statistics
import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

import core
from bench import MissingExtra
from core import InfeasibleBudget, Plan, Problem, StorageTracker, minimum_budget, step_tensors
from core.solvers import checkmate, options, solve
from sample_models import REGISTRY, build

if TYPE_CHECKING:
    from sample_models.hf_zoo import ZooCase

EXTRA = "needs transformers: pip install 'remat-studio[bench]'"


@contextmanager
def cold_options() -> Iterator[None]:
    """Block options computed afresh inside: the on-disk cache off (`REMAT_CACHE=off`) and the
    in-memory one cleared; the caller's REMAT_CACHE is restored after."""
    before = os.environ.get("REMAT_CACHE")
    os.environ["REMAT_CACHE"] = "off"
    options.clear_memory_cache()
    try:
        yield
    finally:
        if before is None:
            del os.environ["REMAT_CACHE"]
        else:
            os.environ["REMAT_CACHE"] = before


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
    with cold_options():
        lines = []
        for name in models:
            lines += _method_table(name, fractions, methods)
        lines.append(
            f"Rockmate against the whole-graph ILP (restricted Checkmate form, HiGHS, "
            f"{reference_seconds:.0f} s limit; * = limit hit, best schedule found, with the ILP's "
            "lower bound)"
        )
        lines += [_against_ilp(name, reference_seconds) for name in reference_models]
        lines += [_against_ilp_large(name, f, large_seconds) for name, f in large_reference]
        lines.append(_gpt2_small_speed())
        return "\n".join(lines)


def _method_table(name: str, fractions: tuple[float, ...], methods: tuple[str, ...]) -> list[str]:
    """One sample model: analysis and option time, each method's overhead per budget and its
    minimum, and Rockmate's median time for a new budget."""
    model, inputs = build(name)
    start = time.perf_counter()
    problem = core.analyze(model, inputs)
    analysed = time.perf_counter() - start
    minimum_budget(problem, "rockmate")
    prepared = time.perf_counter() - start
    lines = [
        f"{name}: analyze {analysed:.2f} s, + block options and Rotor table {prepared:.2f} s, "
        f"store-all peak {problem.store_all_peak / 2**20:.2f} MiB",
        "  method             " + "".join(f"{f:>8.0%}" for f in fractions) + "   min",
    ]
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
    return lines


def _against_ilp(name: str, seconds: float) -> str:
    """Rockmate's overhead against the whole-graph ILP's at a range of budgets."""
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
            ref = checkmate.solve_with_bound(problem, budget, time_limit=seconds)
        except InfeasibleBudget:
            cells.append(f"{f:.0%}: {ours:.3f} vs ILP none")
            continue
        cells.append(f"{f:.0%}: {ours:.3f} vs {_reference(*ref)}")
    return f"  {name}: " + ", ".join(cells)


def _against_ilp_large(name: str, f: float, seconds: float) -> str:
    """Rockmate against the ILP's incumbent (and lower bound) after `seconds`, at one budget."""
    model, inputs = build(name)
    problem = core.analyze(model, inputs)
    ours = solve(problem, f, "rockmate").overhead
    budget = int(f * problem.store_all_peak)
    try:
        found = _reference(*checkmate.solve_with_bound(problem, budget, time_limit=seconds))
    except InfeasibleBudget:
        found = "none found"
    return f"  {name} at {f:.0%}, ILP {seconds:.0f} s: {ours:.3f} vs {found}"


def _gpt2_small_speed() -> str:
    """gpt2-small from the meta device (no weights built): analysis, options, Rockmate at 50%
    and the median time of a new budget."""
    preset = REGISTRY["gpt2-small"]
    with torch.device("meta"):
        model, inputs = preset.make_model(), preset.make_inputs()
    start = time.perf_counter()
    problem = core.analyze(model, inputs)
    analysed = time.perf_counter() - start
    minimum_budget(problem, "rockmate")
    prepared = time.perf_counter() - start
    half = solve(problem, 0.5, "rockmate").overhead
    return (
        f"gpt2-small: analyze {analysed:.2f} s, + block options and Rotor table {prepared:.2f} s; "
        f"rockmate at 50%: {half:.3f}; new budget: median {_new_budget_ms(problem):.1f} ms"
    )


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


@dataclass(frozen=True)
class ZooPoint:
    """A Rockmate plan of a zoo model: the budget it was asked (a fraction of the store-all
    peak), its predicted peak (the same fraction) and predicted overhead (time over store-all's)."""

    budget: float
    peak: float
    overhead: float


@dataclass(frozen=True)
class ZooRow:
    """One zoo model in `remat bench --solvers`. `first_solve_s` is the first Rockmate solve,
    at 50% of the store-all peak with cold block options (an infeasible 50% included, which
    finds the minimum); `half` is Rockmate at 50% or, below its minimum, at the minimum.
    Models that run (not on the meta device) have `measured_minus_predicted`: per plan, its
    measured peak minus the predicted one, in bytes (4: backward's scalar seed). Meta-device
    models have `new_budget_ms` instead: the median time of a later budget."""

    name: str
    blocks: int
    kinds: int
    store_all_peak: int
    analyze_s: float
    first_solve_s: float
    half: ZooPoint
    lowest: ZooPoint
    measured_minus_predicted: tuple[int, ...] | None
    new_budget_ms: float | None


def zoo_builders() -> tuple[dict[str, Callable[[], ZooCase]], dict[str, Callable[[], ZooCase]]]:
    """The tiny zoo models and the 12-layer meta-device ones, by name; MissingExtra, naming
    the extra to install, when transformers is not there."""
    try:
        import sample_models.hf_zoo as hf_zoo
    except ModuleNotFoundError as e:
        if e.name != "transformers" and not (e.name or "").startswith("transformers."):
            raise
        raise MissingExtra(f"the zoo of `remat bench --solvers` {EXTRA}") from e
    return hf_zoo.ZOO, hf_zoo.META


def zoo_rows(
    tiny: Mapping[str, Callable[[], ZooCase]], meta: Mapping[str, Callable[[], ZooCase]]
) -> list[ZooRow]:
    """Analyse and solve each model on 1 thread, block options cold; the tiny ones' plans are
    run and their peaks measured, the meta-device ones' later budgets timed."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        rows = [_zoo_row(name, build(), runs=True) for name, build in tiny.items()]
        rows += [_zoo_row(name, build(), runs=False) for name, build in meta.items()]
    finally:
        torch.set_num_threads(threads)
    return rows


def zoo_table(rows: list[ZooRow]) -> str:
    """The rows as two Markdown tables: the models that ran, then the meta-device ones."""

    def point(p: ZooPoint) -> str:
        return f"{p.budget:.0%}: {p.peak:.2f}, {p.overhead:.3f}"

    lines = [
        "Hugging Face zoo (sample_models.hf_zoo; 1 thread, block options cold; peaks are "
        "predicted, as fractions of the store-all peak, at the budget asked)",
        "| model | blocks (kinds) | analyze s | first solve s | Rockmate at 50% or its minimum "
        "| Rockmate minimum | measured - predicted |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        if r.measured_minus_predicted is not None:
            lines.append(
                f"| {r.name} | {r.blocks} ({r.kinds}) | {r.analyze_s:.1f} | {r.first_solve_s:.1f} "
                f"| {point(r.half)} | {point(r.lowest)} | "
                f"{', '.join(str(d) for d in r.measured_minus_predicted)} B |"
            )
    big = [r for r in rows if r.new_budget_ms is not None]
    if big:
        lines += [
            "",
            "| model (meta device) | blocks (kinds) | store-all peak | analyze s | first solve s "
            "| later budget median ms | Rockmate at 50% or its minimum | Rockmate minimum |",
            "|---|---|---|---|---|---|---|---|",
        ]
        lines += [
            f"| {r.name} | {r.blocks} ({r.kinds}) | {r.store_all_peak / 2**30:.2f} GiB "
            f"| {r.analyze_s:.1f} | {r.first_solve_s:.1f} | {r.new_budget_ms:.0f} "
            f"| {point(r.half)} | {point(r.lowest)} |"
            for r in big
        ]
    return "\n".join(lines)


def bench_zoo() -> str:
    """`remat bench --solvers`'s zoo part: every tiny zoo model and the 12-layer GPT-2 and
    Llama from the meta device. MissingExtra without transformers."""
    tiny, meta = zoo_builders()
    return zoo_table(zoo_rows(tiny, meta))


def _zoo_row(name: str, case: ZooCase, runs: bool) -> ZooRow:
    """Analyse `case`, solve Rockmate at 50% (cold) and at its minimum; run the plans when
    `runs`, else time later budgets."""
    with cold_options():
        start = time.perf_counter()
        problem = core.analyze(case.model, case.args, case.kwargs, case.loss_fn, case.targets)
        analysed = time.perf_counter()
        try:
            plans = [solve(problem, 0.5, "rockmate")]
        except InfeasibleBudget:
            plans = []
        solved = time.perf_counter()
        lowest = minimum_budget(problem, "rockmate")
        plans.append(solve(problem, lowest, "rockmate"))
        points = [_point(problem, p) for p in plans]
        return ZooRow(
            name=name,
            blocks=len(problem.blocks),
            kinds=len({b.kind for b in problem.blocks}),
            store_all_peak=problem.store_all_peak,
            analyze_s=analysed - start,
            first_solve_s=solved - analysed,
            half=points[0],
            lowest=points[-1],
            measured_minus_predicted=tuple(_measured(case, p) - p.predicted_peak for p in plans)
            if runs
            else None,
            new_budget_ms=None if runs else _new_budget_ms(problem),
        )


def _point(problem: Problem, plan: Plan) -> ZooPoint:
    peak = problem.store_all_peak
    return ZooPoint(plan.budget / peak, plan.predicted_peak / peak, plan.overhead)


def _measured(case: ZooCase, plan: Plan) -> int:
    """The measured peak of one training step of `plan` (beyond parameters, buffers and inputs)."""
    given = [x for x in (*case.args, *case.kwargs.values(), *case.targets) if torch.is_tensor(x)]
    run = core.apply_plan(case.model, plan)
    case.model.zero_grad(set_to_none=True)
    with StorageTracker(step_tensors(case.model, given)) as tracker:
        run(*case.args, **case.kwargs, targets=case.targets).backward()
    case.model.zero_grad(set_to_none=True)
    return tracker.peak
