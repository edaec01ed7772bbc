"""`remat bench`: real training steps, side by side with PyTorch's own ways to save memory.

Every strategy runs the same model, inputs and random seed; the model's state (batch-norm
running statistics included) is reset before each step and gradients start from None. Per model:

1. setup: wrap the model for each strategy (plans solved here; torch.compile compiles on its
   first call, which is also the gradient check);
2. gradient check: one step per strategy, gradients against eager's (max abs error, and
   `torch.testing.assert_close` for the DIFFERS flag);
3. peak: one untimed step per strategy under `core.memory.StorageTracker` (inductor's generated
   code allocates past the dispatcher, so its peak comes from the allocator's profile instead);
4. time: `reps` rounds; in each, every strategy runs right after an eager step, and its
   ratio is taken against that step (this VM's speed drifts by 10-20% within minutes: a
   pair shares its moment). A strategy's ratio is the median of its paired ratios; its time
   and eager's are medians of all their steps.

One thread throughout: on this 2-core CPU, OpenMP stalls made multi-threaded steps vary 2x.
"""

from __future__ import annotations

import argparse
import csv
import datetime as _dt
import functools
import math
import platform
import statistics
import time
from collections.abc import Callable, Iterable, Sequence
from contextlib import ExitStack, contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from torch import nn

import sample_models
from core.errors import fmt_bytes
from core.memory import StorageTracker, step_tensors
from core.tradeoff import minimum_budget

QUICK_MODELS = ["gpt-tiny", "resnet-tiny"]
# Every sample model but gpt2-small: its step takes ~70 s on a CPU core, and pairing every
# strategy's step with an eager one would take hours (`--models gpt2-small --reps 2` runs it).
SLOW_MODELS = ["gpt2-small"]
FULL_MODELS = [m for m in sample_models.names() if m not in SLOW_MODELS]
OUR_METHODS = ("store_all", "checkpoint_blocks", "sqrt_n", "rotor", "rockmate")
# fractions of problem.store_all_peak, plus the minimum feasible; 25% is the goal's point
OUR_BUDGETS = (0.7, 0.5, 0.3, 0.25)
COMPILE_BUDGETS = (0.5, 0.2)  # torch._functorch.config.activation_memory_budget
# aot_eager at 1.0 recomputes nothing: a reference that separates the decompositions' own
# rounding from the differences the budget's recomputation brings (fresh dropout masks).
AOT_REFERENCE_BUDGET = 1.0
EVERY_K = 2
# Outputs selective checkpointing keeps: matmuls and convolutions (the expensive ops).
SAC_SAVE = frozenset(
    getattr(torch.ops.aten, name).default
    for name in ("mm", "addmm", "bmm", "baddbmm", "convolution", "_convolution")
)

StepFn = Callable[[Sequence[torch.Tensor]], torch.Tensor]


@dataclass
class Row:
    """One strategy measured on one model. Bytes, seconds; ratios are against eager."""

    model: str
    key: str  # short id: eager, ckpt, ckpt2, sac, aot-0.5, inductor-0.2, ours:rockmate@50%
    strategy: str
    family: str  # "pytorch" or "ours"
    budget: str  # the budget asked, as text
    peak: float = math.nan  # measured bytes beyond parameters and inputs
    eager_peak: float = math.nan  # eager's peak measured the same way (tracker or profiler)
    time: float = math.nan  # median seconds of forward + backward
    eager_time: float = math.nan
    grad_error: float = math.nan  # max abs difference from eager's gradients
    grads_match: bool = True  # torch.testing.assert_close passed
    peak_source: str = "tracker"  # "tracker" (StorageTracker) or "profiler" (allocator events)
    predicted_peak: float = math.nan  # ours: the plan's simulated peak
    predicted_overhead: float = math.nan  # ours: predicted time / store-all time
    times: list[float] = field(default_factory=list, repr=False)
    ratios: list[float] = field(default_factory=list, repr=False)  # each against its eager step
    note: str = ""

    @property
    def peak_ratio(self) -> float:
        return self.peak / self.eager_peak if self.eager_peak else math.nan

    @property
    def time_ratio(self) -> float:
        if self.ratios:
            return statistics.median(self.ratios)
        return self.time / self.eager_time if self.eager_time else math.nan

    @property
    def ok(self) -> bool:
        return not self.note.startswith("failed") and not math.isnan(self.peak)


@dataclass
class Strategy:
    key: str
    name: str
    family: str
    budget: str
    step: StepFn
    peak_source: str = "tracker"
    predicted_peak: float = math.nan
    predicted_overhead: float = math.nan
    note: str = ""


# ---------------------------------------------------------------------------------------------
# Blocks: the model's repeated layers, for torch.utils.checkpoint


def find_blocks(model: nn.Module) -> list[nn.Module]:
    """The model's repeated layers: children of an nn.ModuleList/Sequential, grouped by class;
    among classes with children of their own, the one whose instances hold the most parameters
    wins (ties: more instances, then the innermost), so ResNet gives its BasicBlocks, RegNet
    its XBlocks (not the Conv2d of its conv-BN pairs), GPT its transformer blocks.
    """
    containers = (nn.ModuleList, nn.Sequential, nn.ModuleDict)
    members: dict[type, list[nn.Module]] = {}
    depth_of: dict[type, int] = {}
    for name, module in model.named_modules():
        if not isinstance(module, (nn.ModuleList, nn.Sequential)):
            continue
        for child in module.children():
            if isinstance(child, containers) or not any(True for _ in child.parameters()):
                continue
            found = members.setdefault(type(child), [])
            if all(child is not m for m in found):
                found.append(child)
            depth_of[type(child)] = max(depth_of.get(type(child), 0), name.count(".") + 1)

    def score(cls: type) -> tuple[int, int, int]:
        params = {id(p): p.numel() for m in members[cls] for p in m.parameters()}
        return (sum(params.values()), len(members[cls]), depth_of[cls])

    candidates = [cls for cls, found in members.items() if len(found) >= 2]
    composite = [c for c in candidates if any(True for _ in members[c][0].children())]
    candidates = composite or candidates  # a block is made of layers; leaves only as a fallback
    if not candidates:
        return []
    return members[max(candidates, key=score)]


@contextmanager
def _patched_forward(blocks: Iterable[nn.Module], wrap: Callable[[Callable], Callable]):
    """Temporarily replace each block's forward by `wrap(original forward)`."""
    blocks = list(blocks)
    for b in blocks:
        b.forward = wrap(type(b).forward.__get__(b))
    try:
        yield
    finally:
        for b in blocks:
            del b.forward  # the instance attribute; the class's forward shows through again


def _checkpointed(fn: Callable, context_fn: Callable | None = None) -> Callable:
    from torch.utils.checkpoint import checkpoint

    kwargs = {"context_fn": context_fn} if context_fn is not None else {}

    @functools.wraps(fn)
    def forward(*args, **kw):
        return checkpoint(fn, *args, use_reentrant=False, **kwargs, **kw)

    return forward


def _sac_policy(ctx, op, *args, **kwargs):
    from torch.utils.checkpoint import CheckpointPolicy

    return CheckpointPolicy.MUST_SAVE if op in SAC_SAVE else CheckpointPolicy.PREFER_RECOMPUTE


def _sac_context():
    from torch.utils.checkpoint import create_selective_checkpoint_contexts

    return create_selective_checkpoint_contexts(_sac_policy)


# ---------------------------------------------------------------------------------------------
# Strategies


def _eager_step(model: nn.Module) -> StepFn:
    def step(inputs):
        loss = model(*inputs)
        loss.backward()
        return loss

    return step


def _patched_step(model: nn.Module, blocks: list[nn.Module], wrap) -> StepFn:
    def step(inputs):
        with _patched_forward(blocks, wrap):
            loss = model(*inputs)
        loss.backward()
        return loss

    return step


def _compile_backend(name: str, budget: float):
    """A backend with its own identity (so dynamo keeps one cache entry per strategy) that
    partitions with `activation_memory_budget = budget`."""
    from torch._dynamo.backends.registry import lookup_backend

    inner = lookup_backend(name)

    def backend(gm, example_inputs):
        with torch._functorch.config.patch(activation_memory_budget=budget):
            return inner(gm, example_inputs)

    backend.__name__ = f"{name}_budget_{budget}"
    return backend


def pytorch_strategies(
    model: nn.Module, compile_backends: Sequence[str] = ("aot_eager_decomp_partition",)
) -> list[Strategy]:
    blocks = find_blocks(model)
    every_k = blocks[::EVERY_K]
    n = len(blocks)
    kind = type(blocks[0]).__name__ if blocks else "block"
    out = [Strategy("eager", "eager PyTorch", "pytorch", "-", _eager_step(model))]
    if blocks:
        out += [
            Strategy(
                "ckpt",
                f"torch checkpoint, every block ({n} {kind})",
                "pytorch",
                "-",
                _patched_step(model, blocks, _checkpointed),
            ),
            Strategy(
                f"ckpt{EVERY_K}",
                f"torch checkpoint, every {EVERY_K}nd block ({len(every_k)} of {n})",
                "pytorch",
                "-",
                _patched_step(model, every_k, _checkpointed),
            ),
            Strategy(
                "sac",
                "selective checkpoint (save matmul/conv), every block",
                "pytorch",
                "-",
                _patched_step(model, blocks, lambda fn: _checkpointed(fn, context_fn=_sac_context)),
            ),
        ]
    for backend in compile_backends:
        short = "aot" if backend.startswith("aot") else backend
        budgets = COMPILE_BUDGETS
        if short == "aot":
            budgets = (AOT_REFERENCE_BUDGET, *budgets)
        for b in budgets:
            compiled = torch.compile(model, backend=_compile_backend(backend, b))
            out.append(
                Strategy(
                    f"{short}-{b}",
                    f"torch.compile {backend}",
                    "pytorch",
                    f"activation_memory_budget {b}",
                    _eager_step(compiled),
                    peak_source="profiler" if backend == "inductor" else "tracker",
                )
            )
    return out


def our_strategies(
    model: nn.Module,
    problem,
    methods: Sequence[str],
    budgets: Sequence[float] = OUR_BUDGETS,
    log: Callable[[str], None] = print,
) -> list[Strategy]:
    """One strategy per distinct plan: a budget whose plan equals another's shares its row."""
    import core
    from core.solvers import available_methods

    peak = problem.store_all_peak
    out: list[Strategy] = []
    for method in methods:
        if method not in available_methods():
            log(f"[yellow]skipped ours {method}: not in core.solvers.available_methods()[/]")
            continue
        try:
            low = minimum_budget(problem, method)
        except Exception as e:  # a solver in progress must not stop the bench
            log(f"[red]ours {method}: minimum budget failed: {type(e).__name__}: {e}[/]")
            continue
        plans: dict[tuple, tuple[list[str], object]] = {}
        asked = [(f"{b:.0%}", int(b * peak)) for b in budgets if int(b * peak) >= low]
        skipped = [f"{b:.0%}" for b in budgets if int(b * peak) < low]
        asked.append((f"min {low / peak:.0%}", low))
        min_asked = dict(asked)
        for label, bytes_ in asked:
            try:
                plan = core.solve(problem, bytes_, method)
            except Exception as e:
                log(f"[red]ours {method} at {label}: {type(e).__name__}: {e}[/]")
                continue
            key = (tuple(plan.program), plan.backward_start)
            plans.setdefault(key, ([], plan))[0].append(label)
        if skipped:
            log(f"ours {method}: {', '.join(skipped)} below its minimum {low / peak:.0%}")
        for labels, plan in plans.values():
            wrapped = core.apply_plan(model, plan)
            first = labels[0].removeprefix("min ")
            out.append(
                Strategy(
                    f"ours:{method}@{first}",
                    f"ours {method}",
                    "ours",
                    ", ".join(labels) + f" ({fmt_bytes(min_asked[labels[-1]])})",
                    _eager_step(wrapped),
                    predicted_peak=plan.predicted_peak,
                    predicted_overhead=plan.overhead,
                )
            )
    return out


# ---------------------------------------------------------------------------------------------
# Measuring


class _CompileTracker(StorageTracker):
    """The storage tracker, letting torch.compile compile and run underneath it (any other
    dispatch mode makes dynamo fall back to eager)."""

    @classmethod
    def ignore_compile_internals(cls) -> bool:
        return True


def profiler_peak(fn: Callable[[], object]) -> int:
    """Peak bytes allocated (beyond what was live before) while `fn` runs, from the CPU
    allocator's events: sees every allocation, inductor's generated code included, and also
    library scratch buffers (oneDNN) the tracker does not."""
    activities = [torch.profiler.ProfilerActivity.CPU]
    with torch.profiler.profile(activities=activities, profile_memory=True) as prof:
        fn()
    events = sorted(
        (e.start_ns(), e.nbytes())
        for e in prof.profiler.kineto_results.events()
        if e.name() == "[memory]"
    )
    live = peak = 0
    for _, delta in events:
        live += delta
        peak = max(peak, live)
    return peak


class _Runner:
    """Runs one step of a strategy from the same starting state every time."""

    def __init__(self, model: nn.Module, inputs: Sequence[torch.Tensor], seed: int = 0) -> None:
        self.model, self.inputs, self.seed = model, tuple(inputs), seed
        self.state = {k: v.detach().clone() for k, v in model.state_dict().items()}

    def reset(self) -> None:
        self.model.load_state_dict(self.state)
        self.model.zero_grad(set_to_none=True)
        torch.manual_seed(self.seed)

    def grads(self, step: StepFn) -> list[torch.Tensor | None]:
        self.reset()
        step(self.inputs)
        return [None if p.grad is None else p.grad.detach().clone() for p in self._params()]

    def peak(self, step: StepFn, source: str) -> int:
        self.reset()
        if source == "profiler":
            return profiler_peak(lambda: step(self.inputs))
        with _CompileTracker(step_tensors(self.model, self.inputs)) as tracker:
            step(self.inputs)
        return tracker.peak

    def time(self, step: StepFn) -> float:
        self.reset()
        start = time.perf_counter()
        step(self.inputs)
        return time.perf_counter() - start

    def _params(self) -> list[nn.Parameter]:
        return [p for p in self.model.parameters() if p.requires_grad]


def grad_error(grads: list, ref: list) -> tuple[float, bool]:
    """Max abs difference from the reference gradients, and whether assert_close passes."""
    worst, match = 0.0, True
    for g, r in zip(grads, ref, strict=True):
        if (g is None) != (r is None):
            return math.inf, False
        if g is None:
            continue
        worst = max(worst, (g - r).abs().max().item() if g.numel() else 0.0)
        try:
            torch.testing.assert_close(g, r)
        except AssertionError:
            match = False
    return worst, match


def _analyze(model, inputs, name: str, log):
    import core

    try:
        return core.analyze(model, inputs, costs="measured", name=name)
    except Exception as e:  # measured costs are new: fall back rather than stop
        log(f"[yellow]{name}: measured costs failed ({type(e).__name__}: {e}); using estimated[/]")
        return core.analyze(model, inputs, costs="estimated", name=name)


@contextmanager
def _bench_settings():
    """1 thread; inductor draws random numbers as eager does, so a gradient difference is the
    memory budget's recompute, not inductor's own RNG."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    with ExitStack() as stack:
        try:
            import torch._inductor.config as inductor_config

            stack.enter_context(inductor_config.patch(fallback_random=True))
            # One cache entry per compiled strategy; past the limit dynamo would silently run
            # eager instead, so raise the limit and make hitting it an error.
            stack.enter_context(
                torch._dynamo.config.patch(recompile_limit=32, fail_on_recompile_limit_hit=True)
            )
        except ImportError:
            pass
        try:
            yield
        finally:
            torch.set_num_threads(threads)


def run_bench(
    models: Sequence[str],
    reps: int = 5,
    *,
    methods: Sequence[str] = OUR_METHODS,
    budgets: Sequence[float] = OUR_BUDGETS,
    compile_backends: Sequence[str] = ("aot_eager_decomp_partition", "inductor"),
    only: Iterable[str] | None = None,
    console=None,
    show_progress: bool = True,
) -> list[Row]:
    """Measure every strategy on every model; one Row per strategy (eager first per model).

    only: keep just these strategy keys (prefix match: "ours:store_all" keeps its rows).
    """
    from rich.console import Console
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    console = console or Console()
    keep = list(only) if only is not None else None
    rows: list[Row] = []
    columns = [
        TextColumn("{task.description}"),
        BarColumn(),
        TextColumn("{task.completed}/"),
        TextColumn("{task.total}"),
        TimeElapsedColumn(),
    ]
    with (
        _bench_settings(),
        Progress(*columns, console=console, disable=not show_progress, transient=False) as progress,
    ):
        task = progress.add_task("bench", total=len(models))
        for name in models:
            progress.update(task, description=f"{name}: building")
            rows += _bench_model(
                name, reps, methods, budgets, compile_backends, keep, console, progress, task
            )
    return rows


def _bench_model(name, reps, methods, budgets, compile_backends, keep, console, progress, task):
    import core  # noqa: F401  (fail early if the engine does not import)

    def log(msg: str) -> None:
        console.print(f"  {name}: {msg}")

    def wanted(key: str) -> bool:
        return keep is None or key == "eager" or any(key.startswith(k) for k in keep)

    torch._dynamo.reset()  # the previous model's compiled entries share this forward's code
    model, inputs = sample_models.build(name)
    runner = _Runner(model, inputs)
    progress.update(task, description=f"{name}: setup")
    strategies = [s for s in pytorch_strategies(model, compile_backends) if wanted(s.key)]
    if any(wanted(f"ours:{m}") for m in methods):
        progress.update(task, description=f"{name}: analyze + solve")
        problem = _analyze(model, inputs, name, log)
        ours = our_strategies(
            model, problem, [m for m in methods if wanted(f"ours:{m}")], budgets, log
        )
        strategies += [s for s in ours if wanted(s.key)]

    n = len(strategies)
    progress.update(task, total=progress.tasks[task].total + 2 * n + reps * n)
    rows: dict[str, Row] = {}
    ref = None
    for s in strategies:  # gradient check, also the warm-up (and torch.compile's compile)
        progress.update(task, description=f"{name}: check {s.key}")
        row = Row(
            name,
            s.key,
            s.name,
            s.family,
            s.budget,
            peak_source=s.peak_source,
            predicted_peak=s.predicted_peak,
            predicted_overhead=s.predicted_overhead,
            note=s.note,
        )
        rows[s.key] = row
        try:
            grads = runner.grads(s.step)
            if ref is None:
                ref = grads
            row.grad_error, row.grads_match = grad_error(grads, ref)
        except Exception as e:
            row.note = f"failed: {type(e).__name__}: {str(e)[:120]}"
            log(f"[red]{s.key} {row.note}[/]")
        progress.advance(task)
    live = [s for s in strategies if not rows[s.key].note.startswith("failed")]
    eager_peaks: dict[str, int] = {}
    for s in live:
        progress.update(task, description=f"{name}: peak {s.key}")
        try:
            rows[s.key].peak = runner.peak(s.step, s.peak_source)
            if s.peak_source not in eager_peaks:
                eager_peaks[s.peak_source] = runner.peak(strategies[0].step, s.peak_source)
        except Exception as e:
            rows[s.key].note = f"failed (peak): {type(e).__name__}: {str(e)[:120]}"
            log(f"[red]{s.key} {rows[s.key].note}[/]")
        progress.advance(task)
    live = [s for s in live if rows[s.key].ok]
    eager = rows[strategies[0].key]
    for rep in range(reps):
        for s in live:
            progress.update(task, description=f"{name}: time {rep + 1}/{reps} {s.key}")
            try:
                before = runner.time(strategies[0].step)
                eager.times.append(before)
                if s is not strategies[0]:
                    rows[s.key].times.append(runner.time(s.step))
                    rows[s.key].ratios.append(rows[s.key].times[-1] / before)
            except Exception as e:
                rows[s.key].note = f"failed (timing): {type(e).__name__}: {str(e)[:120]}"
            progress.advance(task)
    eager.time = statistics.median(eager.times) if eager.times else math.nan
    for row in rows.values():
        if row.times:
            row.time = statistics.median(row.times)
        row.eager_time = eager.time
        row.eager_peak = eager_peaks.get(row.peak_source, math.nan)
        if row.peak_source == "profiler":
            row.note = (row.note + "; " if row.note else "") + (
                "peak from the allocator profile (tracker cannot see inductor's buffers); "
                "ratio against eager under the same profile"
            )
    progress.advance(task)
    progress.update(task, description=f"{name}: done")
    return list(rows.values())


# ---------------------------------------------------------------------------------------------
# Reporting

COLUMNS = [
    "strategy",
    "budget asked",
    "measured peak",
    "peak / eager",
    "step time / eager",
    "max grad error vs eager",
]


def _cells(row: Row) -> list[str]:
    if not row.ok:
        return [row.strategy, row.budget, "-", "-", "-", row.note or "failed"]
    err = f"{row.grad_error:.1e}" if row.grad_error else "0"
    if not row.grads_match:
        err += " DIFFERS"
    peak = fmt_bytes(row.peak) + ("*" if row.peak_source == "profiler" else "")
    time_ = f"{row.time_ratio:.2f}x ({row.time * 1e3:.0f} ms)"
    return [row.strategy, row.budget, peak, f"{row.peak_ratio:.2f}", time_, err]


def by_model(rows: Sequence[Row]) -> dict[str, list[Row]]:
    out: dict[str, list[Row]] = {}
    for r in rows:
        out.setdefault(r.model, []).append(r)
    return out


def print_tables(rows: Sequence[Row], console=None) -> None:
    from rich.console import Console
    from rich.table import Table

    console = console or Console()
    for model, group in by_model(rows).items():
        table = Table(title=f"{model}: {sample_models.describe(model)}", title_justify="left")
        for c in COLUMNS:
            table.add_column(c, justify="left" if c in ("strategy", "budget asked") else "right")
        for r in group:
            style = "red" if not r.grads_match else ("cyan" if r.family == "ours" else None)
            table.add_row(*_cells(r), style=style)
        console.print(table)
    for line in headlines(rows):
        console.print(line)


def headlines(rows: Sequence[Row], method: str = "rockmate") -> list[str]:
    """The issue's "must show" figures for each GPT model: `method` at 50% against PyTorch's
    strategies reaching the same peak or lower; the smallest peak at <= 1.20x eager time."""
    out = []
    for model, group in by_model(rows).items():
        planned = [r for r in group if r.ok and r.family == "ours"]
        if planned:
            worst = max(planned, key=lambda r: abs(r.peak - r.predicted_peak))
            gap = worst.peak - worst.predicted_peak
            out.append(
                f"{model}: measured vs predicted peak of our plans: worst {gap:+,.0f} bytes "
                f"({gap / worst.predicted_peak:+.1%}, {worst.key})"
            )
        ours = [r for r in group if r.ok and r.key.startswith(f"ours:{method}@")]
        if not ours:
            continue
        at50 = [r for r in ours if r.key == f"ours:{method}@50%"]
        if at50:
            r = at50[0]
            rivals = [
                p
                for p in group
                if p.ok and p.family == "pytorch" and p.key != "eager" and p.peak <= r.peak
            ]
            rival_text = (
                ", ".join(
                    f"{p.key} {p.time_ratio:.2f}x (peak {p.peak_ratio:.2f}"
                    + ("" if p.grads_match else ", grads differ")
                    + ")"
                    for p in rivals
                )
                or "none"
            )
            out.append(
                f"{model}: {method} at 50%: peak {r.peak_ratio:.2f} of eager, step "
                f"{r.time_ratio:.2f}x eager; PyTorch at the same peak or lower: {rival_text}"
            )
        fast = [r for r in ours if r.time_ratio <= 1.20 and r.grads_match]
        if fast:
            best = min(fast, key=lambda r: r.peak)
            out.append(
                f"{model}: smallest {method} peak at <= 1.20x eager time: "
                f"{best.peak_ratio:.1%} of eager ({fmt_bytes(best.peak)}) at "
                f"{best.time_ratio:.2f}x, budget {best.budget}"
            )
    return out


def environment() -> str:
    import os

    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return (
        f"{_dt.datetime.now():%Y-%m-%d %H:%M}, {cpu}, {os.cpu_count()} cores (bench uses 1 "
        f"thread), torch {torch.__version__}, Python {platform.python_version()}"
    )


def write_markdown(rows: Sequence[Row], path: Path, reps: int | None = None) -> None:
    lines = [
        f"# remat bench\n\n{environment()}"
        + (
            f"; {reps} timed reps, each step right after an eager one; medians of the paired ratios"
            if reps
            else ""
        )
    ]
    lines.append(
        "\nPeak: bytes beyond parameters and inputs, from `core.memory.StorageTracker` around "
        "the real step; `*`: from the allocator profile (inductor), against eager under the "
        "same profile. DIFFERS: gradients fail `torch.testing.assert_close` against eager."
    )
    for model, group in by_model(rows).items():
        lines.append(f"\n## {model}\n\n{sample_models.describe(model)}\n")
        lines.append("| " + " | ".join(COLUMNS) + " |")
        lines.append("|" + "---|" * len(COLUMNS))
        for r in group:
            lines.append("| " + " | ".join(c.replace("|", "/") for c in _cells(r)) + " |")
    heads = headlines(rows)
    if heads:
        lines.append("\n## Headlines\n")
        lines += [f"- {h}" for h in heads]
    path.write_text("\n".join(lines) + "\n")


CSV_FIELDS = [
    "model",
    "key",
    "strategy",
    "family",
    "budget",
    "peak",
    "eager_peak",
    "peak_ratio",
    "time",
    "eager_time",
    "time_ratio",
    "grad_error",
    "grads_match",
    "peak_source",
    "predicted_peak",
    "predicted_overhead",
    "times",
    "ratios",
    "note",
]


def write_csv(rows: Sequence[Row], path: Path) -> None:
    with path.open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=CSV_FIELDS)
        w.writeheader()
        for r in rows:
            d = asdict(r)
            d.update(peak_ratio=r.peak_ratio, time_ratio=r.time_ratio)
            d["times"] = " ".join(f"{t:.5f}" for t in r.times)
            d["ratios"] = " ".join(f"{x:.4f}" for x in r.ratios)
            w.writerow({k: d[k] for k in CSV_FIELDS})


def pareto(points: Sequence[tuple[float, float]]) -> list[int]:
    """Indices of the points no other point beats on both x and y (lower is better), by x."""
    order = sorted(range(len(points)), key=lambda i: (points[i][0], points[i][1]))
    front, best_y = [], math.inf
    for i in order:
        if points[i][1] < best_y:
            front.append(i)
            best_y = points[i][1]
    return front


def _plot_rows(group: Sequence[Row]) -> list[Row]:
    return [r for r in group if r.ok and not math.isnan(r.time_ratio)]


def _marker_label(r: Row) -> str:
    if r.family == "ours":
        return r.key.removeprefix("ours:")
    return r.key


def write_png(rows: Sequence[Row], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    groups = by_model(rows)
    n = len(groups)
    cols = min(n, 3)
    nrows = math.ceil(n / cols)
    fig, axes = plt.subplots(nrows, cols, figsize=(6.5 * cols, 5 * nrows), squeeze=False)
    for ax, (model, group) in zip(axes.flat, groups.items()):
        pts = _plot_rows(group)
        for r in pts:
            color = "tab:blue" if r.family == "ours" else "tab:orange"
            ax.scatter(
                r.time_ratio,
                r.peak_ratio,
                marker="o" if r.family == "ours" else "s",
                facecolors=color if r.grads_match else "none",
                edgecolors=color,
                s=40,
            )
            ax.annotate(
                _marker_label(r),
                (r.time_ratio, r.peak_ratio),
                fontsize=6,
                xytext=(3, 3),
                textcoords="offset points",
            )
        exact = [r for r in pts if r.grads_match]
        front = [exact[i] for i in pareto([(r.time_ratio, r.peak_ratio) for r in exact])]
        if front:
            ax.step(
                [r.time_ratio for r in front],
                [r.peak_ratio for r in front],
                where="post",
                color="gray",
                lw=1,
                ls="--",
                label="Pareto front (exact grads)",
            )
        ax.set_title(model)
        ax.set_xlabel("step time / eager")
        ax.set_ylabel("measured peak / eager")
        ax.grid(alpha=0.3)
        ax.scatter([], [], marker="o", color="tab:blue", label="ours")
        ax.scatter([], [], marker="s", color="tab:orange", label="PyTorch")
        ax.scatter([], [], marker="s", facecolors="none", edgecolors="gray", label="grads differ")
        ax.legend(fontsize=7)
    for ax in list(axes.flat)[n:]:
        ax.set_visible(False)
    fig.suptitle(f"remat bench: {environment()}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=130)
    plt.close(fig)


def write_html(rows: Sequence[Row], path: Path) -> None:
    import plotly.graph_objects as go
    from plotly.subplots import make_subplots

    groups = by_model(rows)
    n = len(groups)
    cols = min(n, 3)
    nrows = math.ceil(n / cols)
    fig = make_subplots(rows=nrows, cols=cols, subplot_titles=list(groups))
    for i, (_model, group) in enumerate(groups.items()):
        rr, cc = i // cols + 1, i % cols + 1
        pts = _plot_rows(group)
        for family, color, symbol in (
            ("ours", "#1f77b4", "circle"),
            ("pytorch", "#ff7f0e", "square"),
        ):
            sel = [r for r in pts if r.family == family]
            fig.add_trace(
                go.Scatter(
                    x=[r.time_ratio for r in sel],
                    y=[r.peak_ratio for r in sel],
                    mode="markers+text",
                    text=[_marker_label(r) for r in sel],
                    textposition="top right",
                    textfont={"size": 8},
                    marker={
                        "color": color,
                        "size": 9,
                        "symbol": [symbol if r.grads_match else symbol + "-open" for r in sel],
                    },
                    name="ours" if family == "ours" else "PyTorch",
                    legendgroup=family,
                    showlegend=i == 0,
                    hovertext=[
                        f"{r.strategy}<br>budget {r.budget}<br>peak {fmt_bytes(r.peak)} "
                        f"({r.peak_ratio:.2f})<br>time {r.time * 1e3:.1f} ms "
                        f"({r.time_ratio:.2f}x)<br>grad err {r.grad_error:.1e}"
                        + ("" if r.grads_match else " DIFFERS")
                        for r in sel
                    ],
                    hoverinfo="text",
                ),
                row=rr,
                col=cc,
            )
        exact = [r for r in pts if r.grads_match]
        front = [exact[j] for j in pareto([(r.time_ratio, r.peak_ratio) for r in exact])]
        fig.add_trace(
            go.Scatter(
                x=[r.time_ratio for r in front],
                y=[r.peak_ratio for r in front],
                mode="lines",
                line={"shape": "hv", "dash": "dash", "color": "gray"},
                name="Pareto front (exact grads)",
                legendgroup="front",
                showlegend=i == 0,
                hoverinfo="skip",
            ),
            row=rr,
            col=cc,
        )
        fig.update_xaxes(title_text="step time / eager", row=rr, col=cc)
        fig.update_yaxes(title_text="peak / eager", row=rr, col=cc)
    fig.update_layout(title=f"remat bench: {environment()}", height=420 * nrows, width=520 * cols)
    fig.write_html(str(path), include_plotlyjs="cdn")


def write_results(rows: Sequence[Row], out: str | Path, reps: int | None = None) -> dict[str, Path]:
    """bench.md, bench.csv, bench.png, bench.html in `out` (created)."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    paths = {ext: out / f"bench.{ext}" for ext in ("md", "csv", "png", "html")}
    write_markdown(rows, paths["md"], reps)
    write_csv(rows, paths["csv"])
    write_png(rows, paths["png"])
    write_html(rows, paths["html"])
    return paths


# ---------------------------------------------------------------------------------------------
# Command line


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="remat bench",
        description="Real training steps on the sample models: eager PyTorch, torch.utils."
        "checkpoint, selective checkpointing, torch.compile's memory budget and our plans, "
        "measured side by side (1 thread, each step paired with an eager step, medians).",
    )
    p.add_argument(
        "--quick",
        action="store_true",
        help=f"{' and '.join(QUICK_MODELS)} only, 3 reps, no inductor (~2 min)",
    )
    p.add_argument(
        "--models", help=f"comma-separated sample models (default: {','.join(FULL_MODELS)})"
    )
    p.add_argument("--reps", type=int, help="timed repetitions per strategy (default 7; quick 3)")
    p.add_argument("--out", help="results folder (default results/bench-<date>)")
    p.add_argument("--no-compile", action="store_true", help="leave out torch.compile")
    p.add_argument("--methods", help=f"our methods (default {','.join(OUR_METHODS)})")
    p.add_argument(
        "--budgets",
        help="our budgets, fractions of the store-all peak, the minimum feasible always added "
        f"(default {','.join(str(b) for b in OUR_BUDGETS)})",
    )
    return p


def main(argv: list[str] | None = None) -> int:
    from rich.console import Console

    args = _parser().parse_args(argv)
    console = Console()
    if not console.is_terminal:  # a log file: wide enough that table rows do not wrap
        console = Console(width=180)
    if args.models:
        models = [m.strip() for m in args.models.split(",") if m.strip()]
    else:
        models = QUICK_MODELS if args.quick else FULL_MODELS
    unknown = [m for m in models if m not in sample_models.REGISTRY]
    if unknown:
        console.print(f"unknown sample models {unknown}; valid: {', '.join(sample_models.names())}")
        return 2
    reps = args.reps or (3 if args.quick else 7)
    if args.no_compile:
        backends: tuple[str, ...] = ()
    elif args.quick:
        backends = ("aot_eager_decomp_partition",)
    else:
        backends = ("aot_eager_decomp_partition", "inductor")
    methods = tuple(args.methods.split(",")) if args.methods else OUR_METHODS
    try:
        budgets = tuple(float(b) for b in args.budgets.split(",")) if args.budgets else OUR_BUDGETS
    except ValueError:
        console.print(f"--budgets takes fractions like 0.5,0.3; got {args.budgets!r}")
        return 2
    if not all(0 < b <= 1 for b in budgets):
        console.print(
            f"--budgets are fractions of the store-all peak in (0, 1]; got {args.budgets}"
        )
        return 2
    out = Path(args.out or f"results/bench-{_dt.date.today():%Y-%m-%d}")
    console.print(f"remat bench: {', '.join(models)}; {reps} reps; {environment()}")
    start = time.perf_counter()
    rows = run_bench(
        models, reps, methods=methods, budgets=budgets, compile_backends=backends, console=console
    )
    print_tables(rows, console)
    paths = write_results(rows, out, reps)
    console.print(
        f"wrote {', '.join(str(p) for p in paths.values())} in {time.perf_counter() - start:.0f} s"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
