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
import datetime as _dt
import functools
import math
import statistics
import time
from collections.abc import Callable, Iterable, Sequence
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch
from torch import nn

import core
import sample_models
from bench.report import Row, environment, print_tables, write_results
from core.costs import measure_link
from core.errors import fmt_bytes
from core.frontier import minimum_budget
from core.memory import StorageTracker, host_copy, step_tensors
from core.schedule import Plan
from core.solvers import available_methods

QUICK_MODELS = ["gpt-tiny", "resnet-tiny"]
# Every sample model but gpt2-small: its step takes ~70 s on a CPU core, and pairing every
# strategy's step with an eager one would take hours (`--models gpt2-small --reps 2` runs it).
SLOW_MODELS = ["gpt2-small"]
FULL_MODELS = [m for m in sample_models.names() if m not in SLOW_MODELS]
OUR_METHODS = ("store_all", "checkpoint_blocks", "sqrt_n", "rotor", "rockmate", "offload")
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

    kwargs: dict[str, Any] = {"context_fn": context_fn} if context_fn is not None else {}

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


def _eager_step(model: Callable[..., torch.Tensor]) -> StepFn:
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


@contextmanager
def save_on_host(device: torch.device):
    """PyTorch's own offloading: every tensor autograd saves goes to host memory and comes back
    for the backward. On CUDA, `torch.autograd.graph.save_on_cpu(pin_memory=True)` itself. On
    CPU, where host and device are one memory and `save_on_cpu` would copy nothing, the same
    pack and unpack: a copy into host storage the tracker does not count (as the runtime's
    host pool), and a fresh device copy for each unpack, which it does count."""
    if device.type != "cpu":
        with torch.autograd.graph.save_on_cpu(pin_memory=True):
            yield
        return

    def unpack(host: torch.Tensor) -> torch.Tensor:
        out = torch.empty_like(host)
        out.copy_(host)
        return out

    with torch.autograd.graph.saved_tensors_hooks(host_copy, unpack):
        yield


def _offloaded_step(model: nn.Module, blocks: list[nn.Module]) -> StepFn:
    device = next(model.parameters()).device

    def step(inputs):
        with save_on_host(device), _patched_forward(blocks, _checkpointed):
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


def _on_cpu(model: nn.Module) -> bool:
    return next(model.parameters()).device.type == "cpu"


def pytorch_strategies(
    model: nn.Module, compile_backends: Sequence[str] = ("aot_eager_decomp_partition",)
) -> list[Strategy]:
    blocks = find_blocks(model)
    every_k = blocks[::EVERY_K]
    n = len(blocks)
    kind = type(blocks[0]).__name__ if blocks else "block"
    out = [Strategy("eager", "eager PyTorch", "pytorch", "-", _eager_step(model))]
    host = " [CPU: emulated]" if _on_cpu(model) else ""
    out.append(
        Strategy(
            "soc",
            f"torch save_on_cpu, every saved tensor{host}",
            "pytorch",
            "-",
            _offloaded_step(model, []),
        )
    )
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
            Strategy(
                "soc+ckpt",
                f"torch save_on_cpu + checkpoint, every block{host}",
                "pytorch",
                "-",
                _offloaded_step(model, blocks),
            ),
        ]
    for backend in compile_backends:
        short = "aot" if backend.startswith("aot") else backend
        budgets: tuple[float, ...] = COMPILE_BUDGETS
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
        plans: dict[tuple, tuple[list[str], Plan]] = {}
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


def cuda_peak(fn: Callable[[], object], device: torch.device) -> int:
    """Peak bytes the CUDA allocator held while `fn` ran, beyond what it held before."""
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    before = torch.cuda.memory_allocated(device)
    fn()
    torch.cuda.synchronize(device)
    return torch.cuda.max_memory_allocated(device) - before


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class _Runner:
    """Runs one step of a strategy from the same starting state every time."""

    def __init__(self, model: nn.Module, inputs: Sequence[torch.Tensor], seed: int = 0) -> None:
        self.model, self.inputs, self.seed = model, tuple(inputs), seed
        self.device = next(model.parameters()).device
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
        if source == "cuda":
            return cuda_peak(lambda: step(self.inputs), self.device)
        with _CompileTracker(step_tensors(self.model, self.inputs)) as tracker:
            step(self.inputs)
        return tracker.peak

    def time(self, step: StepFn) -> float:
        self.reset()
        _sync(self.device)
        start = time.perf_counter()
        step(self.inputs)
        _sync(self.device)
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
    device: str = "cpu",
) -> list[Row]:
    """Measure every strategy on every model; one Row per strategy (eager first per model).

    only: keep just these strategy keys (prefix match: "ours:store_all" keeps its rows).
    device: where the steps run; on CUDA every peak is `torch.cuda.max_memory_allocated`'s.
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
                name,
                reps,
                methods,
                budgets,
                compile_backends,
                keep,
                console,
                progress,
                task,
                torch.device(device),
            )
    return rows


def _bench_model(
    name, reps, methods, budgets, compile_backends, keep, console, progress, task, device
):
    def log(msg: str) -> None:
        console.print(f"  {name}: {msg}")

    def wanted(key: str) -> bool:
        return keep is None or key == "eager" or any(key.startswith(k) for k in keep)

    torch._dynamo.reset()  # the previous model's compiled entries share this forward's code
    model, inputs = sample_models.build(name)
    model, inputs = model.to(device), tuple(x.to(device) for x in inputs)
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

    if device.type == "cuda":  # one allocator sees every strategy's memory, inductor's too
        strategies = [replace(s, peak_source="cuda") for s in strategies]
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
        "--device",
        default="cpu",
        help="torch device the steps run on (default cpu); on cuda, peaks are "
        "torch.cuda.max_memory_allocated's and the host link is measured and printed",
    )
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
    if args.device != "cpu" and not (args.device.startswith("cuda") and torch.cuda.is_available()):
        console.print(f"--device {args.device}: no such device here (cpu, or cuda on a GPU)")
        return 2
    out = Path(args.out or f"results/bench-{_dt.date.today():%Y-%m-%d}")
    console.print(f"remat bench: {', '.join(models)}; {reps} reps; {environment()}")
    if args.device != "cpu":
        link = measure_link(args.device)
        console.print(
            f"on {torch.cuda.get_device_name(args.device)}: peaks from "
            f"torch.cuda.max_memory_allocated; host link measured {link.d2h / 1e9:.1f} GB/s "
            f"to host, {link.h2d / 1e9:.1f} GB/s back (pinned, CUDA events)"
        )
    start = time.perf_counter()
    rows = run_bench(
        models,
        reps,
        methods=methods,
        budgets=budgets,
        compile_backends=backends,
        console=console,
        device=args.device,
    )
    print_tables(rows, console)
    paths = write_results(rows, out, reps, log=lambda text: console.print(text, markup=False))
    console.print(
        f"wrote {', '.join(str(p) for p in paths.values())} in {time.perf_counter() - start:.0f} s"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
