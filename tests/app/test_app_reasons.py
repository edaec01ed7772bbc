"""Reasons, not prices: a keep or a recompute is compared with the plan's other choice in
the same block (µs per 100 KiB), and the peak gets one sentence on why it is there."""

from __future__ import annotations

import re

import core
from app.explain import step_view
from app.reasons import peak_reason

PRICE = r"([0-9.e+]+) µs per 100 KiB"


def whys(problem, plan) -> list[str]:
    return [step_view(problem, plan, i)["why"] for i in range(len(plan.program))]


def test_recomputes_and_keeps_are_compared_with_the_other_choice_in_their_block(analysed):
    _, _, problem = analysed("gpt-tiny")
    plan = core.solve(problem, int(0.5 * problem.store_all_peak), "rockmate")
    texts = whys(problem, plan)
    cheaper = [t for t in texts if t.startswith("Recompute ") and ", less than the " in t]
    assert cheaper, "no recompute was compared with a keep"
    for t in cheaper:  # the numbers say what the words say
        mine, kept = (float(x) for x in re.findall(PRICE, t)[:2])
        assert mine < kept, t
        assert " it kept." in t
    kept = [t for t in texts if "; kept: " in t and "the plan recomputes instead" in t]
    assert kept, "no keep was compared with a recompute"
    for t in kept:
        if ", more than the " in t:
            mine, other = (float(x) for x in re.findall(PRICE, t)[:2])
            assert mine > other, t


def test_the_peak_says_why_it_is_there(analysed):
    _, _, problem = analysed("gpt-tiny")
    plan = core.solve(problem, problem.store_all_peak, "store_all")
    text = peak_reason(problem, plan)
    assert text.startswith("The peak is at the start of the backward"), text
    assert "every activation kept for the backward is still alive" in text
    assert " while " in text and " runs" in text  # the op running there, by module and kind
