"""What a class and an engineer found broken on screen (issue 38), each in a real Chromium:
store-all on gpt-tiny, the budget brought back after a baseline, the compare view with B below
its minimum, pause during play, and "next recompute" with nothing to jump to."""

from __future__ import annotations

import time

import pytest

from app import ids
from app.callbacks import step_through
from bench.app import choose, slider_value, wait_calm, wait_idle, wait_ready

pytestmark = pytest.mark.browser

STEP = "() => document.querySelector('#step-text').textContent"
# a round trip slower than play's tick (250 ms), as on a loaded machine: a tick sent while
# the pause was on its way used to win
TRIP_S = 0.4


@pytest.fixture
def slow_steps(monkeypatch) -> None:
    """The step-through's answers TRIP_S late, as on a loaded machine (the shared app's
    callbacks look `shown` up when called)."""
    original = step_through.shown

    def slow(studio, plan_ref):
        time.sleep(TRIP_S)  # the server's latency under load, not a wait of the test's
        return original(studio, plan_ref)

    monkeypatch.setattr(step_through, "shown", slow)


@pytest.fixture
def ready(page, url):
    page.set_viewport_size({"width": 1400, "height": 1000})
    page.goto(url)
    wait_ready(page, "gpt-tiny", 180_000)
    wait_calm(page, 180_000)
    return page


def press(page, key: str) -> None:
    page.locator(f"#{ids.BUDGET} [role=slider]").focus()
    page.keyboard.press(key)
    page.wait_for_function(
        """(v) => { const g = document.querySelector('#timeline .js-plotly-plot');
          return g.layout.meta && g.layout.meta.budget_pct === v
            && !document.body.hasAttribute('data-busy'); }""",
        arg=slider_value(page),
    )


def method_shown(page, method: str) -> None:
    page.wait_for_function(
        """(m) => !document.body.hasAttribute('data-busy')
          && document.querySelector('#numbers').getAttribute('data-for').includes('|' + m + '|')""",
        arg=method,
    )


def test_store_all_on_gpt_tiny_keeps_the_slider_and_the_budget_comes_back(ready):
    page = ready
    press(page, "ArrowLeft")
    wanted = slider_value(page)
    assert wanted < 100
    choose(page, ids.METHOD, "store_all")
    method_shown(page, "store_all")
    assert "Little to show" not in page.inner_text(f"#{ids.INTRO}")  # gpt-tiny has plenty
    low = float(page.locator(f"#{ids.BUDGET} [role=slider]").get_attribute("aria-valuemin"))
    assert low < 50  # the model's range, not store-all's single point
    assert slider_value(page) == 100  # store-all's only budget
    choose(page, ids.METHOD, "rockmate")
    method_shown(page, "rockmate")
    assert slider_value(page) == wanted  # the budget from before the baseline
    assert int(page.inner_text(f"#{ids.RECOMPUTED}")) > 0


def test_compare_with_b_below_its_minimum_says_so_in_full(ready):
    page = ready
    choose(page, ids.COMPARE_METHOD, "rotor")
    box = page.locator(f"#{ids.COMPARE_BUDGET}")
    box.fill("10")
    box.press("Tab")
    page.wait_for_function(
        "() => document.querySelector('#compare-diff').textContent.includes('B has no plan')"
    )
    titles = page.evaluate(
        """() => ['compare-a', 'compare-b'].map(id =>
          document.querySelector(`#${id} .js-plotly-plot`).layout.title.text)"""
    )
    assert titles[0].startswith("A · Rockmate") and " at " in titles[0]
    assert titles[1] == "B · Rotor (chain DP) at 10%: no plan"
    diff = page.inner_text(f"#{ids.COMPARE_DIFF}")
    assert "Rotor (chain DP) needs at least" in diff and "Set B's budget to" in diff
    lines = page.evaluate(
        """() => document.querySelector('#compare-b .js-plotly-plot').layout.annotations[0]
          .text.split('<br>')"""
    )
    assert len(lines) > 1 and all(len(line) <= 70 for line in lines)  # wrapped, not clipped


def test_pause_stops_play_even_when_the_server_is_slower_than_a_tick(slow_steps, ready):
    page = ready
    page.click(f"#{ids.STEP_NEXT}")
    page.wait_for_function(f"() => ({STEP})().startsWith('step 1 ')")
    page.click(f"#{ids.PLAY}")
    page.wait_for_function(f"() => parseInt(({STEP})().split(' ')[1]) >= 3")
    page.click(f"#{ids.PLAY}")  # pause
    page.wait_for_function(f"() => document.getElementById('{ids.PLAY}').textContent === '▶ play'")
    wait_idle(page)
    paused_at = page.evaluate(STEP)
    # a second of frames, then every answer in flight received: the step stays
    page.evaluate(
        "() => new Promise(r => { let n = 0; const f = () => (++n >= 60 ? r() :"
        " requestAnimationFrame(f)); requestAnimationFrame(f); })"
    )
    wait_idle(page)
    assert page.evaluate(STEP) == paused_at
    assert page.inner_text(f"#{ids.PLAY}") == "▶ play"


def test_next_recompute_is_enabled_only_on_a_plan_with_recomputes(ready):
    page = ready
    jump = page.locator(f"#{ids.JUMP_RECOMPUTE}")
    page.wait_for_function("(id) => !document.getElementById(id).disabled", arg=ids.JUMP_RECOMPUTE)
    press(page, "End")  # 100%: the store-all budget, nothing recomputed
    assert page.inner_text(f"#{ids.RECOMPUTED}") == "0"
    page.wait_for_function("(id) => document.getElementById(id).disabled", arg=ids.JUMP_RECOMPUTE)
    assert jump.is_disabled()


# Each chart's axis titles against its own tick labels: [chart, axis, title, tick] overlaps.
OVERLAPS = """() => { const out = [];
  const hit = (a, b) => !(a.right <= b.left || b.right <= a.left || a.bottom <= b.top
    || b.bottom <= a.top);
  document.querySelectorAll('.js-plotly-plot').forEach(g => {
    const id = g.closest('[id]').id;
    for (const ax of ['x', 'y']) {
      const t = g.querySelector('.g-' + ax + 'title text');
      if (!t) { continue; }
      const r = t.getBoundingClientRect();
      g.querySelectorAll('.' + ax + 'tick text').forEach(k => {
        if (hit(r, k.getBoundingClientRect())) { out.push([id, ax, t.textContent, k.textContent]); }
      });
    }
  });
  return out; }"""
SETTLED_VIEWS = """() => !document.body.hasAttribute('data-busy')
  && !document.querySelector('[data-refreshing]')"""


def test_axis_titles_clear_their_tick_labels_with_offloading_on(ready):
    """With offloading on, the longer legends pushed the titles onto the ticks ("program step
    (from 1)" on 150, "budget (% of store-all peak)" on 40 and 60, "batch size" on 4)."""
    page = ready
    page.click(f"#{ids.OFFLOAD} input[type=checkbox]")
    page.wait_for_function(
        "() => (document.querySelector('#numbers').getAttribute('data-for') || '')"
        ".includes('|on|')",
        timeout=300_000,
    )
    page.wait_for_function(SETTLED_VIEWS, timeout=300_000)
    assert page.evaluate(OVERLAPS) == []


def test_the_busy_bar_is_one_line_above_the_title(ready):
    page = ready
    choose(page, ids.MODEL, "mlp-tiny")
    page.wait_for_function("() => document.body.hasAttribute('data-busy')")
    bar = page.locator(f"#{ids.PROGRESS}").bounding_box()
    title = page.locator("h1").bounding_box()
    assert bar is not None and title is not None
    assert bar["height"] <= 40  # one line, however long its words
    assert bar["y"] + bar["height"] <= title["y"]  # above the title, not over it
