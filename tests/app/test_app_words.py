"""Start states and jargon, in a real Chromium: the glossary defines the page's words, the
device menu is off when op times are measured here, and a model with little to show says so."""

from __future__ import annotations

import pytest

from app import ids
from bench.app import choose, wait_ready

pytestmark = pytest.mark.browser


def test_glossary_measured_here_and_a_model_with_little_to_show(page, url):
    page.set_viewport_size({"width": 1400, "height": 1000})
    page.goto(url)
    wait_ready(page, "gpt-tiny")
    terms = page.locator(".glossary dt").all_text_contents()  # folded: text, not inner text
    for word in ("store-all peak", "program step", "storage", "extra time", "prefetch", "stall"):
        assert word in terms, (word, terms)
    assert any("Rotor" in t and "ILP" in t and "chain DP" in t for t in terms)
    assert any(t.startswith("√n") for t in terms)
    assert page.locator(f"#{ids.NUMBERS}").inner_text().count("extra time") == 1
    assert page.locator(f"#{ids.DEVICE}").is_enabled()
    assert "little to show" not in page.inner_text(f"#{ids.INTRO}").lower()

    page.click(f"#{ids.COSTS} input[value=measured]")
    page.wait_for_function("(id) => document.getElementById(id).disabled", arg=ids.DEVICE)
    assert "measured on this machine" in page.inner_text(f"#{ids.DEVICE_NOTE}")
    page.click(f"#{ids.COSTS} input[value=estimated]")
    page.wait_for_function("(id) => !document.getElementById(id).disabled", arg=ids.DEVICE)

    choose(page, ids.MODEL, "resnet-tiny")
    page.wait_for_function(
        "() => !document.body.hasAttribute('data-busy') && "
        "document.querySelector('#intro b').textContent === 'resnet-tiny'",
    )
    assert "Little to show on this model" in page.inner_text(f"#{ids.INTRO}")
