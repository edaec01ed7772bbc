"""The app's offload switch without a browser: the remat+offload curve beside the remat one,
host bytes and the transfer lane, and the step-through's reasons, on gpt-tiny."""

from __future__ import annotations

import pytest
from helpers import SEED_BYTES

from app import figures
from app.callbacks.analysis import floor_gap, tradeoff_note
from app.callbacks.analysis import tradeoff_chart as _tradeoff
from app.explain import link_text, step_view, transfer_reason
from app.readback import next_transfer, percent
from app.state import OFFLOAD_METHODS, Studio
from core.naming import op_name
from core.schedule import plan_of_program, store_all_plan
from core.solvers.offload import with_transfer


@pytest.fixture(scope="module")
def studio() -> Studio:
    return Studio()


@pytest.fixture(scope="module")
def h100(studio):
    """gpt-tiny with op times and host link of the h100 preset, and an offloading plan."""
    key = studio.key("gpt-tiny", "estimated", "h100")
    problem = studio.problem(key)
    plan = studio.plan(key, studio.offload_method, int(0.5 * problem.store_all_peak))
    return key, problem, plan


def test_the_offload_method_is_a_parameter_and_not_a_remat_method(studio):
    assert studio.offload_method == "offload"
    with pytest.raises(ValueError, match="needs an offloading method, not 'rotor'"):
        Studio(offload_method="rotor")
    problem = studio.problem(studio.key("gpt-tiny", "estimated", "cpu"))
    assert not set(studio.methods(problem)) & set(OFFLOAD_METHODS)


def test_the_remat_offload_curve_goes_lower_and_is_never_slower_at_equal_budgets(studio):
    key = studio.key("gpt-tiny", "estimated", "cpu")
    peak = studio.problem(key).store_all_peak
    remat = {p.budget: p for p in studio.tradeoff(key, "rockmate")}
    curve = studio.offload_tradeoff(key)
    assert studio.offload_tradeoff(key) is curve  # cached
    budgets = [p.budget for p in curve]
    assert budgets == sorted(budgets) and budgets[-1] == peak
    # measured: remat alone bottoms out at 31.7% of the peak, with offloading about 30.4%
    assert budgets[0] < min(remat)
    assert all(p.peak <= p.budget for p in curve)
    # at each budget, never slower than the remat curve's point at or below it
    for p in curve:
        below = [r for b, r in remat.items() if b <= p.budget]
        if below:
            assert p.overhead <= max(below, key=lambda r: r.budget).overhead + 1e-9, p
    # near the remat minimum, recomputation alone costs 153% extra time; offloading far less
    first = min(remat)
    near = min((p for p in curve if p.budget >= first), key=lambda p: p.budget)
    assert near.overhead < remat[first].overhead - 0.5

    context = {"key": key, "peak": peak, "method": "rockmate", "methods": ["rockmate"]}
    fig = _tradeoff(studio, {**context, "offload": "offload"}, 50)
    drawn = {t["meta"]: t for t in fig["data"]}
    assert list(drawn) == ["rockmate", "offload"]  # the switch's curve is current: on top
    assert drawn["offload"]["legendrank"] < drawn["rockmate"]["legendrank"]  # legend: first
    assert (
        drawn["offload"]["line"]["dash"] == "dash" and drawn["rockmate"]["line"]["dash"] == "solid"
    )
    assert drawn["offload"]["x"][0] == round(percent(budgets[0], peak), 2)
    assert [t["meta"] for t in _tradeoff(studio, {**context, "offload": None}, 50)["data"]] == [
        "rockmate"
    ]
    note = tradeoff_note({**context, "offload": "offload"}, "host link: X")
    assert "Dashed: remat + offload" in note and "host link: X" in note
    problem = studio.problem(key)
    gap = floor_gap({**context, "min_pct": 32.0}, problem)
    floor = f"{percent(problem.floor.nbytes, peak):.1f}%"
    assert "starts at 32%" in gap and f"the floor, {floor}" in gap  # the band's own figure


def test_host_bytes_and_the_transfer_lane_follow_the_simulation(h100):
    _, problem, plan = h100
    sim = plan.simulate()
    assert sim.transfers and sim.host_peak > 0
    link = link_text(problem)
    assert link == "host link: the h100 preset's, device→host 52.8 GB/s, host→device 35 GB/s"

    unit = figures.pick_unit(problem.store_all_peak)
    fig = figures.timeline_figure(
        plan.timeline, plan.backward_start, plan.budget, unit=unit, host=sim.host
    )
    host = next(t for t in fig["data"] if t.get("meta") == "host")
    assert fig["data"][-1] is host and fig["data"][figures.T_MARKER]["meta"] == "marker"
    assert host["y"] == [round(sim.host[x - 1] / unit[1], 4) for x in host["x"]]
    assert max(host["y"]) == round(sim.host_peak / unit[1], 4)
    marks = next(t for t in fig["data"] if t.get("meta") == "copies")
    assert marks["x"] == [
        figures.step_x(s.index) for s in plan.timeline if s.kind in ("offload", "prefetch")
    ]
    arrows = {"offload": "triangle-up", "prefetch": "triangle-down"}
    assert marks["marker"]["symbol"] == [arrows[plan.program[x - 1][0]] for x in marks["x"]]
    plain = store_all_plan(problem)
    drawn = figures.timeline_figure(
        plain.timeline, plain.backward_start, plain.budget, host=plain.simulate().host
    )
    assert not {"host", "copies"} & {t.get("meta") for t in drawn["data"]}  # no copies drawn

    values = problem.graph.values
    lane = figures.transfer_figure(
        sim.transfers, sim.waits, [v.name for v in values], [v.nbytes for v in values], link
    )
    bars = {t["meta"]: t for t in lane["data"]}
    for kind in ("offload", "prefetch"):
        mine = [t for t in sim.transfers if t.kind == kind]
        assert bars[kind]["base"] == [round(t.start * 1e3, 6) for t in mine]
        assert bars[kind]["x"] == [round((t.end - t.start) * 1e3, 6) for t in mine]
    assert len(bars["stall"]["x"]) == len(sim.waits)
    assert lane["layout"]["meta"]["copies"] == len(sim.transfers)
    assert link in lane["layout"]["title"]["text"]


def test_the_step_through_says_why_a_value_was_offloaded_rather_than_recomputed(h100):
    _, problem, plan = h100
    sim = plan.simulate()
    assert sim.stall == 0 and not sim.waits  # the greedy issues prefetches early enough
    copies = [i for i, (kind, _) in enumerate(plan.program) if kind in ("offload", "prefetch")]
    assert plan.program[copies[0]][0] == "offload"
    assert next_transfer(plan.timeline, None) == copies[0]
    assert next_transfer(plan.timeline, copies[0]) == copies[1]
    assert next_transfer(plan.timeline, copies[-1]) == copies[0]  # wraps round
    assert next_transfer(store_all_plan(problem).timeline, None) is None
    graph = problem.graph
    for i, (kind, v) in enumerate(plan.program):
        if kind not in ("offload", "prefetch"):
            continue
        why = step_view(problem, plan, i)["why"]
        assert why == transfer_reason(problem, plan, i)
        value = graph.values[v]
        producer = graph.ops[value.producer]
        assert why.startswith(("Offload " if kind == "offload" else "Prefetch ") + value.name)
        said = f"{op_name(graph, producer.index).words} ({producer.label}, {producer.name})"
        assert f"running {said} again would add" in why  # by module and kind, ATen second
        assert "they hide behind compute" in why
    at_peak = [
        transfer_reason(problem, plan, i)
        for i, (kind, _) in enumerate(plan.program)
        if kind == "offload"
    ]
    assert any(f"across this plan's peak (step {sim.peak_step + 1})" in w for w in at_peak)


def test_a_late_prefetch_shows_as_a_stall_on_the_lane_and_in_the_reason(h100):
    """A prefetch issued right before its reader (lead 0) makes compute wait for the copy."""
    _, problem, _ = h100
    base = store_all_plan(problem)
    graph = problem.graph
    kept = base.simulate().live_after(base.backward_start - 1)
    v = max(
        (v for v in kept if graph.values[v].kind == "activation"),
        key=lambda v: (graph.values[v].nbytes, v),
    )
    program, start = with_transfer(problem, list(base.program), base.backward_start, v, 0.0)
    plan = plan_of_program(problem, program, start, "offload", problem.store_all_peak)
    sim = plan.simulate()
    assert len(sim.waits) == 1
    step, ready, started = sim.waits[0]
    assert sim.stall == pytest.approx(started - ready) and started > ready
    assert program[step - 1] == ("prefetch", v)  # the reader runs right after its prefetch
    why = transfer_reason(problem, plan, step - 1)
    reader = graph.ops[program[step][1]].name
    assert f"arrives late and {reader} waits" in why and "a stall" in why
    values = graph.values
    lane = figures.transfer_figure(
        sim.transfers, sim.waits, [x.name for x in values], [x.nbytes for x in values], "link"
    )
    stall = next(t for t in lane["data"] if t["meta"] == "stall")
    assert stall["base"] == [round(ready * 1e3, 6)]
    assert stall["x"] == [round((started - ready) * 1e3, 6)]


def test_measure_here_runs_the_switchs_plan_at_its_predicted_peak(studio):
    """The offload switch's plan through the app's "measure here": the real step, copies into
    the host pool included, peaks at the prediction plus autograd's seed."""
    from app.measure import measure_plan

    key = studio.key("gpt-tiny", "estimated", "cpu")
    problem = studio.problem(key)
    plan = studio.plan(key, studio.offload_method, int(0.5 * problem.store_all_peak))
    assert plan.simulate().transfers
    got = measure_plan(studio.builders["gpt-tiny"](), plan)
    assert got.peak == plan.predicted_peak + SEED_BYTES
    assert len(got.live) == len(plan.program)


def test_the_peak_list_says_offloaded_only_of_storages_parked_on_the_host(studio):
    """gpt-tiny on the cpu preset at half its store-all peak: two storages alive at the peak
    (gelu_1, addmm_6) were offloaded in the forward and prefetched back before it. They are on
    the device there, so the list says so; their op's fate ("offloaded") is not the label."""
    from app.callbacks.memory import peak_items
    from app.readback import fate_at, peak_step

    key = studio.key("gpt-tiny", "estimated", "cpu")
    budget = int(0.5 * studio.problem(key).store_all_peak)
    plan = studio.plan(key, studio.offload_method, budget)
    sim, peak = plan.simulate(), peak_step(plan.timeline)
    ref = {"key": key, "method": studio.offload_method, "budget": budget, "value": 50}
    reason, _, listed = peak_items(studio, ref, peak)
    assert reason.children.startswith("The peak is")  # why the peak is there, first
    items = listed.children
    labels = {  # by trace name (second, after the module and kind)
        i.children[3].children.strip(" ()"): i.children[-1]
        for i in items
        if isinstance(i.children, list)
    }
    assert labels["gelu_1"] == labels["addmm_6"] == " · prefetched back", labels
    assert not any(text.endswith("offloaded") for text in labels.values()), labels
    # a storage reads "offloaded" exactly while it is off the device, parked on the host
    (gelu,) = (v.index for v in studio.problem(key).graph.values if v.name == "gelu_1")
    off = next(t for t in sim.transfers if t.value == gelu and t.kind == "offload")
    pre = next(t for t in sim.transfers if t.value == gelu and t.kind == "prefetch")
    assert fate_at(sim, gelu, "offloaded", off.step - 1) == "not yet offloaded"
    assert fate_at(sim, gelu, "offloaded", off.step) == "copying to host"
    for step in range(off.release, pre.step):
        assert fate_at(sim, gelu, "offloaded", step) == "offloaded"
        assert gelu not in sim.live_after(step)
    assert fate_at(sim, gelu, "offloaded", pre.step) == "prefetched back"
