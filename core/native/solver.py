"""Plans within what native execution expresses: `solve(problem, budget)` for method
"native".

Native execution (`apply_plan(..., runtime="native")`) runs a plan as selective checkpoint on
the model's layers and on stretches of the forward between them (`core.native.stretch`;
for this method's plans a layer may be cut into stretches), so its peak and time are the
native simulation's
(`core.native.lowering.Lowering.prediction`), not the plan's program's. This method searches
Rockmate's plans over interpreter budgets from store-all's peak and from `budget` down to
Rockmate's minimum and keeps the one whose NATIVE peak fits `budget` at the least native
time (a lower interpreter budget can mean a higher native peak: native recomputes a layer
whole). Each is lowered as a plan of this method: its stretches' cuts are searched by the
native simulation (`core.native.lowering._searched_cuts`), the interpreter plan giving
what is kept and where to start. Its notes say what native
execution leaves out of it (repeated forwards, blocks that are no submodule).
"""

from __future__ import annotations

from core.errors import InfeasibleBudget, fmt_bytes
from core.native.lowering import Lowering, lower
from core.plan import Plan
from core.problem import Problem
from core.solvers.checkpoint_blocks import solve as checkpoint_all
from core.solvers.rockmate import solve as rockmate

STEPS = 12  # interpreter budgets tried between a top budget and Rockmate's minimum


def solve(problem: Problem, budget: int) -> Plan:
    """The plan whose native peak fits `budget` with the least native time, among
    checkpoint_blocks' plan and Rockmate's plans at budgets from `budget` and from store-all's
    peak down to its minimum;
    InfeasibleBudget when none fits, with the least native peak of the second search (the
    same for every budget, so asking for it finds a plan). A RematError when the problem's
    model is gone: every plan is lowered on it (its module boundaries, its Python lifetimes),
    and without it each would be priced as if the model had no modules."""
    problem.live_model("the native method (each plan is lowered on the model)")
    try:
        floor = rockmate(problem, 1).predicted_peak
    except InfeasibleBudget as e:
        floor = e.minimum
    fixed = _grid(problem.store_all_peak, floor)  # the same for every budget
    best: tuple[Plan, Lowering] | None = None
    lowest: int | None = None
    for asked in [None, *sorted(fixed | _grid(budget, floor), reverse=True)]:
        try:
            plan = (
                rockmate(problem, asked)
                if asked is not None  # None: every block checkpointed, nothing kept inside
                else checkpoint_all(problem, problem.store_all_peak)
            )
        except InfeasibleBudget:
            continue
        low = lower(plan.replace(method="native", budget=budget))
        peak = low.prediction.peak
        if asked is None or asked in fixed:
            lowest = peak if lowest is None else min(lowest, peak)
        if peak <= budget and (best is None or low.prediction.time < best[1].prediction.time):
            best = (plan, low)
    if best is None:
        raise InfeasibleBudget(budget, lowest or floor, "native")
    plan, low = best
    native = low.prediction
    note = (
        f"native execution: predicted peak {fmt_bytes(native.peak)}, overhead "
        f"{native.overhead:.3f} (the program as planned: {fmt_bytes(plan.predicted_peak)}, "
        f"{plan.overhead:.3f}); apply with runtime='native'"
    )
    return plan.replace(method="native", budget=budget).with_notes(note, *low.notes)


def _grid(top: int, floor: int) -> set[int]:
    """`STEPS + 1` interpreter budgets from `top` down to `floor` (none below it)."""
    return {max(top - (top - floor) * k // STEPS, floor) for k in range(STEPS + 1)}
