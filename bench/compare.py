"""`remat bench`: real training steps, side by side with PyTorch's own ways to save memory.

Every strategy runs the same model, inputs and random seed; the model's state (batch-norm
running statistics included) is reset before each step and gradients start from None. Per model:

1. setup: wrap the model for each strategy (plans solved here; torch.compile compiles on its
   first call, which is also the gradient check);
2. gradient check: one step per strategy, gradients against eager's (max abs error, and
   `torch.testing.assert_close` for the DIFFERS flag);
3. peak: one untimed step per strategy under `core.StorageTracker` (inductor's generated
   code allocates past the dispatcher, so its peak comes from the allocator's profile instead);
4. time: `reps` rounds; in each, every strategy runs right after an eager step, and its
   ratio is taken against that step (this VM's speed drifts by 10-20% within minutes: a
   pair shares its moment). A strategy's ratio is the median of its paired ratios; its time
   and eager's are medians of all their steps.

One thread throughout: on this 2-core CPU, OpenMP stalls made multi-threaded steps vary 2x.
The strategies are built in bench/strategies.py and each step is measured by bench/measure.py;
this module runs the phases per model and holds the command line.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import math
import statistics
import sys
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
from torch import nn

import core
import sample_models
from bench.measure import Runner, bench_settings, bit_equal, grad_error
from bench.report import Row, environment, print_tables, write_results
from bench.strategies import OUR_BUDGETS, Strategy, our_strategies, pytorch_strategies

# re-exported: tests/test_bench.py reaches them through this module
from bench.strategies import _checkpointed as _checkpointed
from bench.strategies import _patched_forward as _patched_forward
from bench.strategies import find_blocks as find_blocks
from core import Problem, measure_link

QUICK_MODELS = ["gpt-tiny", "resnet-tiny"]
# Every sample model but gpt2-small: its step takes ~70 s on a CPU core, and pairing every
# strategy's step with an eager one would take hours (`--models gpt2-small --reps 2` runs it).
SLOW_MODELS = ["gpt2-small"]
FULL_MODELS = [m for m in sample_models.names() if m not in SLOW_MODELS]
# our rows' key prefixes: the interpreter, the native runtime, the native runtime compiled
OUR_KINDS = ("ours", "native", "native-compiled")
OUR_METHODS = ("store_all", "checkpoint_blocks", "sqrt_n", "rotor", "rockmate", "offload")


def _analyze(
    model: nn.Module, inputs: tuple[torch.Tensor, ...], name: str, log: Callable[[str], None]
) -> Problem:
    """The problem with measured op costs, or estimated ones if measuring fails."""
    try:
        return core.analyze(model, inputs, costs="measured", name=name)
    except Exception as e:  # measured costs are new: fall back rather than stop
        log(f"[yellow]{name}: measured costs failed ({type(e).__name__}: {e}); using estimated[/]")
        return core.analyze(model, inputs, costs="estimated", name=name)


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
        bench_settings(),
        Progress(*columns, console=console, disable=not show_progress, transient=False) as progress,
    ):
        task = progress.add_task("bench", total=len(models))
        for name in models:
            out = _Reporter(name, console, progress, task)
            out.status("building")
            rows += _bench_model(
                out, reps, methods, budgets, compile_backends, keep, torch.device(device)
            )
    return rows


class _Reporter:
    """One model's progress line and log in `run_bench`."""

    def __init__(self, name: str, console: Any, progress: Any, task: Any) -> None:
        self.name, self.console, self.progress, self.task = name, console, progress, task

    def status(self, text: str) -> None:
        self.progress.update(self.task, description=f"{self.name}: {text}")

    def log(self, msg: str) -> None:
        self.console.print(f"  {self.name}: {msg}")

    def advance(self) -> None:
        self.progress.advance(self.task)

    def add_steps(self, steps: int) -> None:
        self.progress.update(self.task, total=self.progress.tasks[self.task].total + steps)


def _bench_model(
    out: _Reporter,
    reps: int,
    methods: Sequence[str],
    budgets: Sequence[float],
    compile_backends: Sequence[str],
    keep: list[str] | None,
    device: torch.device,
) -> list[Row]:
    """Every wanted strategy on sample model `out.name`: gradient check, peak, paired times."""
    torch._dynamo.reset()  # the previous model's compiled entries share this forward's code
    model, inputs = sample_models.build(out.name)
    model, inputs = model.to(device), tuple(x.to(device) for x in inputs)
    runner = Runner(model, inputs)
    out.status("setup")
    strategies = _wanted_strategies(model, inputs, methods, budgets, compile_backends, keep, out)
    if device.type == "cuda":  # one allocator sees every strategy's memory, inductor's too
        strategies = [replace(s, peak_source="cuda") for s in strategies]
    n = len(strategies)
    out.add_steps(2 * n + reps * n)
    rows = _check_gradients(runner, strategies, out)
    live = [s for s in strategies if not rows[s.key].note.startswith("failed")]
    eager_peaks = _measure_peaks(runner, strategies[0], live, rows, out)
    live = [s for s in live if rows[s.key].ok]
    _time_pairs(runner, strategies[0], live, rows, reps, out)
    _summarise(rows, rows[strategies[0].key], eager_peaks)
    out.advance()
    out.status("done")
    return list(rows.values())


def _wanted_strategies(
    model: nn.Module,
    inputs: tuple[torch.Tensor, ...],
    methods: Sequence[str],
    budgets: Sequence[float],
    compile_backends: Sequence[str],
    keep: list[str] | None,
    out: _Reporter,
) -> list[Strategy]:
    """PyTorch's strategies, then ours (analysed and solved here), those `keep` asks for."""

    def wanted(key: str) -> bool:
        return keep is None or key == "eager" or any(key.startswith(k) for k in keep)

    strategies = [s for s in pytorch_strategies(model, compile_backends) if wanted(s.key)]
    ours_methods = [m for m in methods if any(wanted(f"{k}:{m}") for k in OUR_KINDS)]
    if ours_methods:
        out.status("analyze + solve")
        problem = _analyze(model, inputs, out.name, out.log)
        backend = "inductor" if "inductor" in compile_backends else None
        ours = our_strategies(model, problem, ours_methods, budgets, out.log, backend)
        strategies += [s for s in ours if wanted(s.key)]
    return strategies


def _check_gradients(runner: Runner, strategies: list[Strategy], out: _Reporter) -> dict[str, Row]:
    """One step per strategy, gradients against the first's (eager); also the warm-up, and
    torch.compile's compile. A strategy that fails keeps its row, with the failure noted."""
    rows: dict[str, Row] = {}
    ref = None
    for s in strategies:
        out.status(f"check {s.key}")
        row = Row(
            out.name,
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
            if s.reference is not None:
                row.note = _joined(row.note, _against(grads, runner.grads(s.reference), s))
        except Exception as e:
            row.note = f"failed: {type(e).__name__}: {str(e)[:120]}"
            out.log(f"[red]{s.key} {row.note}[/]")
        out.advance()
    return rows


def _against(grads: list, other: list, s: Strategy) -> str:
    """Whether `grads` are bit-equal to the strategy's second reference's, as a note."""
    if bit_equal(grads, other):
        return f"gradients torch.equal to {s.reference_name}'s"
    worst, _ = grad_error(grads, other)
    return f"gradients differ from {s.reference_name}'s by {worst:.1e}"


def _joined(*notes: str) -> str:
    return "; ".join(n for n in notes if n)


def _measure_peaks(
    runner: Runner, eager: Strategy, live: list[Strategy], rows: dict[str, Row], out: _Reporter
) -> dict[str, int]:
    """Each live strategy's peak into its row; eager's peak under each peak source used."""
    eager_peaks: dict[str, int] = {}
    for s in live:
        out.status(f"peak {s.key}")
        try:
            rows[s.key].peak = runner.peak(s.step, s.peak_source)
            if s.peak_source not in eager_peaks:
                eager_peaks[s.peak_source] = runner.peak(eager.step, s.peak_source)
        except Exception as e:
            rows[s.key].note = f"failed (peak): {type(e).__name__}: {str(e)[:120]}"
            out.log(f"[red]{s.key} {rows[s.key].note}[/]")
        out.advance()
    return eager_peaks


def _time_pairs(
    runner: Runner,
    eager: Strategy,
    live: list[Strategy],
    rows: dict[str, Row],
    reps: int,
    out: _Reporter,
) -> None:
    """`reps` rounds; in each, every live strategy right after an eager step, its ratio taken
    against that step."""
    eager_row = rows[eager.key]
    for rep in range(reps):
        for s in live:
            out.status(f"time {rep + 1}/{reps} {s.key}")
            try:
                before = runner.time(eager.step)
                eager_row.times.append(before)
                if s is not eager:
                    rows[s.key].times.append(runner.time(s.step))
                    rows[s.key].ratios.append(rows[s.key].times[-1] / before)
            except Exception as e:
                rows[s.key].note = f"failed (timing): {type(e).__name__}: {str(e)[:120]}"
            out.advance()


def _summarise(rows: dict[str, Row], eager: Row, eager_peaks: dict[str, int]) -> None:
    """Medians of the times, and eager's time and peak (under the row's peak source) beside
    each row."""
    eager.time = statistics.median(eager.times) if eager.times else math.nan
    for row in rows.values():
        if row.times:
            row.time = statistics.median(row.times)
        row.eager_time = eager.time
        row.eager_peak = eager_peaks.get(row.peak_source, math.nan)
        if row.peak_source == "profiler":
            row.note = _joined(
                row.note,
                "peak from the allocator profile (tracker cannot see inductor's buffers); "
                "ratio against eager under the same profile",
            )


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
    p.add_argument(
        "--compiled",
        action="store_true",
        help="instead: our native plan compiled with inductor against compiled eager at the "
        "activation_memory_budget of the same peak (`remat bench --compiled --help`)",
    )
    p.add_argument(
        "--strategies",
        action="store_true",
        help="instead: HF/diffusers checkpointing, torchtitan's selective AC, torchtune's "
        "offload, PyTorch's auto-SAC and compile's memory budget, predicted and measured, "
        "and our native plan at each one's peak (`remat bench --strategies --help`)",
    )
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

    given = sys.argv[1:] if argv is None else list(argv)
    if "--compiled" in given:
        from bench.compiled import main as compiled_main

        return compiled_main([a for a in given if a != "--compiled"])
    if "--strategies" in given:  # what the strategies users run cost, and ours at their peaks
        from bench.current import main as strategies_main

        return strategies_main([a for a in given if a != "--strategies"])
    args = _parser().parse_args(given)
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
