"""Never stale: in a real Chromium, a sampler reads the page on every frame (and on every DOM
change) across model, device, method and budget changes and a cancel, and fails on any frame
where a view shows content drawn for other controls while no busy indicator is on screen: the
page's busy bar, or, for the views that refresh on their own (the trade-off curves, memory
against batch), their own busy sign."""

from __future__ import annotations

import json
import threading
import time

import pytest

from app import ids
from app.state import METHOD_LABELS
from bench.app import choose, wait_idle, wait_ready

pytestmark = pytest.mark.browser

# The sampler, written apart from the page's own watcher (assets/app.js): the controls as
# the user sees them (menus' shown labels, the radio, the switch, the slider), each view's
# "drawn for" (data-for, or the plotly figure's layout.meta.for), and whether the busy bar is
# visible inside the viewport. Only what is shown can be stale on screen: a view counts while
# it is displayed and inside the viewport (the page leaves views far below the fold for later).
SAMPLER = """(labels) => {
  const label = (id) => { const e = document.querySelector(`#${id}-value .dash-dropdown-value-item`);
    return e ? e.textContent.trim() : ""; };
  const on = (sel) => { const e = document.querySelector(sel); return !!(e && e.checked); };
  const HTML = ["intro", "graph-card", "numbers", "step-why"];
  const PLOTS = ["tradeoff", "timeline", "tensors", "arena", "transfers", "fit", "batch-fig"];
  window.__samples = {frames: 0, busy: 0, own: 0, bad: []};
  // a view's own busy sign: its ::after badge, shown, inside the viewport
  const ownSign = (id) => {
    const v = document.getElementById(id);
    if (!v.classList.contains("own-busy")) { return false; }
    const after = getComputedStyle(v, "::after");
    const r = v.getBoundingClientRect();
    return after.content !== "none" && after.content !== "" && after.display !== "none"
      && r.height > 0;
  };
  const sample = (why) => {
    const where = on("#costs input[value=measured]") ? "here" : label("device");
    const m = label("method");
    const ctx = [label("model"), where, labels[m] || m,
      on("#offload-switch input[value=on]") ? "on" : "off"].join("|");
    const now = document.querySelector("#budget [role=slider]").getAttribute("aria-valuenow");
    const plan = ctx + "|" + String(Number(now));
    const views = HTML.map(id => [id, document.getElementById(id).getAttribute("data-for") || ""])
      .concat(PLOTS.map(id => { const g = document.querySelector(`#${id} .js-plotly-plot`);
        return [id, (g && g.layout && g.layout.meta && g.layout.meta.for) || ""]; }));
    const shown = (id) => { const v = document.getElementById(id);
      const r = v.getBoundingClientRect();
      return !v.closest("[hidden]") && r.height > 0 && r.bottom > 0 && r.top < innerHeight; };
    const old = views.filter(([id, f]) => shown(id)
      && f !== (f.split("|").length === 5 ? plan : ctx));
    const bar = document.getElementById("progress");
    const r = bar.getBoundingClientRect();
    const busy = getComputedStyle(bar).display !== "none" && r.height > 0 && r.top >= 0
      && r.bottom <= innerHeight;
    const own = old.filter(([id]) => ownSign(id));
    const wrong = busy ? [] : old.filter(([id]) => !ownSign(id));
    const s = window.__samples;
    s.frames += 1; s.busy += busy ? 1 : 0; s.own += own.length ? 1 : 0;
    if (wrong.length && s.bad.length < 20) {
      s.bad.push({why, controls: plan, wrong});
    }
  };
  new MutationObserver(() => sample("mutation")).observe(document.body,
    {subtree: true, childList: true, attributes: true, characterData: true});
  const frame = () => { sample("frame"); requestAnimationFrame(frame); };
  requestAnimationFrame(frame);
}"""

SETTLED = """(want) => !document.body.hasAttribute('data-busy')
  && document.querySelector('#model-value').textContent === want.model
  && document.querySelector('#device-value').textContent === want.device"""


def settle(page, model: str, device: str) -> None:
    page.wait_for_function(SETTLED, arg={"model": model, "device": device})


def wait_jobs_done(timeout: float = 300) -> None:
    """Until no background job of the app (threads in this process) is running."""
    deadline = time.monotonic() + timeout
    for thread in threading.enumerate():
        if thread.name == "remat-background":
            thread.join(max(0.0, deadline - time.monotonic()))
            assert not thread.is_alive(), "a background job ran past the deadline"


def samples(page) -> dict:
    return page.evaluate("() => window.__samples")


def test_no_frame_shows_content_for_other_controls_without_the_busy_bar(page, url):
    page.set_viewport_size({"width": 1400, "height": 1000})
    page.goto(url)
    wait_ready(page, "gpt-tiny")
    settle(page, "gpt-tiny", "cpu")
    page.evaluate(SAMPLER, {label: m for m, label in METHOD_LABELS.items()})

    choose(page, ids.MODEL, "mlp-tiny")  # a model switch
    settle(page, "mlp-tiny", "cpu")
    choose(page, ids.DEVICE, "a100")  # a device switch: a new analysis
    settle(page, "mlp-tiny", "a100")
    choose(page, ids.METHOD, "rotor")  # a method switch: its own trade-off curve
    page.wait_for_function(
        "() => !document.body.hasAttribute('data-busy') && "
        "document.querySelector('#tradeoff .js-plotly-plot').layout.meta.for.includes('|rotor|')"
    )
    page.locator(f"#{ids.BUDGET} [role=slider]").focus()  # budget moves
    for key in ("ArrowLeft", "ArrowLeft", "Home"):
        page.keyboard.press(key)
    page.wait_for_function("() => !document.body.hasAttribute('data-busy')")
    busy_before = samples(page)["busy"]

    choose(page, ids.DEVICE, "h100")  # then cancel it at once
    page.click(f"#{ids.CANCEL}")
    settle(page, "mlp-tiny", "a100")
    note = page.locator(f"#{ids.CANCEL_NOTE}")
    note.wait_for(state="visible")
    assert "Cancelled: the controls are back to what the page shows" in note.inner_text()
    assert "a100" in note.inner_text() and "rotor" in note.inner_text()
    # the cancelled analysis must not land afterwards: every job of the app (served in
    # this process) over, and the page's renderer idle
    wait_jobs_done()
    wait_idle(page)
    assert page.inner_text("#device-value") == "a100"
    assert not page.evaluate("() => document.body.hasAttribute('data-busy')")

    fit = page.evaluate("() => document.querySelector('#fit .js-plotly-plot').layout")
    assert fit["title"]["text"] == "an A100's memory: 80.0 GiB"  # the device's memory, drawn
    assert len(fit["meta"]["totals"]) == 2  # plain PyTorch and the plan

    got = samples(page)
    assert got["bad"] == [], json.dumps(got["bad"][:3], indent=1)
    assert got["frames"] > 100 and got["busy"] > busy_before > 0  # it sampled the transitions
