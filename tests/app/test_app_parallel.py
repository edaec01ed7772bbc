"""The devices control: per-device memory of the planner's layouts (`core.parallel_plan`),
computed in the background and cached, and a note instead for models too large to re-trace."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from app import ids
from app.callbacks import parallel as card
from app.state import Studio
from bench.app import wait_ready

SHOTS = Path(__file__).resolve().parents[2] / (
    "docs/screenshots" if os.environ.get("REMAT_SCREENSHOTS") == "docs" else "test-results"
)


@pytest.fixture(scope="module")
def studio():
    return Studio()


def test_layouts_are_drawn_per_device_stacked_by_kind_and_cached(studio):
    key = studio.key("gpt-tiny", "estimated", "cpu")
    fig, words = card.parallel_view(studio, key, 2)
    plan = studio.parallel(key, 2)
    assert studio.parallel(key, 2) is plan  # cached: the page never re-traces twice
    names = fig["layout"]["meta"]["layouts"]
    assert names == [x.name for x in plan.layouts] and "dp1 x tp2" in names
    assert fig["data"][0]["y"][0].endswith("(chosen)")  # the planner's choice on top
    stacked = [sum(t["customdata"][i][0] for t in fig["data"]) for i in range(len(names))]
    assert stacked == [x.memory.total for x in plan.layouts]  # every kind, nothing else
    assert "Chosen: " in str(words) and plan.best.name in str(words)


def test_a_model_too_large_to_re_trace_gets_a_note_not_a_wait(studio, monkeypatch):
    monkeypatch.setattr(card, "PARALLEL_MAX_OPS", 10)
    key = studio.key("gpt-tiny", "estimated", "cpu")
    fig, words = card.parallel_view(studio, key, 4)
    assert fig["data"] == [] and "small models only" in str(words)
    assert ("parallel", key, 4) not in studio.derived.keys()


@pytest.mark.browser
def test_choosing_devices_shows_the_busy_bar_then_the_layouts(page, url):
    page.set_viewport_size({"width": 1400, "height": 1000})
    page.goto(url)
    wait_ready(page, "gpt-tiny")
    fig = "document.querySelector('#parallel-fig .js-plotly-plot')"
    page.wait_for_function(
        f"() => !document.body.hasAttribute('data-busy') && {fig}.layout.meta"
        " && {fig}.layout.meta.devices === 1".replace("{fig}", fig),
    )
    page.click(f"#{ids.DEVICES_N} input[value='4']")
    # the page is busy until the card is drawn for 4 devices: never stale and quiet
    page.wait_for_function(
        "() => document.body.hasAttribute('data-busy') || "
        f"document.getElementById('{ids.PARALLEL_CARD}').getAttribute('data-devices') === '4'"
    )
    page.wait_for_function(
        f"() => {fig}.layout.meta.devices === 4 && !document.body.hasAttribute('data-busy')",
    )
    names = page.evaluate(f"() => {fig}.layout.meta.layouts")
    assert {"plain DP", "FSDP", "dp2 x tp2 FSDP"} <= set(names)
    assert "Chosen:" in page.inner_text(f"#{ids.PARALLEL_TEXT}")
    SHOTS.mkdir(exist_ok=True)
    page.locator(f"#{ids.PARALLEL_CARD}").screenshot(path=str(SHOTS / "parallel.png"))
