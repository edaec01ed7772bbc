"""`remat bench --runtime`: the runtime's own overhead, and how well measured op costs add up.

Overhead: a store_all plan through the runtime over eager PyTorch. Both run the same ops; the
difference is the interpreter walking the program. Measured with 1 thread, interleaved
repetitions (eager, planned, eager, ...), medians of wall time.

Calibration: the sum of `costs.measure_times` (each op timed alone, as `costs="measured"`
does) over the eager step, both in the thread's CPU time so other processes sharing the cores
do not count; eager steps and op measurements alternate over `rounds`, median ratio. Near 1
means the solvers' predicted times are the real step's; it moves with machine load, so it is
a reported figure, not a test.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Sequence

import torch
from torch import nn

import core
from core import build_graph, capture
from core.costs import measure_times
from sample_models import build

DEFAULT_MODELS = [
    "gpt-tiny",
    "gpt-small-6l",
    "resnet-tiny",
    "resnet18",
    "vit-tiny",
    "regnet-tiny",
    "mlp-tiny",
]


def runtime_overhead(name: str, reps: int = 15) -> tuple[float, float]:
    """Median step seconds of (eager, store_all plan through the runtime) for a sample model."""
    model, inputs = build(name)
    plan = core.solve(core.analyze(model, inputs), 1.0, method="store_all")
    wrapped = core.apply_plan(model, plan)
    times: dict[str, list[float]] = {"eager": [], "planned": []}
    runners = {"eager": model, "planned": wrapped}
    for rep in range(reps + 2):  # two warm-up rounds
        for label, run in runners.items():
            model.zero_grad(set_to_none=True)
            torch.manual_seed(rep)
            start = time.perf_counter()
            run(*inputs).backward()
            if rep >= 2:
                times[label].append(time.perf_counter() - start)
    return statistics.median(times["eager"]), statistics.median(times["planned"])


def eager_step_cpu_seconds(model: nn.Module, inputs: Sequence[torch.Tensor], steps: int) -> float:
    """Median thread CPU seconds of `model(*inputs).backward()`, gradients reset each step."""
    model(*inputs).backward()  # warm-up
    seconds = []
    for _ in range(steps):
        model.zero_grad(set_to_none=True)
        start = time.thread_time()
        model(*inputs).backward()
        seconds.append(time.thread_time() - start)
    return statistics.median(seconds)


def cost_calibration(name: str, rounds: int = 5, steps: int = 15) -> float:
    """Median over `rounds` of (sum of measured op seconds) / (eager step seconds)."""
    model, inputs = build(name)
    graph = build_graph(capture(model, inputs))
    ratios = []
    for _ in range(rounds):
        eager = eager_step_cpu_seconds(model, inputs, steps)
        ratios.append(sum(measure_times(graph)) / eager)
    return statistics.median(ratios)


def main(argv: list[str] | None = None) -> int:
    """Print one row per model: eager and planned step times, their ratio, the calibration."""
    parser = argparse.ArgumentParser(prog="remat bench --runtime", description=__doc__)
    parser.add_argument("--models", default=",".join(DEFAULT_MODELS))
    parser.add_argument("--reps", type=int, default=15)
    parser.add_argument(
        "--rounds", type=int, default=5, help="calibration rounds (0 leaves it out)"
    )
    args = parser.parse_args(argv)
    if args.reps < 1 or args.rounds < 0:
        parser.error("--reps must be at least 1 and --rounds at least 0")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        print(
            f"runtime overhead: store_all plan / eager step time (1 thread, median of {args.reps}); "
            f"op costs: sum of measured op times / eager step (CPU time, median of {args.rounds})"
        )
        print(f"{'model':<16} {'eager ms':>10} {'planned ms':>11} {'ratio':>7} {'op costs':>9}")
        for name in args.models.split(","):
            eager, planned = runtime_overhead(name, args.reps)
            calibration = f"{cost_calibration(name, args.rounds):9.3f}" if args.rounds else ""
            print(
                f"{name:<16} {eager * 1e3:>10.2f} {planned * 1e3:>11.2f} "
                f"{planned / eager:>7.3f} {calibration}"
            )
    finally:
        torch.set_num_threads(threads)
    return 0
