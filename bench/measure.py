"""How `remat bench` measures a strategy: gradients against a reference, peak bytes (the storage
tracker, the CPU allocator's profile or CUDA's), and step times, every step from the same
model state and seed, on one thread."""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import ExitStack, contextmanager

import torch
from torch import nn

from bench.strategies import StepFn
from core import StorageTracker, step_tensors


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


class Runner:
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


def bit_equal(grads: list, other: list) -> bool:
    """Every gradient torch.equal to the other's (None where the other's is None)."""
    return all(
        (g is None and o is None) or (g is not None and o is not None and torch.equal(g, o))
        for g, o in zip(grads, other, strict=True)
    )


@contextmanager
def bench_settings() -> Iterator[None]:
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
