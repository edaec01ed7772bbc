"""Rockmate (Zhao et al., ICML 2023): each block's options from the block ILP
(`core.solvers.checkmate`), chained by Rotor's dynamic program (`core.solvers.rotor`). A
graph whose forward is small enough is also nested as one block (`core.solvers.nested`), and
a graph of at most WHOLE_GRAPH_MAX_OPS ops is also solved whole by the bounded ILP at the budget
asked: their schedules compete with the chain's, the fastest plan that fits wins."""

from __future__ import annotations

from core.errors import InfeasibleBudget
from core.plan import Plan
from core.problem import Problem, per_problem
from core.solvers.checkmate import DEFAULT_SOLVER, whole_graph_ilp
from core.solvers.options import chain, option_notes, whole_graph_plan, whole_graph_schedules
from core.solvers.rotor import chain_minimum, chain_plan

# The whole-graph ILP on a small graph; the measurements behind these are in docs/tuning.md.
# A node count, not seconds, bounds it: the same schedule on a loaded machine as on an idle one.
WHOLE_GRAPH_NODES = 300
WHOLE_GRAPH_MAX_OPS = 128  # graphs above this get no whole-graph ILP
# No time limit, not even as a runaway guard: a 300 s one decided gpt-1layer's plans at load
# 23 on this machine (other plans at 55.4% and 57.5% than at load 8; docs/app.md).
# It costs seconds per budget and beat the chain only near its floor: run it only where no
# chain plan fits or the chain's overhead is above this.
WHOLE_GRAPH_OVERHEAD = 1.5


def solve(problem: Problem, budget: int) -> Plan:
    plan = _without_ilp(problem, budget)
    if _runs_ilp(problem, budget, plan):
        plan = _faster(plan, _whole_graph_ilp(problem, budget))
    if plan is None:
        raise InfeasibleBudget(budget, minimum(problem), "rockmate")
    return plan


def ilp_pending(problem: Problem, budget: int) -> bool:
    """Whether `solve(problem, budget)` would still run the whole-graph ILP (seconds; not yet
    memoised): a trade-off curve can draw its other points first (the app's `draw_curves`)."""
    if budget in _ilp_plans(problem):
        return False
    return _runs_ilp(problem, budget, _without_ilp(problem, budget))


def _without_ilp(problem: Problem, budget: int) -> Plan | None:
    """The faster of the chain's plan and the whole graph's nested schedules at `budget`."""
    try:
        plan: Plan | None = chain_plan(problem, budget, "rockmate", with_options=True)
    except InfeasibleBudget:
        plan = None
    if plan is not None and budget < problem.store_all_peak:  # else no options were needed
        plan = plan.with_notes(*option_notes(chain(problem, True)))
    if budget < problem.store_all_peak:
        plan = _faster(plan, whole_graph_plan(problem, budget))
    return plan


def _runs_ilp(problem: Problem, budget: int, plan: Plan | None) -> bool:
    """The whole-graph ILP runs on a small graph below the store-all peak where no plan fits
    or the best one's overhead is above WHOLE_GRAPH_OVERHEAD."""
    return (
        budget < problem.store_all_peak
        and len(problem.graph.ops) <= WHOLE_GRAPH_MAX_OPS
        and (plan is None or plan.overhead > WHOLE_GRAPH_OVERHEAD)
    )


def _faster(plan: Plan | None, other: Plan | None) -> Plan | None:
    if other is not None and (plan is None or other.predicted_time < plan.predicted_time):
        return other
    return plan


def minimum(problem: Problem) -> int:
    """The smallest simulated peak of the chain's plans and the whole graph's schedules (the
    whole-graph ILP is not probed: a bisection would cost several ILPs)."""
    peaks = [s.predicted_peak for s in whole_graph_schedules(problem)]
    return min([chain_minimum(problem, True), *peaks])


def _whole_graph_ilp(problem: Problem, budget: int) -> Plan | None:
    """The bounded whole-graph ILP's plan at `budget` on a graph of at most WHOLE_GRAPH_MAX_OPS ops
    (None above, or when it finds nothing); memoised per problem and budget."""
    plans = _ilp_plans(problem)
    if budget not in plans:
        plans[budget] = _bounded_ilp(problem, budget)
    return plans[budget]


@per_problem
def _ilp_plans(problem: Problem) -> dict[int, Plan | None]:
    """The whole-graph ILP's plans of `problem` by budget, as `_whole_graph_ilp` found them."""
    return {}


def _bounded_ilp(problem: Problem, budget: int) -> Plan | None:
    if len(problem.graph.ops) > WHOLE_GRAPH_MAX_OPS:
        return None
    found = whole_graph_ilp(
        problem,
        budget,
        DEFAULT_SOLVER,
        None,
        WHOLE_GRAPH_NODES,
        method="rockmate",
    )
    if found is None:
        return None
    return found[0].with_notes(
        f"the whole graph ({len(problem.graph.ops)} ops) solved by the ILP", first=True
    )
