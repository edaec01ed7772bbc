"""An InfeasibleBudget's `minimum`, and `minimum_budget`, are budgets that solve, for every
method: asking again at the minimum the error gave returns a plan within it."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

import core
from core import solvers
from core.errors import InfeasibleBudget
from core.frontier import minimum_budget
from core.schedule import store_all_plan
from core.solvers import available_methods, runs_at_peak
from sample_models import mha

# the whole-graph ILP takes seconds a solve here: it is asked once, below
METHODS = [m for m in available_methods() if m != "checkmate"]
# fractions of the store-all peak asked first; 0.3117 is where the greedy offload search
# stopped at a peak that a search at that peak does not reach
FRACTIONS = (0.05, 0.3, 0.3117, 0.45, 0.55, 0.6)


@pytest.fixture(scope="module")
def problem() -> Iterator[core.Problem]:
    model, inputs = mha.build()
    yield core.analyze(model, inputs)  # the model kept: the native method lowers on it


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


# the samples whose blocks join (two inputs, one tower run on both when shared): the least
# peak of some methods is above store-all's there
JOINS = ("two-tower-tiny", "siamese-tiny")


@pytest.mark.parametrize("name", JOINS)
@pytest.mark.parametrize("method", METHODS)
def test_every_methods_minimum_solves_on_the_join_samples(analysed, name, method):
    """A 1-byte budget is refused with a minimum, and the minimum solves within itself, above
    the store-all peak too (solve caps a budget at store-all only where that solves)."""
    problem = analysed(name)[2]
    with pytest.raises(InfeasibleBudget) as info:
        core.solve(problem, 1, method)
    low = info.value.minimum
    plan = core.solve(problem, low, method)
    assert runs_at_peak(plan) <= low  # native execution's peak for the "native" method


def test_a_minimum_above_store_all_solves(analysed, monkeypatch):
    """A method whose least peak is above store-all's (the issue's: every block checkpointed
    on a two-input model with a shared tower, 39.1 MiB against 38.1): asking for store-all
    names that least peak, and asking for it solves, with a note saying why the plan is
    above store-all. Played by a solver that needs 1 KiB more than store-all."""
    problem = analysed("siamese-tiny")[2]
    least = problem.store_all_peak + 1024

    def above(problem: core.Problem, budget: int) -> core.Plan:
        if budget < least:
            raise InfeasibleBudget(budget, least, "above")
        return store_all_plan(problem, "above", budget)

    monkeypatch.setitem(solvers.SOLVERS, "above", above)
    monkeypatch.setattr(solvers, "METHODS", (*solvers.METHODS, "above"))
    with pytest.raises(InfeasibleBudget) as info:
        core.solve(problem, 1.0, method="above")
    assert info.value.minimum == least
    plan = core.solve(problem, info.value.minimum, method="above")
    assert plan.budget == least and plan.predicted_peak <= least
    assert "this method's least" in plan.notes[0]
    plan = core.solve(problem, 2 * least, method="above")  # any budget above it too
    assert plan.budget == 2 * least and "this method's least" in plan.notes[0]
