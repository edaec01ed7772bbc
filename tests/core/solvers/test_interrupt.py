"""`core.stop_when`: a caller stops a solve in progress, the whole-graph ILP included."""

import threading

import pytest

import core
from sample_models import build


def _ilp_budget(problem: core.Problem) -> int:
    """A budget of the trade-off curve's where rockmate still runs the whole-graph ILP."""
    low, high = core.minimum_budget(problem, "rockmate"), problem.store_all_peak
    budgets = [low + (high - low) * i // 23 for i in range(24)]
    return next(b for b in budgets if core.ilp_pending(problem, b))


def test_a_stopped_ilp_raises_interrupted_and_memoises_nothing():
    problem = core.analyze(*build("gpt-1layer"))
    budget = _ilp_budget(problem)
    with pytest.raises(core.Interrupted, match="stop_when"):
        with core.stop_when(lambda: True):  # stops at the ILP's first interrupt callback
            core.solve(problem, budget, "rockmate")
    assert core.ilp_pending(problem, budget)  # nothing memoised from the stopped solve
    asked = threading.Event()
    with core.stop_when(asked.is_set):  # never asked: the ILP runs to its node limit
        plan = core.solve(problem, budget, "rockmate")
    assert plan.predicted_peak <= budget
    assert not core.ilp_pending(problem, budget)
    assert core.solve(problem, budget, "rockmate").predicted_time == plan.predicted_time
