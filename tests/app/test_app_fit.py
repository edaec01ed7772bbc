"""Will it fit: the whole training footprint at a plan's peak step (core.footprint) and its
chart against the device preset's memory."""

from __future__ import annotations

import dataclasses

import pytest

import core
from app.figures.fit import fit_figure
from core.footprint import CAPACITY, GIB, device_memory, footprint


def test_footprint_adds_parameters_adamw_state_and_inputs_to_the_plans_peak(analysed):
    _, _, problem = analysed("gpt-tiny")
    plan = core.solve(problem, int(0.6 * problem.store_all_peak), "rockmate")
    got = footprint(problem, plan, "rtx4090")
    step = got.activations + got.temporaries + got.gradients
    assert step == plan.predicted_peak  # the step's part is the plan's predicted peak
    trainable = sum(v.nbytes for v in problem.graph.values if v.kind == "param")
    assert trainable > 0 and got.optimizer == 2 * trainable  # AdamW: two moments
    assert got.parameters == problem.param_bytes and got.inputs == problem.input_bytes
    assert got.total == problem.param_bytes + 2 * trainable + problem.input_bytes + step
    assert got.capacity == 24 * GIB and got.fits
    plain = footprint(problem, core.solve(problem, problem.store_all_peak, "store_all"), "a100")
    assert plain.total > got.total  # recomputing lowers the whole footprint


def test_device_memory_is_the_preset_or_this_machine_and_unknown_devices_are_refused():
    # as an H100 80GB reports it (nvidia-smi 81,559 MiB), not 80 GiB
    assert device_memory("h100") == CAPACITY["h100"] == 81_559 << 20 < 80 * GIB
    assert device_memory("cpu") == device_memory("here") > GIB
    with pytest.raises(ValueError, match="no memory size for device 'tpu'"):
        device_memory("tpu")


def test_fit_chart_stacks_each_part_and_draws_the_capacity(analysed):
    _, _, problem = analysed("gpt-tiny")
    plan = core.solve(problem, int(0.6 * problem.store_all_peak), "rockmate")
    f = footprint(problem, plan, "v100")
    fig = fit_figure([("this plan", f)], "a V100's memory")
    assert [t["name"] for t in fig["data"]][:2] == [
        "parameters and buffers",
        "optimizer state (AdamW)",
    ]
    assert fig["layout"]["meta"]["totals"] == [f.total]
    assert "V100" in fig["layout"]["title"]["text"]
    big = dataclasses.replace(f, activations=20 * GIB)  # a step the size of the device
    fig = fit_figure([("this plan", big)], "a V100's memory")
    assert fig["layout"]["shapes"][0]["x0"] == 32  # GiB: the device's line, drawn
    assert fig["layout"]["meta"]["scale"] == "device"


def test_a_step_under_one_percent_of_the_device_is_drawn_at_its_own_scale(analysed):
    """gpt-tiny's few MiB on an H100's 80 GiB: the axis ends at the data (the bars fill it)
    and the device's memory is named at the axis' break, with how many times larger it is."""
    _, _, problem = analysed("gpt-tiny")
    plan = core.solve(problem, int(0.6 * problem.store_all_peak), "rockmate")
    f = footprint(problem, plan, "h100")
    fig = fit_figure([("this plan", f)], "an H100's memory")
    layout = fig["layout"]
    assert layout["meta"]["scale"] == "break" and layout["meta"]["unit"] == "MiB"
    right = layout["xaxis"]["range"][1]
    assert f.total / 2**20 < right < 2 * f.total / 2**20  # the bar spans most of the axis
    assert layout["shapes"] == []  # no line at 80 GiB squeezing the bar to a hairline
    said = layout["annotations"][-1]["text"]
    assert said.startswith("// an H100's memory, 79.6 GiB, is off this scale")
    assert f"{CAPACITY['h100'] / f.total:,.0f}×" in said
