"""The app under load: 20 clients x 25 budget changes through Dash's callback endpoint.

Bounded (each client stops after its 25 requests), on 127.0.0.1. Zero failed requests, the
caches stay within their documented sizes, the server's memory stays bounded, and error
paths (an impossible budget, an untraceable model) leave the server up.
"""

import json
import random
import statistics
import threading
import time
import urllib.request

import psutil
import pytest
from helpers import serve_in_thread

from app import ids
from app.cache import PLANS, PROBLEMS
from app.callbacks.budget import SOLVED
from app.callbacks.common import context_sig
from app.server import create_app

CLIENTS, CHANGES = 20, 25
# the slider callback's outputs, in the order the page sends them
OUTPUTS = [(o.component_id, o.component_property) for o in SOLVED.values()]


def _budget_request(url: str, context: dict, value: float) -> tuple[dict, float]:
    """POST the slider's callback as the browser does; (response JSON, seconds)."""
    body = {
        "output": ".." + "...".join(f"{i}.{p}" for i, p in OUTPUTS) + "..",
        "outputs": [{"id": i, "property": p} for i, p in OUTPUTS],
        "inputs": [
            {"id": ids.BUDGET, "property": "value", "value": value},
            {"id": ids.CONTEXT, "property": "data", "value": context},
        ],
        "changedPropIds": [f"{ids.BUDGET}.value"],
        "state": [{"id": ids.STEP, "property": "data", "value": None}],
    }
    request = urllib.request.Request(
        url + "_dash-update-component",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    start = time.perf_counter()
    with urllib.request.urlopen(request, timeout=60) as response:
        assert response.status == 200
        payload = json.loads(response.read())
    return payload, time.perf_counter() - start


@pytest.mark.slow
def test_twenty_clients_changing_budgets():
    app = create_app(warm=False)
    url, stop = serve_in_thread(app)
    studio = app.studio
    try:
        key = studio.key("gpt-tiny", "estimated", "cpu")
        problem = studio.problem(key)
        method = studio.default_method()
        minimum = studio.minimum(key, method)
        peak = problem.store_all_peak
        signature = context_sig("gpt-tiny", "estimated", "cpu", method, offload=False)
        context = {"key": key, "method": method, "peak": peak, "for": signature}
        low = 100 * minimum / peak
        _budget_request(url, context, 100)  # warm up
        rss_before = psutil.Process().memory_info().rss

        latencies: list[float] = []
        failures: list[str] = []
        lock = threading.Lock()

        def client(seed: int) -> None:
            rng = random.Random(seed)
            for _ in range(CHANGES):
                value = round(rng.uniform(low + 0.5, 100), 1)
                try:
                    payload, seconds = _budget_request(url, context, value)
                    peak_text = payload["response"][ids.PEAK]["children"]
                    assert peak_text, "no predicted peak in the response"
                except Exception as e:  # noqa: BLE001 - every failure is counted and shown
                    with lock:
                        failures.append(f"{type(e).__name__}: {e}")
                    continue
                with lock:
                    latencies.append(seconds)

        threads = [threading.Thread(target=client, args=(i,)) for i in range(CLIENTS)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=600)
        assert not failures, failures[:3]
        assert len(latencies) == CLIENTS * CHANGES
        p50 = statistics.median(latencies)
        p95 = statistics.quantiles(latencies, n=20)[-1]
        print(
            f"\n{CLIENTS} clients x {CHANGES} budget changes: p50 {p50 * 1e3:.0f} ms, "
            f"p95 {p95 * 1e3:.0f} ms"
        )

        assert len(studio.problems) <= PROBLEMS and len(studio.plans) <= PLANS
        grown = psutil.Process().memory_info().rss - rss_before
        assert grown < 300 * 2**20, f"server memory grew by {grown / 2**20:.0f} MiB"

        # an impossible budget: a plain message, and the server keeps answering
        payload, _ = _budget_request(url, context, max(1.0, low / 4))
        assert payload["response"][ids.PLAN_ERROR]["hidden"] is False
        assert "budget" in payload["response"][ids.PLAN_ERROR]["children"]
        _, seconds = _budget_request(url, context, 90)
        assert seconds < 30
    finally:
        stop()
