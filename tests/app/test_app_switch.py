"""A model switch stops the background charts of the model before, in headless Chromium.

Memory against batch traces and solves five batch sizes of the model on screen (17 s on
gpt-tiny here). Before, its job was cancelled only when the new model's first plan replaced
its input, and then stopped only between two batch sizes, sharing the interpreter with the
new analysis meanwhile: unet-tiny's first timeline came 36 s after a switch from
unet-small, against 9 s for its analysis alone (docs/app.md). On gpt-tiny the old job ran
1.6 s past mlp-tiny's first timeline; now it ends before it."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import pytest
from helpers import serve_in_thread

from app import ids
from app.server import create_app
from bench.app import choose, wait_ready

pytestmark = pytest.mark.browser


@pytest.fixture(scope="module")
def served() -> Iterator[str]:
    app = create_app()
    address, stop = serve_in_thread(app)
    yield address
    stop()


def running(output: str) -> list[threading.Thread]:
    """The app's background jobs drawing `output` now (`app.cache.job_name`)."""
    return [t for t in threading.enumerate() if t.name == f"remat-background {output}"]


def test_a_model_switch_stops_the_batch_chart_of_the_model_before(page, served):
    page.set_viewport_size({"width": 1400, "height": 1000})
    page.goto(served)
    wait_ready(page, "gpt-tiny", 180_000)
    deadline = time.monotonic() + 120
    while not (jobs := running(ids.BATCH_FIG)) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert jobs, "gpt-tiny's memory against batch never started"
    choose(page, ids.MODEL, "mlp-tiny")
    wait_ready(page, "mlp-tiny", 180_000)
    for job in jobs:  # stopped at the switch: gone by the new first timeline (and a moment)
        job.join(timeout=0.5)
    assert not any(job.is_alive() for job in jobs), (
        "gpt-tiny's memory against batch still solving after mlp-tiny's first timeline"
    )
    # the new model's chart is drawn all the same
    page.wait_for_function(
        """() => { const g = document.querySelector('#batch-fig .js-plotly-plot');
          return g && g.layout.meta && (g.layout.meta.for || '').startsWith('mlp-tiny|'); }""",
        timeout=180_000,
    )
