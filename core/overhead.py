"""`remat bench --runtime`: the runtime's own overhead, store_all plan over eager PyTorch.

Both run the same ops; the difference is the interpreter walking the program. Measured with
1 thread, interleaved repetitions (eager, planned, eager, ...), medians.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

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
    import core
    from sample_models import build

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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="remat bench --runtime", description=__doc__)
    parser.add_argument("--models", default=",".join(DEFAULT_MODELS))
    parser.add_argument("--reps", type=int, default=15)
    args = parser.parse_args(argv)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        print(
            f"runtime overhead: store_all plan / eager step time (1 thread, median of {args.reps})"
        )
        print(f"{'model':<16} {'eager ms':>10} {'planned ms':>11} {'ratio':>7}")
        for name in args.models.split(","):
            eager, planned = runtime_overhead(name, args.reps)
            print(f"{name:<16} {eager * 1e3:>10.2f} {planned * 1e3:>11.2f} {planned / eager:>7.3f}")
    finally:
        torch.set_num_threads(threads)
    return 0
