"""The arena figure (app.arena): every storage drawn where the layout put it, hover says what."""

import json

import plotly.graph_objects as go

from app.arena import arena_figure
from app.figures.axes import step_x
from core.layout import arena
from core.schedule import store_all_plan


def test_arena_figure_draws_each_storage_at_its_offset_and_names_its_op_and_module(analysed):
    _, _, problem = analysed("gpt-tiny")
    plan = store_all_plan(problem)
    layout = arena(plan)
    fig = arena_figure(layout, problem.graph, plan.backward_start)
    go.Figure(fig)  # plotly accepts it
    json.dumps(fig)  # plain data, as Dash sends it
    bars = [t for t in fig["data"] if t["type"] == "bar"]
    assert sum(len(t["base"]) for t in bars) == len(layout.placements)
    scale = fig["layout"]["meta"]["size"]
    drawn = set()
    for t in bars:
        for base, length, y, width, text, (value, offset, size) in zip(
            t["base"], t["x"], t["y"], t["width"], t["text"], t["customdata"], strict=True
        ):
            assert abs((y - width / 2) * scale - offset) <= scale * 1e-6
            assert abs(width * scale - size) <= scale * 1e-6
            first = round(base + 0.5 - step_x(0))  # a bar starts half a step before its first
            drawn.add((value, first, first + length - 1, offset, size))
            assert "made by aten." in text
    want = {(p.value, p.first, p.last, p.offset, p.size) for p in layout.placements}
    assert drawn == want
    hover = " ".join(text for t in bars for text in t["text"])
    assert "module transformer.h.0" in hover  # forward ops carry their module path
    lines = {
        t["name"].split(" ")[0]: t["y"][0] * scale for t in fig["data"] if t["type"] == "scatter"
    }
    assert round(lines["arena"]) == layout.size
    assert round(lines["live"]) == layout.live_peak == plan.predicted_peak
    assert fig["layout"]["shapes"][0]["x0"] == step_x(plan.backward_start) - 0.5
