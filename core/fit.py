"""`fit`: the largest batch whose training step fits a device's memory, per strategy.

Everything a step holds on the device is counted:
- parameters and buffers (`Problem.param_bytes`), and the input batch (`input_bytes`);
- optimizer state: OPTIMIZERS[optimizer] times the trainable parameters' bytes (AdamW keeps
  two states per parameter in its dtype, SGD with momentum one, none zero);
- the step's peak, which holds the activations, the temporaries and the parameter gradients
  (a plan's budget counts them: docs/api.md).
Strategies, side by side: eager (store-all), checkpointing every layer (`checkpoint_blocks`),
ours (Rockmate's fastest plan in the memory left, kept when its predicted overhead is within
`overhead`) and ours with offloading (the faster of the `offload` solver's plan and Rockmate's,
same rule: offloading is an option, so it never fits a smaller batch than ours).

Each batch size is traced on fake inputs shaped from the model's example call (the meta
device works: nothing is allocated). The search per strategy is exact: every answer B was
planned at B, and B + 1 was planned and does not fit (a batch of `max_batch` that fits is
reported as such). The search starts at a predicted answer (`Fitter._guesses`, from the
batches in BASE), so a right prediction costs two more traced batches per answer: B and B + 1.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from core.errors import InfeasibleBudget, RematError
from core.footprint import OPTIMIZER_STATES, optimizer_bytes
from core.model_call import ModelCall
from core.plan import Plan
from core.problem import Problem, trace_recorded
from core.shapes import expand
from core.solvers import solve
from core.trace import split_call

OPTIMIZERS = OPTIMIZER_STATES  # states per trainable parameter, by optimizer name
BASE = (2, 3)  # batches traced first: eager's first line goes through them
ITERATIONS = 4  # Newton steps on a memory line before the exact search takes over
STRATEGIES = ("eager", "checkpoint every layer", "ours", "ours + offload")
_METHODS = {"ours": ("rockmate",), "ours + offload": ("offload", "rockmate")}


class FitError(RematError, ValueError):
    """A fit that cannot be asked: an unknown optimizer, a memory or overhead out of range."""


@dataclass(frozen=True)
class Fit:
    """One strategy's answer: the largest batch that fits (0: not even 1), and at it the
    step's peak, the total device bytes and the predicted time over eager's."""

    strategy: str
    batch: int
    peak: int = 0
    total: int = 0
    overhead: float = 1.0
    capped: bool = False  # max_batch fits: the true largest batch may be larger


@dataclass(frozen=True)
class FitReport:
    memory: int
    overhead_limit: float
    optimizer: str
    device: str
    shapes: str  # the inputs at batch 1, e.g. "[1, 512], [1, 512]"
    param_bytes: int
    optimizer_bytes: int
    fits: list[Fit]
    probes: dict[int, float] = field(default_factory=dict)  # batch -> seconds to analyse
    guesses: dict[str, int] = field(default_factory=dict)  # strategy -> predicted batch


class BatchProblems:
    """One call's problems per batch size (inputs resized on fake tensors), traced once each:
    what `Fitter` searches over, and the app's memory-against-batch chart."""

    def __init__(self, call: ModelCall, seq: int | None, device: str) -> None:
        self.call, self.device = call, device
        loss = call.loss_fn is not None
        tensors, self.spec = split_call(call.args, call.kwargs, call.targets, loss)
        self.tensors = tensors
        first = tuple(tuple(t.shape) for t in tensors)
        self.first = expand({"seq": [seq]}, first)[0] if seq is not None else first
        self.problems: dict[int, Problem] = {}
        self.seconds: dict[int, float] = {}

    def shapes(self, batch: int) -> tuple[tuple[int, ...], ...]:
        return expand({"batch": [batch]}, self.first)[0]

    def problem(self, batch: int) -> Problem:
        if batch not in self.problems:
            start = time.perf_counter()
            inputs = [
                (s, t.dtype, t.requires_grad)
                for s, t in zip(self.shapes(batch), self.tensors, strict=True)
            ]
            on = self.tensors[0].device if self.tensors else None
            self.problems[batch] = trace_recorded(
                self.call.model, inputs, self.spec, self.call.loss_fn, on, device=self.device
            )
            self.seconds[batch] = time.perf_counter() - start
        return self.problems[batch]


class Fitter:
    """Fits of one model's step at a sequence length, for any memory: the traced batches are
    shared between strategies and memories."""

    def __init__(
        self,
        call: ModelCall,
        *,
        seq: int | None = None,
        device: str = "h100",
        optimizer: str = "adamw",
        max_batch: int = 4096,
    ) -> None:
        if optimizer not in OPTIMIZERS:
            raise FitError(
                f"unknown optimizer {optimizer!r}: choose one of {', '.join(OPTIMIZERS)} "
                "(optimizer states per parameter: adamw 2, sgd 1, none 0)"
            )
        if seq is not None and seq <= 0:
            raise FitError(f"the sequence length must be a positive integer, not {seq}")
        self.optimizer, self.device, self.max_batch = optimizer, device, max_batch
        self._probe = BatchProblems(call, seq, device)

    @property
    def seconds(self) -> dict[int, float]:
        """Seconds each traced batch size took to analyse."""
        return dict(self._probe.seconds)

    def fit(self, memory: int, overhead: float = 1.2) -> FitReport:
        """The largest batch of each strategy whose step fits `memory` bytes."""
        if memory <= 0:
            raise FitError(f"the memory must be a positive number of bytes, not {memory}")
        if not overhead >= 1.0:
            raise FitError(f"the overhead is predicted time over eager's, at least 1.0: {overhead}")
        guesses = self._guesses(memory, overhead)
        fits = []
        for strategy in STRATEGIES:

            def at(batch: int, strategy: str = strategy) -> Fit | None:
                return self._evaluate(strategy, batch, memory, overhead)

            fits.append(self._largest(at, guesses[strategy], strategy))
        one = self._probe.problem(min(self._probe.problems))  # bytes alike at any batch
        return FitReport(
            memory,
            overhead,
            self.optimizer,
            self.device,
            ", ".join(str(list(s)) for s in self._probe.shapes(1)),
            one.param_bytes,
            optimizer_bytes(one, self.optimizer),
            fits,
            dict(self._probe.seconds),
            guesses,
        )

    def _fixed(self, problem: Problem) -> int:
        """Bytes held whatever the strategy: parameters, buffers, optimizer state, inputs."""
        return problem.param_bytes + optimizer_bytes(problem, self.optimizer) + problem.input_bytes

    def _evaluate(self, strategy: str, batch: int, memory: int, overhead: float) -> Fit | None:
        """The strategy's step at `batch` if it fits `memory` within `overhead`, else None."""
        problem = self._probe.problem(batch)
        fixed = self._fixed(problem)
        left = memory - fixed
        if left <= 0:
            return None
        if strategy == "eager":
            peak, over = problem.store_all_peak, 1.0
        elif strategy == "checkpoint every layer":
            try:
                plan = solve(problem, problem.store_all_peak, "checkpoint_blocks")
                peak, over = plan.predicted_peak, plan.overhead
            except InfeasibleBudget:  # checkpointing saves nothing here: eager's figures
                peak, over = problem.store_all_peak, 1.0
        else:  # with offloading: the offload solver's plan or Rockmate's, the faster fitting
            plans = [p for p in _plans(problem, left, _METHODS[strategy]) if p.overhead <= overhead]
            if not plans:
                return None
            best = min(plans, key=lambda p: p.predicted_time)
            peak, over = best.predicted_peak, best.overhead
        if peak > left:
            return None
        return Fit(strategy, batch, peak, fixed + peak, over)

    def _largest(self, fits: Callable[[int], Fit | None], guess: int, strategy: str) -> Fit:
        """The largest batch in 1..max_batch that fits: from `guess`, steps of 1, 4, 16... until
        bracketed, then bisection (assumes a batch that fits has every smaller one fit)."""
        top = self.max_batch
        lo, hi, best = 0, top + 1, None
        b, step = min(max(guess, 1), top), 1
        while hi - lo > 1:
            found = fits(b)
            if found is not None:
                lo, best = b, found
            else:
                hi = b
            if hi > top:
                b = min(lo + step, top)
            elif lo == 0:
                b = max(hi - step, 1)
            else:
                b = (lo + hi) // 2
            step *= 4
        if best is None:
            return Fit(strategy, 0)
        return Fit(best.strategy, best.batch, best.peak, best.total, best.overhead, lo == top)

    def _guesses(self, memory: int, overhead: float) -> dict[str, int]:
        """Each strategy's predicted answer, the batches it traces being those the exact
        search plans first.

        A step's bytes are piecewise affine in the batch (the larger of a part that grows
        with it, the activations, and one that does not, e.g. the gradients), so eager's and
        checkpointing's totals are followed by Newton steps on the line through batches b and
        b + 1 (from BASE's line, and from eager's answer) until b fits and b + 1 does not, or
        ITERATIONS steps (then the exact search steps and bisects from there). Ours (with
        or without offloading) is predicted on checkpointing's answer's problem, batch b0: a
        plan there of peak q is taken to grow like the store-all line through b0 and b0 + 1,
        c + (q - c) * B / b0 at batch B, so B is predicted to fit when the solver finds a plan
        within the overhead in the budget that maps to the memory left at B."""
        base = [b for b in BASE if b <= self.max_batch]
        if len(base) < 2:
            return dict.fromkeys(STRATEGIES, 1)

        def eager(b: int) -> int:
            p = self._probe.problem(b)
            return self._fixed(p) + p.store_all_peak

        def blocks(b: int) -> int:
            p = self._probe.problem(b)
            return self._fixed(p) + _ckpt_peak(p)

        first = _solve_line(base, [eager(b) for b in base], memory)
        guesses = {"eager": self._newton(eager, first, memory)}
        # checkpointing holds no more than eager: its search starts at eager's answer
        guesses["checkpoint every layer"] = self._newton(blocks, guesses["eager"], memory)
        b0 = max(min(guesses["checkpoint every layer"], self.max_batch - 1), 1)
        p0, p1 = self._probe.problem(b0), self._probe.problem(b0 + 1)
        xs, fixed = [b0, b0 + 1], [self._fixed(p0), self._fixed(p1)]
        c = p0.store_all_peak - b0 * (p1.store_all_peak - p0.store_all_peak)

        def fits(strategy: str, batch: int) -> bool:
            room = memory - _on_line(xs, fixed, batch)
            q = c + (room - c) * b0 // batch
            if q >= p0.store_all_peak:
                return True
            plans = _plans(p0, q, _METHODS[strategy]) if q > 0 else []
            return any(p.overhead <= overhead for p in plans)

        for strategy in ("ours", "ours + offload"):
            guesses[strategy] = _gallop(
                functools.partial(fits, strategy), guesses["eager"], self.max_batch
            )
        return guesses

    def _newton(self, need: Callable[[int], int], b: int, memory: int) -> int:
        """From `b`, Newton steps on `need` (bytes at a batch) towards its largest batch
        within `memory`: each step traces b and b + 1 and follows their line."""
        top = self.max_batch
        for _ in range(ITERATIONS):
            b = min(max(b, 1), top)
            if b == top:
                return b
            n0, n1 = need(b), need(b + 1)
            if n0 <= memory < n1:
                return b
            b = _solve_line([b, b + 1], [n0, n1], memory)
        return b


def _ckpt_peak(problem: Problem) -> int:
    """Checkpointing every layer's step peak (eager's where it saves nothing)."""
    try:
        return solve(problem, problem.store_all_peak, "checkpoint_blocks").predicted_peak
    except InfeasibleBudget:
        return problem.store_all_peak


def _plans(problem: Problem, budget: int, methods: tuple[str, ...]) -> list[Plan]:
    """The plans of `methods` that fit `budget` (a method with none is left out)."""
    plans = []
    for method in methods:
        try:
            plans.append(solve(problem, budget, method))
        except InfeasibleBudget:
            continue
    return plans


def _on_line(xs: list[int], ys: list[int], x: int) -> int:
    """The line through the first two points, at x."""
    return ys[0] + (x - xs[0]) * (ys[1] - ys[0]) // (xs[1] - xs[0])


def _solve_line(xs: list[int], ys: list[int], memory: int) -> int:
    """The largest batch whose bytes on the line through the first two points fit `memory`."""
    slope = max((ys[1] - ys[0]) // (xs[1] - xs[0]), 1)
    return max(1, xs[0] + (memory - ys[0]) // slope)


def _gallop(fits: Callable[[int], bool], start: int, top: int) -> int:
    """The largest batch in 1..top with `fits` (assumed monotone): doubling from `start`
    until bracketed, then bisection. Cheap predicates only: this is the prediction."""
    lo, hi, b = 0, top + 1, min(max(start, 1), top)
    while hi - lo > 1:
        if fits(b):
            lo = b
            b = min(2 * b, top) if hi > top else (lo + hi) // 2
        else:
            hi = b
            b = max(b // 2, 1) if lo == 0 else (lo + hi) // 2
        if b in (lo, hi):
            b = (lo + hi) // 2
    return max(lo, 1)
