"""Solvers: one module per strategy, each `solve(problem, budget) -> Plan`.

`core.solve` parses the budget, looks the method up in `SOLVERS` and checks the result with
the simulator: a returned plan never exceeds its budget.
"""

from __future__ import annotations

import math
import re
import time
from typing import Protocol

from core.errors import BudgetError, InfeasibleBudget, fmt_bytes
from core.native import solver as native
from core.native.lowering import runs_at_peak
from core.plan import Plan
from core.problem import Problem
from core.reorder import solve_reordered
from core.solvers import (
    checkmate,
    checkpoint_blocks,
    offload,
    pofo,
    rockmate,
    rotor,
    sqrt_n,
    store_all,
)


class Solver(Protocol):
    """A strategy: the least-time plan it finds whose predicted peak fits `budget` bytes
    (at most the store-all peak), or InfeasibleBudget with the smallest it can meet."""

    def __call__(self, problem: Problem, budget: int) -> Plan: ...


SOLVERS: dict[str, Solver] = {
    "store_all": store_all.solve,
    "checkpoint_blocks": checkpoint_blocks.solve,
    "sqrt_n": sqrt_n.solve,
    "rotor": rotor.solve,
    "rockmate": rockmate.solve,
    "checkmate": checkmate.solve,
    "offload": offload.solve,
    "pofo": pofo.solve,
    "native": native.solve,
}
METHODS = tuple(SOLVERS)

MAX_BUDGET = 2**62  # bytes: far beyond any device, small enough to stay exact

_UNITS = {
    "": 1,
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
}


def parse_budget(budget: int | float | str, store_all_peak: int) -> int:
    """Bytes from an int (bytes), a float fraction of the store-all peak (0.5), or a string
    the command line accepts: bytes with a unit ("2GB", "512MiB", "3e3B"), a percentage
    ("50%"), or a bare number read as the Python literal it spells: "4096" is bytes like 4096,
    "0.5" (a decimal point or an exponent) a fraction like 0.5. Infinite, NaN, zero, negative
    and absurdly large budgets (over 2**62 bytes) are refused with a BudgetError."""
    if isinstance(budget, str):
        text = budget.strip().lower().replace(" ", "")
        m = re.fullmatch(r"([0-9]*\.?[0-9]+(?:e[+-]?\d+)?)(%|[kmgt]?i?b)?", text)
        if not m:
            raise BudgetError(
                f"cannot read the budget {budget!r}: write bytes with a unit ('2GB', '512MiB'), "
                "a percentage of the store-all peak ('50%') or a fraction of it ('0.5')"
            )
        number, unit = m.group(1), m.group(2)
        if unit is None:  # a bare number: what Python would read
            is_int = number.isdigit()
            return parse_budget(int(number) if is_int else float(number), store_all_peak)
        value = float(number)
        if unit == "%":
            return parse_budget(value / 100, store_all_peak)
        return parse_budget(_whole(value * _UNITS[unit], budget), store_all_peak)
    if isinstance(budget, bool) or not isinstance(budget, (int, float)):
        raise BudgetError(
            f"a budget is bytes (int), a fraction (float) or a string, not {budget!r}"
        )
    if isinstance(budget, float):
        if not math.isfinite(budget) or budget <= 0:
            raise BudgetError(
                f"the budget must be a positive, finite fraction of the peak, not {budget}"
            )
        return parse_budget(_whole(budget * store_all_peak, budget), store_all_peak)
    if budget <= 0:
        raise BudgetError(f"the budget must be a positive number of bytes, not {budget}")
    if budget > MAX_BUDGET:
        raise BudgetError(f"the budget {budget} bytes is beyond any memory (max 2**62 bytes)")
    return budget


def _whole(value: float, asked: object) -> int:
    """Whole bytes from a finite product, or a BudgetError naming what was asked."""
    if not math.isfinite(value) or value > MAX_BUDGET:
        raise BudgetError(f"the budget {asked!r} is beyond any memory (max 2**62 bytes)")
    return int(value)


def solve(
    problem: Problem, budget: int | float | str, method: str = "rockmate", reorder: bool = False
) -> Plan:
    """The plan of `method` with the least predicted time whose peak fits `budget`.

    reorder: also reorder the plan's runs to lower its peak at no extra compute
    (`core.reorder`); the method may then plan for more than `budget` and recompute less.
    """
    if method not in available_methods():
        raise ValueError(
            f"unknown method {method!r}: choose one of {', '.join(available_methods())}"
        )
    peak = problem.store_all_peak
    asked = parse_budget(budget, peak)
    start = time.perf_counter()
    # Solvers plan for at most the store-all peak, where nothing needs recomputing; a method
    # whose least peak is above it (checkpoint_blocks on a model whose blocks join) is
    # planned at that least peak when the budget allows it.
    effective = min(asked, peak)
    try:
        plan = _solve(problem, effective, method, reorder)
    except InfeasibleBudget as e:
        if not peak < e.minimum <= asked:
            if effective >= problem.floor.nbytes:
                raise
            raise InfeasibleBudget(
                e.budget, e.minimum, e.method, problem.floor.describe()
            ) from None
        effective = e.minimum
        plan = _solve(problem, effective, method, reorder)
    notes = []
    if effective > peak:
        notes.append(
            f"this method's least peak here, {fmt_bytes(effective)}, is above the store-all "
            f"peak {fmt_bytes(peak)}: plain PyTorch (store_all) needs less"
        )
    elif asked > effective:
        notes.append(
            f"the budget {fmt_bytes(asked)} is above the store-all peak {fmt_bytes(peak)}: "
            f"planned for {fmt_bytes(peak)}, where nothing needs recomputing"
        )
    plan = plan.replace(solve_seconds=time.perf_counter() - start, budget=asked)
    plan = plan.with_notes(*notes, first=True)
    runs_at = runs_at_peak(plan)
    if runs_at > effective:
        floor = problem.floor.describe() if effective < problem.floor.nbytes else ""
        raise InfeasibleBudget(asked, runs_at, method, floor)
    return plan


def _solve(problem: Problem, budget: int, method: str, reorder: bool) -> Plan:
    if reorder:
        return solve_reordered(problem, budget, SOLVERS[method], method)
    return SOLVERS[method](problem, budget)


def available_methods() -> tuple[str, ...]:
    return METHODS
