"""The strategies users already run, on the page: "your current setting" beside our plans.

`core.strategies` imports each one (Hugging Face's `gradient_checkpointing_enable()`,
torchtitan's selective op AC, torchtune's activation offloading, PyTorch's auto-SAC) as a
native program that the native simulation predicts, peak and time. Here: their menu labels,
which ones apply to a model (and why not), and their points on the trade-off chart. The
cached getters are `app.state.Studio`'s (`imported`, `strategies`, `strategy_points`).
"""

from __future__ import annotations

from dataclasses import dataclass

from core import fmt_bytes, strategies

# the method menu's entries, after the solvers'
STRATEGY_LABELS = {
    "hf": "Hugging Face gradient checkpointing (imported)",
    "torchtitan": "torchtitan selective op AC (imported)",
    "torchtune": "torchtune activation offloading (imported)",
    "autosac": "PyTorch auto-SAC (imported)",
}
# the trade-off chart's labels beside each point
SHORT = {"hf": "HF", "torchtitan": "torchtitan", "torchtune": "torchtune", "autosac": "auto-SAC"}
FIXED = ("hf", "torchtitan", "torchtune")  # fixed plans: no budget to choose
# auto-SAC times each op of the step for real on this machine (`autosac_stats`: 7.5 s on
# gpt-tiny's 131 ops here, idle): offered on graphs of at most this many ops
AUTOSAC_MAX_OPS = 300
# the budgets auto-SAC is solved at for the trade-off chart (fractions of store-all)
AUTOSAC_BUDGETS = (0.9, 0.8, 0.7, 0.6, 0.5, 0.4, 0.3)

assert set(STRATEGY_LABELS) == set(strategies.METHODS), "a strategy of core.strategies has no label"


def is_strategy(method: str | None) -> bool:
    """Whether `method` is an imported strategy (not one of our solvers)."""
    return method in STRATEGY_LABELS


@dataclass(frozen=True)
class StrategyPoint:
    """One imported strategy on the trade-off chart: its predicted peak and time (the native
    simulation), and the budget auto-SAC was asked for (None for a fixed plan)."""

    method: str
    peak: int  # bytes beyond parameters and inputs, predicted
    overhead: float  # predicted time / store-all time
    budget: int | None = None


def hint(method: str, peak: int, overhead: float, budget: int, store_all: int, notes: str) -> str:
    """What the numbers of an imported strategy are, under the slider: what the budget does
    to it (nothing, for a fixed plan; auto-SAC solves for it) and how it was predicted."""
    name = STRATEGY_LABELS[method].split(" (")[0]
    share = f"{100 * peak / store_all:.1f}% of store-all"
    if method == "autosac":
        said = (
            f"{name} solved for this budget ({fmt_bytes(budget)}): predicted peak "
            f"{fmt_bytes(peak)} ({share})"
        )
    else:
        side = "above" if peak > budget else "within"
        said = (
            f"{name} is a fixed plan: the budget has nothing to choose, it is drawn for "
            f"comparison. Its predicted peak {fmt_bytes(peak)} ({share}) is {side} this "
            f"budget"
        )
    return (
        f"{said}, {100 * (overhead - 1):.1f}% extra time; predicted by the native simulation "
        "(on CPU, measured = predicted + 4 B)." + (f" {notes}" if notes else "")
    )
