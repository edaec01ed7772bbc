"""An InfeasibleBudget's `minimum`, and `minimum_budget`, are budgets that solve, for every
method: asking again at the minimum the error gave returns a plan within it."""

from __future__ import annotations

import pytest

import core
from core.errors import InfeasibleBudget
from core.frontier import minimum_budget
from core.solvers import available_methods
from sample_models import mha

# the whole-graph ILP takes seconds a solve here: it is asked once, below
METHODS = [m for m in available_methods() if m != "checkmate"]
# fractions of the store-all peak asked first; 0.3117 is where the greedy offload search
# stopped at a peak that a search at that peak does not reach
FRACTIONS = (0.05, 0.3, 0.3117, 0.45, 0.55, 0.6)


@pytest.fixture(scope="module")
def problem() -> core.Problem:
    model, inputs = mha.build()
    return core.analyze(model, inputs)


@pytest.mark.parametrize("method", METHODS)
def test_the_minimum_an_infeasible_budget_names_solves(problem, method):
    refused = 0
    for fraction in FRACTIONS:
        budget = int(problem.store_all_peak * fraction)
        try:
            core.solve(problem, budget, method)
        except InfeasibleBudget as e:
            refused += 1
            assert e.minimum > budget
            plan = core.solve(problem, e.minimum, method)
            assert plan.predicted_peak <= e.minimum
    assert refused  # the smallest fraction is below every method's minimum


@pytest.mark.parametrize("method", METHODS)
def test_minimum_budget_solves(problem, method):
    low = minimum_budget(problem, method)
    assert core.solve(problem, low, method).predicted_peak <= low


@pytest.mark.slow
def test_the_ilp_minimum_solves(problem):
    with pytest.raises(InfeasibleBudget) as info:
        core.solve(problem, int(problem.store_all_peak * 0.3), "checkmate")
    low = info.value.minimum
    assert core.solve(problem, low, "checkmate").predicted_peak <= low


def test_a_fresh_offload_refusal_names_a_budget_that_solves():
    """On a problem nothing was solved on yet (the greedy passes are shared per problem)."""
    model, inputs = mha.build()
    problem = core.analyze(model, inputs)
    budget = int(problem.store_all_peak * 0.3117)
    with pytest.raises(InfeasibleBudget) as info:
        core.solve(problem, budget, "offload")
    low = info.value.minimum
    assert core.solve(problem, low, "offload").predicted_peak <= low
