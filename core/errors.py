"""Errors a user can act on. Each message says what is wrong and what to do."""

from __future__ import annotations

from typing import Any


class RematError(Exception):
    """Base class for every error Remat Studio raises on purpose."""


class UnsupportedModel(RematError):
    """The model cannot be captured as a static graph of ATen ops."""

    def __init__(self, construct: str, module: str, hint: str = "") -> None:
        self.construct = construct
        self.module = module
        where = f"in module '{module}'" if module else "at the top level of the model"
        msg = f"cannot trace {construct} {where}"
        if hint:
            msg += f": {hint}"
        super().__init__(msg)


class CostsDiffer(UnsupportedModel):
    """A plan's recorded op times are for another step than the one traced now (another
    count of ops): `trace` is the step traced now, for saying what differs."""

    def __init__(self, recorded: int, traced: int, trace: Any) -> None:
        self.trace = trace
        super().__init__(
            f"the step with the recorded costs: they time {recorded} ops, the step traced "
            f"has {traced}",
            "",
            "the plan was made for another step: make a new plan for this model",
        )


class InfeasibleBudget(RematError):
    """No plan of the asked method fits the budget; `.minimum` is the smallest that does."""

    def __init__(self, budget: int, minimum: int, method: str, floor: str = "") -> None:
        self.budget = budget
        self.minimum = minimum
        self.method = method
        why = f"; no plan of any method goes below {floor}" if floor else ""
        super().__init__(
            f"no '{method}' plan fits a budget of {fmt_bytes(budget)}; the smallest feasible "
            f"budget for this method is {fmt_bytes(minimum)} ({minimum} bytes): raise the budget "
            f"or choose another method{why}"
        )


class PlanMismatch(RematError):
    """The model or inputs differ from the graph the plan was made for."""


class PlanFileError(RematError):
    """A plan file is truncated, foreign, of a newer format, or unsafe."""


class InvalidPlan(RematError, ValueError):
    """A program that cannot run: an input not live, a double free, a misplaced backward op."""


class Interrupted(RematError):
    """A solve stopped because its caller asked (`core.stop_when`); it returned no plan."""


class BudgetError(RematError, ValueError):
    """A budget that is not a number of bytes or a fraction of the store-all peak."""


def fmt_bytes(n: float) -> str:
    """Human-readable bytes, binary units (1 MiB = 2**20 bytes)."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")
