"""The lesson path end to end in a real Chromium: each step sets the controls and the budget,
the page settles on them, and the revealed answer carries the page's own numbers."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from app import ids
from bench.app import wait_ready

pytestmark = pytest.mark.browser
SHOTS = Path(__file__).resolve().parents[2] / (
    "docs/screenshots" if os.environ.get("REMAT_SCREENSHOTS") == "docs" else "test-results"
)

# (title, method shown, offload on, what the answer says)
STEPS = [
    ("1/5 · Store everything", "Store all (plain PyTorch)", False, "The peak is"),
    ("2/5 · Checkpoint every block", "Checkpoint every block", False, "below plain PyTorch's"),
    ("3/5 · The solver", "Rockmate (block ILPs + chain DP)", False, "checkpointing every block"),
    ("4/5 · Offload", "Rockmate (block ILPs + chain DP)", True, "with offloading the curve"),
    ("5/5 · The floor", "Rockmate (block ILPs + chain DP)", True, "that is the floor"),
]


def settled(page, title: str, method: str, offload: bool) -> None:
    page.wait_for_function(
        """([title, method, offload]) =>
          document.getElementById('lesson-title').textContent === title
          && document.querySelector('#method-value').textContent === method
          && document.querySelector('#offload-switch input').checked === offload
          && !document.body.hasAttribute('data-busy')""",
        arg=[title, method, offload],
        timeout=180_000,
    )


def test_the_lesson_runs_end_to_end(page, url):
    SHOTS.mkdir(parents=True, exist_ok=True)
    page.set_viewport_size({"width": 1400, "height": 1000})
    page.goto(url)
    wait_ready(page, "gpt-tiny")
    assert page.locator(f"#{ids.LESSON_REVEAL}").is_disabled()  # no question yet
    page.click(f"#{ids.LESSON_START}")
    budgets, answers = [], []
    for n, (title, method, offload, said) in enumerate(STEPS):
        if n:
            page.click(f"#{ids.LESSON_NEXT}")
        settled(page, title, method, offload)
        assert page.inner_text(f"#{ids.LESSON_QUESTION}").endswith("?") or "?" in page.inner_text(
            f"#{ids.LESSON_QUESTION}"
        )
        answer = page.locator(f"#{ids.LESSON_ANSWER}")
        assert answer.is_hidden()  # asked first, answered on request
        page.click(f"#{ids.LESSON_REVEAL}")
        answer.wait_for(state="visible")
        assert said in answer.inner_text(), (title, answer.inner_text())
        answers.append(answer.inner_text())
        budgets.append(float(page.get_attribute("#budget [role=slider]", "aria-valuenow")))
        if n == 2:
            page.evaluate("() => window.scrollTo(0, 0)")
            page.screenshot(path=str(SHOTS / "lesson.png"))
    store_all, ckpt, solver, offload, floor = budgets
    assert store_all == ckpt == 100 and solver < 100  # the solver's step: checkpointing's peak
    assert offload == solver
    low = float(page.get_attribute("#budget [role=slider]", "aria-valuemin"))
    assert floor == low < solver  # the floor step: the lowest budget the slider allows
    # step 4's lowest offloading budget is step 5's slider minimum, to the same digit, and
    # step 5 names the gap between that budget and the floor
    assert f"with offloading the curve goes down to {low:g}%" in answers[3], answers[3]
    assert f"The lowest budget here, {low:g}%, is " in answers[4], answers[4]
    assert " points above it" in answers[4]
    assert page.locator(f"#{ids.LESSON_NEXT}").is_disabled()
    page.click(f"#{ids.LESSON_BACK}")
    settled(page, STEPS[3][0], STEPS[3][1], True)


def test_the_compare_view_puts_two_plans_side_by_side(page, url):
    SHOTS.mkdir(parents=True, exist_ok=True)
    page.set_viewport_size({"width": 1400, "height": 1000})
    page.goto(url)
    wait_ready(page, "gpt-tiny")
    page.wait_for_function("() => !document.body.hasAttribute('data-busy')")
    diff = page.locator(f"#{ids.COMPARE_DIFF}")
    diff.scroll_into_view_if_needed()  # drawn as it comes into sight
    # B defaults to checkpointing every block at 100%: A (the solver's plan) differs
    page.wait_for_function(
        "(id) => document.getElementById(id).textContent.includes('Peak: A')", arg=ids.COMPARE_DIFF
    )
    assert "Only A recomputes" in diff.inner_text() and "Only B recomputes" in diff.inner_text()
    box = page.locator(f"#{ids.COMPARE_BUDGET}")
    box.fill("60")
    box.press("Enter")
    page.wait_for_function(
        "() => document.querySelector('#compare-b .js-plotly-plot').layout.title.text"
        ".endsWith('at 60%')"
    )
    titles = page.evaluate(
        "() => ['compare-a', 'compare-b'].map(id => "
        "document.querySelector(`#${id} .js-plotly-plot`).layout)"
    )
    assert titles[0]["title"]["text"].startswith("A · Rockmate")
    assert titles[1]["title"]["text"] == "B · Checkpoint every block at 60%"
    assert titles[0]["yaxis"]["range"] == titles[1]["yaxis"]["range"]  # one scale
    texts = diff.inner_text()
    assert "Extra time: A " in texts and ", B " in texts
    page.locator(f"#{ids.COMPARE_A}").scroll_into_view_if_needed()
    page.locator(f"#{ids.COMPARE_A}").locator(
        "xpath=ancestor::div[contains(@class, 'card')][1]"
    ).screenshot(path=str(SHOTS / "compare.png"))
