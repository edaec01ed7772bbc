"""Cost models: estimates follow FLOPs and bytes; measurements cover every op once per signature.

How well measured op costs add up to the real eager step is a timing figure, reported by
`remat bench --runtime` (bench/runtime.py), not asserted here."""

import math

import pytest
import torch
from torch import nn

from core import costs
from core.graph import Graph, build_graph
from core.trace import capture
from sample_models import build

# FLOPs only, bytes only: isolates one term of the estimate.
COMPUTE = costs.DeviceSpec("compute", flops=1e9, bandwidth=math.inf, launch=0.0)
MEMORY = costs.DeviceSpec("memory", flops=math.inf, bandwidth=1e9, launch=0.0)


def graph_of(name: str) -> Graph:
    model, inputs = build(name)
    return build_graph(capture(model, inputs))


@pytest.fixture(scope="module")
def gpt_tiny() -> Graph:
    return graph_of("gpt-tiny")


def test_estimate_follows_flops_and_bytes():
    x = torch.randn(256, 512)
    g = build_graph(capture(nn.Sequential(nn.Linear(512, 1024, bias=False), nn.ReLU()), [x]))
    label = [op.label for op in g.ops]
    mm, relu = g.ops[label.index("aten.mm")], g.ops[label.index("aten.relu")]
    assert costs.estimate_times(g, COMPUTE)[mm.index] == pytest.approx(2 * 256 * 512 * 1024 / 1e9)
    # relu reads and writes 256x1024 floats; its detach (a view) costs only the launch.
    assert costs.estimate_times(g, MEMORY)[relu.index] == pytest.approx(2 * 256 * 1024 * 4 / 1e9)


def test_estimate_positive_deterministic_and_faster_on_gpus(gpt_tiny):
    times = costs.estimate_times(gpt_tiny)
    assert len(times) == len(gpt_tiny.ops)
    assert all(t > 0 for t in times)
    assert costs.estimate_times(gpt_tiny, "cpu") == times
    assert sum(costs.estimate_times(gpt_tiny, costs.DEVICES["h100"])) < sum(times)
    with pytest.raises(ValueError, match="unknown device"):
        costs.estimate_times(gpt_tiny, "tpu")


def test_assign_times_fills_every_op(gpt_tiny):
    costs.assign_times(gpt_tiny, "estimated", "a100")
    assert [op.time for op in gpt_tiny.ops] == costs.estimate_times(gpt_tiny, "a100")
    costs.assign_times(gpt_tiny, "measured", repeats=1)
    assert all(op.time > 0 for op in gpt_tiny.ops)
    with pytest.raises(ValueError, match="unknown cost model"):
        costs.assign_times(gpt_tiny, "guessed")
    # measured costs run on the torch device asked (analyze passes the model's), not a preset
    for preset in ("h100", COMPUTE):
        with pytest.raises(ValueError, match="run on a torch device"):
            costs.assign_times(gpt_tiny, "measured", device=preset, repeats=1)


def test_measure_leaves_threads_and_random_state_alone(gpt_tiny):
    threads, state = torch.get_num_threads(), torch.get_rng_state()
    costs.measure_times(gpt_tiny, repeats=1)
    assert torch.get_num_threads() == threads
    assert torch.equal(torch.get_rng_state(), state)


@pytest.mark.slow
def test_identical_layers_are_timed_once():
    g = graph_of("gpt-small-6l")
    calls: list[tuple[int, int]] = []
    times = costs.measure_times(
        g, repeats=1, progress=lambda done, total: calls.append((done, total))
    )
    timed = calls[-1][1]
    assert [done for done, _ in calls] == list(range(1, timed + 1))
    assert timed < len(g.ops) / 2
    by_signature: dict[tuple, set[float]] = {}
    for op, t in zip(g.ops, times):
        by_signature.setdefault(costs.op_signature(g.trace, op), set()).add(t)
    assert len(by_signature) == timed
    assert all(len(ts) == 1 for ts in by_signature.values())
