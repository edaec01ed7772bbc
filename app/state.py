"""The app's view of `core`: which models and methods exist, and cached problems and plans.

All planning is `core.analyze` / `core.solve` / `core.tradeoff`; this module only caches their
results (see `app.cache`). Reading a plan back is `app.readback` (numbers) and `app.explain`
(words).
"""

from __future__ import annotations

import logging
import threading
import weakref
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass
from functools import partial

import torch

import core
import sample_models
from app.cache import DERIVED, LRU, PLANS, PROBLEMS, check_cancelled
from app.explain import tensor_rows
from app.models import as_call, resolve_builder
from app.readback import live_bands
from app.strategies import AUTOSAC_BUDGETS, AUTOSAC_MAX_OPS, FIXED, StrategyPoint
from core import Interrupted, ModelCall, available_methods, device_memory, minimum_budget
from core import strategies as imports

log = logging.getLogger(__name__)

DEFAULT_MODEL = "gpt-tiny"
BASELINES = ("store_all", "checkpoint_blocks", "sqrt_n")
CHECKMATE_MAX_OPS = 60  # larger graphs' whole-graph ILPs take too long to offer (docs/tuning.md)
METHOD_LABELS = {
    "rockmate": "Rockmate (block ILPs + chain DP)",
    "rotor": "Rotor (chain DP)",
    "checkmate": "Checkmate (whole-graph ILP)",
    "store_all": "Store all (plain PyTorch)",
    "checkpoint_blocks": "Checkpoint every block",
    "sqrt_n": "√n checkpoints (Chen et al.)",
    "offload": "remat + offload (Rockmate, then greedy offloads)",
    "pofo": "remat + offload (POFO chain DP)",
}
DEVICES = ("cpu", "a100", "h100", "v100", "rtx4090")
# Methods that also offload: the offload switch re-solves with one of them (the Studio's
# `offload_method`), so the method list offers only remat methods.
OFFLOAD_METHODS = ("offload", "pofo")
DEFAULT_OFFLOAD = "offload"
PARALLEL_DEVICES = (1, 2, 4, 8)  # the devices control's choices
# `core.parallel_plan` re-traces the model once per tensor-parallel degree: seconds for
# graphs this small, minutes for gpt2-small; larger models get a note instead
PARALLEL_MAX_OPS = 300
# the step switches: the optimizer's update inside the step (AdamW), the chunked loss head
STEP_OPTIONS = ("optimizer", "chunked")
STEP_LABELS = {
    "optimizer": "optimizer in the step (AdamW)",
    "chunked": "chunked loss head",
}
OFFLOAD_POINTS = 8  # budgets of the remat+offload curve (an offload solve each: seconds)

# Tracing patches process-wide state (make_fx's patcher, fake modes): two analyses in two
# threads at once failed with "CURRENT_PATCHER is None". One analysis (or measured run, whose
# dispatch mode must not see a trace) at a time.
_ANALYZE = threading.Lock()


# Analyses the page waits on (a model switch) go before the background charts' traces (memory
# against batch: five traces of the model on screen, a minute on gpt2-small here): those
# take the lock only while no analysis is waiting for it.
_WAITING = threading.Condition()
_waiting = 0


def studio_lock() -> threading.Lock:
    """The lock analyses and measured runs take: one at a time in this process."""
    return _ANALYZE


def analyses_waiting() -> int:
    """How many analyses wait for `studio_lock()` now."""
    return _waiting


@contextmanager
def first_in_line() -> Iterator[None]:
    """`studio_lock()` for an analysis the page waits on: background traces let it go first."""
    global _waiting
    with _WAITING:
        _waiting += 1
        _WAITING.notify_all()
    try:
        with _ANALYZE:
            yield
    finally:
        with _WAITING:
            _waiting -= 1
            _WAITING.notify_all()


@contextmanager
def after_the_page() -> Iterator[None]:
    """`studio_lock()` for a background chart's trace: taken only while no analysis waits."""
    while True:
        with _WAITING:
            _WAITING.wait_for(lambda: _waiting == 0)
        _ANALYZE.acquire()
        if _waiting == 0:
            break
        _ANALYZE.release()  # an analysis came in between: it goes first
    try:
        yield
    finally:
        _ANALYZE.release()


@dataclass(frozen=True)
class Point:
    budget: int
    peak: int
    overhead: float  # predicted time / store-all time
    found_at: int = 0  # the budget whose plan this is (`core.TradeoffPoint.found_at`)


class Studio:
    """Models the page can open, and what has been computed for them. `offload_method` is
    the solver the offload switch re-solves with."""

    def __init__(
        self,
        extra_models: dict[str, Callable] | None = None,
        offload_method: str = DEFAULT_OFFLOAD,
    ) -> None:
        if offload_method not in OFFLOAD_METHODS or offload_method not in available_methods():
            known = [m for m in OFFLOAD_METHODS if m in available_methods()]
            raise ValueError(
                f"the offload switch needs an offloading method, not {offload_method!r}: "
                f"choose one of {', '.join(known)}"
            )
        self.offload_method = offload_method
        self.builders: dict[str, Callable[[], ModelCall]] = {
            name: resolve_builder(name) for name in sample_models.names()
        }
        for name, build in (extra_models or {}).items():  # (model, inputs) or a ModelCall
            self.builders[name] = partial(_called, build, name)
        self.problems = LRU(PROBLEMS)
        self.plans = LRU(PLANS)
        self.derived = LRU(DERIVED)
        # each cached problem's model, kept alive while the problem is: the imported
        # strategies run on the model itself (`core.strategies`), which the problem only
        # references weakly
        self.models: weakref.WeakKeyDictionary[core.Problem, torch.nn.Module] = (
            weakref.WeakKeyDictionary()
        )

    # -------------------------------------------------------------- problems

    @staticmethod
    def key(model: str, costs: str, device: str, step: Sequence[str] = ()) -> str:
        """ "model|costs|device", plus "|optimizer+chunked" when `step` (STEP_OPTIONS) asks
        for the optimizer's update in the step or the chunked loss head."""
        parts = [model, costs, "here" if costs == "measured" else device]
        chosen = [o for o in STEP_OPTIONS if o in step]
        return "|".join([*parts, "+".join(chosen)] if chosen else parts)

    def describe(self, model: str) -> str:
        try:
            return sample_models.describe(model)
        except KeyError:
            return model

    def problem(
        self, key: str, progress: Callable[[str, float], None] | None = None
    ) -> core.Problem:
        """The analysed problem for `key` (cached; analysed on a miss, with `progress`)."""

        def make() -> core.Problem:
            model_name, costs, device, *rest = key.split("|")
            step = rest[0].split("+") if rest else []
            if model_name not in self.builders:
                raise KeyError(f"unknown model {model_name!r}")
            report = progress or (lambda stage, frac: None)
            report("building the model", 0.0)
            call = self.builders[model_name]()
            report("waiting for another analysis to finish", 0.1)

            def tick(stage: str, frac: float) -> None:  # the analysis is 10-100%
                check_cancelled()
                report(stage, 0.1 + 0.9 * frac)

            with first_in_line():
                check_cancelled()
                problem = call.analyze(
                    costs=costs,
                    device="cpu" if device == "here" else device,
                    name=model_name,
                    progress=tick,
                    **step_options(call, step),
                )
            self.models[problem] = call.model
            return problem

        return self.problems.get_or_make(key, make)

    # -------------------------------------------------------------- methods

    def methods(self, problem: core.Problem) -> list[str]:
        """Remat methods offered for this problem (offloading ones are the switch's):
        whole-graph Checkmate only on small graphs."""
        out = []
        for m in available_methods():
            if m == "checkmate" and len(problem.graph.ops) >= CHECKMATE_MAX_OPS:
                continue
            if m in OFFLOAD_METHODS:
                continue
            out.append(m)
        order = ["rockmate", "rotor", "checkmate", *BASELINES]
        return sorted(out, key=lambda m: order.index(m) if m in order else len(order))

    @staticmethod
    def default_method() -> str:
        methods = available_methods()
        for m in ("rockmate", "rotor", "checkpoint_blocks"):
            if m in methods:
                return m
        return methods[0]

    # -------------------------------------------------------------- plans

    def plan(self, key: str, method: str, budget: int) -> core.Plan:
        """`core.solve` for (problem, method, budget bytes), cached. Raises InfeasibleBudget."""
        problem = self.problem(key)
        return self.plans.get_or_make(
            (key, method, int(budget)), lambda: core.solve(problem, int(budget), method)
        )

    def native_peak(self, key: str, method: str, budget: int) -> int:
        """The predicted peak of `plan(key, method, budget)` under native execution
        (`core.lower`), cached."""
        return self.derived.get_or_make(
            ("native", key, method, int(budget)),
            lambda: core.lower(self.plan(key, method, budget)).prediction.peak,
        )

    def minimum(self, key: str, method: str) -> int:
        """Smallest budget (bytes) `method` fits."""
        return self.derived.get_or_make(
            ("minimum", key, method), lambda: minimum_budget(self.problem(key), method)
        )

    def tradeoff(
        self, key: str, method: str, progress: Callable[[float], None] | None = None
    ) -> list[Point]:
        """Points (budget, predicted peak, overhead) of `method`, from `core.tradeoff`
        (cached; `progress(fraction)` before each solve, which may cancel)."""

        def make() -> list[Point]:
            def step(fraction: float) -> None:
                check_cancelled()
                if progress:
                    progress(fraction)

            points = core.tradeoff(self.problem(key), method, progress=step)
            return [Point(p.budget, p.predicted_peak, p.overhead, p.found_at) for p in points]

        return self.derived.get_or_make(("tradeoff", key, method), make)

    def tradeoff_first(self, key: str, method: str) -> tuple[list[Point], list[int]] | None:
        """A first draw of `tradeoff(key, method)` while rockmate's whole-graph ILP is still
        to run (seconds a budget, on graphs of at most `WHOLE_GRAPH_MAX_OPS` ops): the points
        at the budgets that need no ILP, each the plan `plan` gives there, and the budgets
        left out. None when the curve is cached or no budget waits for the ILP (then the
        curve is cached: with nothing left out, it is the whole one)."""
        if method != "rockmate" or ("tradeoff", key, method) in self.derived:
            return None
        problem = self.problem(key)
        if len(problem.graph.ops) > core.WHOLE_GRAPH_MAX_OPS:
            return None
        left: list[int] = []

        def skip(budget: int) -> bool:
            check_cancelled()
            if core.ilp_pending(problem, budget):
                left.append(budget)
                return True
            return False

        found = core.tradeoff(problem, method, skip=skip)
        points = [Point(p.budget, p.predicted_peak, p.overhead, p.found_at) for p in found]
        if not left:
            self.derived.get_or_make(("tradeoff", key, method), lambda: points)
            return None
        return points, left

    def offload_tradeoff(
        self, key: str, progress: Callable[[float], None] | None = None
    ) -> list[Point]:
        """The remat+offload curve: `core.tradeoff` with the offload method, `OFFLOAD_POINTS`
        budgets from its minimum (bisected) to the peak. Cached; seconds to compute."""

        def make() -> list[Point]:
            def step(fraction: float) -> None:
                check_cancelled()
                if progress:
                    progress(fraction)

            problem = self.problem(key)
            points = core.tradeoff(problem, self.offload_method, OFFLOAD_POINTS, step)
            return [Point(p.budget, p.predicted_peak, p.overhead, p.found_at) for p in points]

        return self.derived.get_or_make(("offload-tradeoff", key, self.offload_method), make)

    def parallel(self, key: str, devices: int) -> core.ParallelPlan:
        """`core.parallel_plan` over `devices` devices of the key's device preset (memory and
        link), rockmate per rank; cached. Re-traces the model per tp degree: seconds."""

        def make() -> core.ParallelPlan:
            model_name, _, device = key.split("|")
            problem = self.problem(key)
            model = problem.model_ref() if problem.model_ref else None
            if model is None:  # the analysed model is gone: the same architecture, again
                model = self.builders[model_name]().model
            preset = "cpu" if device == "here" else device
            with first_in_line():  # traces: one at a time, before the background charts
                check_cancelled()
                return core.parallel_plan(
                    problem, devices, device_memory(preset), preset, model=model
                )

        return self.derived.get_or_make(("parallel", key, devices), make)

    # -------------------------------------------------------------- imported strategies

    def imported(
        self,
        key: str,
        method: str,
        budget: int | None = None,
        lock: Callable[[], AbstractContextManager[None]] = first_in_line,
    ) -> imports.Imported:
        """The strategy `method` (`core.strategies.METHODS`) applied to the analysed model,
        predicted by the native simulation; auto-SAC solved for `budget` bytes. Cached; made
        under `lock` (the studio's: auto-SAC runs the model under fake tensors and times its
        ops, a diffusers model's checkpointed blocks are found by a fake forward). Raises
        `NotApplicable` with the reason."""
        problem = self.problem(key)
        wanted = int(budget) if method == "autosac" and budget is not None else None

        def make() -> imports.Imported:
            if method == "autosac":
                autosac_refused(problem)
            with lock():
                check_cancelled()
                return imports.by_method(problem, method, wanted)

        return self.derived.get_or_make(("imported", key, method, wanted), make)

    def strategies(self, key: str) -> dict[str, str | None]:
        """Each imported strategy for the analysis `key`: None where it applies, else why
        not (cached). The fixed ones are imported here (milliseconds each); auto-SAC, which
        solves per budget, only needs decoder layers and a graph it can time."""

        def make() -> dict[str, str | None]:
            problem = self.problem(key)
            out: dict[str, str | None] = {}
            for method in imports.METHODS:
                try:
                    if method in FIXED:
                        self.imported(key, method)
                    else:
                        autosac_refused(problem)
                        model = self.models.get(problem)
                        if model is None:
                            raise imports.NotApplicable(f"the model of {key} is gone")
                        imports.decoder_layers(model)
                    out[method] = None
                except Interrupted:
                    raise
                except core.RematError as err:
                    out[method] = str(err)
                except Exception as err:  # a failure of its import: the page stays up
                    log.exception("importing %s on %s failed", method, key)
                    out[method] = f"importing it failed here ({type(err).__name__}: {err})"
            return out

        return self.derived.get_or_make(("strategies", key), make)

    def strategy_points(self, key: str, autosac: bool = False) -> list[StrategyPoint]:
        """The applicable strategies' predicted (peak, time) for the trade-off chart: one
        point per fixed plan, and with `autosac` auto-SAC at each of `AUTOSAC_BUDGETS` where
        its ILP checkpoints something. Cached; the trade-off chart's job computes them, under
        the background charts' lock rule (`after_the_page`). Auto-SAC first times every op
        of the step (7.5 s on gpt-tiny here): the chart asks for it once auto-SAC is chosen,
        not on every analysis (`autosac_drawn`)."""

        def fixed() -> list[StrategyPoint]:
            offered = self.strategies(key)
            points = []
            for method in FIXED:
                if offered[method] is None:
                    p = self.imported(key, method, lock=after_the_page).prediction
                    points.append(StrategyPoint(method, p.peak, p.overhead))
            return points

        def solved() -> list[StrategyPoint]:
            if self.strategies(key)["autosac"] is not None:
                return []
            peak = self.problem(key).store_all_peak
            points = []
            for fraction in AUTOSAC_BUDGETS:
                budget = int(fraction * peak)
                try:
                    got = self.imported(key, "autosac", budget, lock=after_the_page)
                except Interrupted:
                    raise
                except core.RematError:
                    continue  # refused at this budget: no point
                except Exception:  # torch's own tooling failing on this model
                    log.exception("auto-SAC at %s bytes on %s failed", budget, key)
                    break
                if got.modules:  # sac_milp found a solution: it checkpoints something
                    p = got.prediction
                    points.append(StrategyPoint("autosac", p.peak, p.overhead, budget))
            return points

        points = self.derived.get_or_make(("strategy-points", key), fixed)
        if autosac:
            points = points + self.derived.get_or_make(("autosac-points", key), solved)
        return points

    def autosac_drawn(self, key: str) -> bool:
        """Whether auto-SAC's points of the analysis `key` are computed (cached)."""
        return ("autosac-points", key) in self.derived

    def tensors(self, key: str, method: str, budget: int) -> list[dict]:
        """The per-tensor view's rows for a plan (cached: the view and the peak list share it)."""

        def make() -> list[dict]:
            problem, plan = self.problem(key), self.plan(key, method, budget)
            return tensor_rows(problem, plan, live_bands(problem, plan))

        return self.derived.get_or_make(("tensors", key, method, int(budget)), make)


def autosac_refused(problem: core.Problem) -> None:
    """NotApplicable where the page does not offer auto-SAC: its statistics time every op
    of the step for real on this machine (a model on the meta device has no data to time; a
    large graph takes minutes)."""
    if len(problem.graph.ops) > AUTOSAC_MAX_OPS:
        raise imports.NotApplicable(
            f"auto-SAC times each of the step's ops here: offered on graphs of at most "
            f"{AUTOSAC_MAX_OPS} ops, this one has {len(problem.graph.ops)} "
            f"(`remat plan {problem.name} --method autosac --budget BYTES` runs it)"
        )
    model = problem.model_ref() if problem.model_ref is not None else None
    if model is not None and any(p.is_meta for p in model.parameters()):
        raise imports.NotApplicable(
            "auto-SAC times each op for real: a model on the meta device has no data to time"
        )


def step_options(call: ModelCall, step: Sequence[str]) -> dict:
    """`core.analyze`'s options for the page's step switches: AdamW (torch's defaults) over
    the model's parameters, and the chunked loss head."""
    options: dict = {}
    if "optimizer" in step:
        params = [p for p in call.model.parameters() if p.requires_grad]
        options["optimizer"] = torch.optim.AdamW(params, foreach=False)
    if "chunked" in step:
        options["loss_head"] = "chunked"
    return options


def base_key(key: str) -> str:
    """The key of the same analysis without the step switches."""
    return "|".join(key.split("|")[:3])


def _called(build: Callable, name: str) -> ModelCall:
    return as_call(build(), name)
