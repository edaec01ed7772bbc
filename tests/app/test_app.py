"""The app's figures and caches, without a browser."""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace

import pytest
import torch
from helpers import fresh

import core
from app import figures
from app.cache import LRU
from app.explain import peak_hint, step_view, tensor_rows
from app.readback import alive_at, live_bands, op_fates, slider_minimum
from app.state import Studio
from core.naming import op_name


def steps(live: list[tuple[int, int, int]], backward_start: int = 0) -> list:
    return [
        SimpleNamespace(
            index=i,
            kind="run",
            name=f"op{i}",
            label="aten.mm",
            phase="forward" if i < backward_start else "backward",
            block=0,
            recompute=i % 7 == 3,
            activations=a,
            temporaries=t,
            gradients=g,
        )
        for i, (a, t, g) in enumerate(live)
    ]


def test_decimation_keeps_the_peak_and_the_ends():
    totals = [i % 97 for i in range(50_000)]
    totals[31_337] = 10_000
    keep = figures.decimate(totals, 1000)
    assert len(keep) <= 1002
    assert 31_337 in keep and 0 in keep and 49_999 in keep
    assert keep == sorted(keep)
    assert figures.decimate([1, 2, 3], 1000) == [0, 1, 2]


def test_timeline_is_stacked_by_kind_with_budget_and_peak():
    live = [(i * 2**20, (i % 5) * 2**20, 0 if i < 3000 else 2**20) for i in range(6000)]
    live[4321] = (10**11, 0, 0)  # a spike: the peak
    fig = figures.timeline_figure(steps(live, 3000), 3000, budget=int(2e11), block_names=["b"])
    data = fig["data"]
    assert [t["name"] for t in data[:3]] == ["activations", "temporaries", "gradients"]
    assert all(t["stackgroup"] == "live" for t in data[:3])
    assert all(len(t["x"]) <= figures.MAX_POINTS + 2 for t in data)
    size = fig["layout"]["meta"]["size"]
    total = [sum(x) for x in live]
    budget = data[figures.T_BUDGET]
    assert budget["meta"] == "budget" and budget["y"][0] == budget["y"][1]
    assert budget["y"][0] == pytest.approx(2e11 / size, rel=1e-4)
    peak = data[figures.T_PEAK]
    assert peak["x"] == [4322]  # program step 4321 counted from 1, as the stepper counts
    assert peak["y"][0] == pytest.approx(max(total) / size, rel=1e-4)
    # the stack's top at the peak step is the peak: decimation did not lose it
    i = data[0]["x"].index(4322)
    top = sum(data[k]["y"][i] for k in range(3))
    assert top == pytest.approx(max(total) / size, rel=1e-4)
    assert "op4321" in data[0]["text"][i]
    assert len(fig["layout"]["shapes"]) == 2  # forward and backward shading


def test_every_program_step_axis_counts_from_1_as_the_hover_and_the_step_text_do():
    live = [(i * 2**20, 0, 0) for i in range(40)]
    fig = figures.timeline_figure(steps(live, 20), 20, budget=2**30, marker=0)
    stack = fig["data"][0]
    # the hover names the step at its own x: "step 5: ..." sits at x = 5
    assert all(t.startswith(f"step {x}:") for x, t in zip(stack["x"], stack["text"]))
    assert stack["x"][0] == 1 and stack["x"][-1] == 40
    assert fig["data"][figures.T_MARKER]["x"] == [1, 1]  # the stepper's "step 1 of 40"
    assert figures.marker_trace(39, 1.0)["x"] == [40, 40]
    forward, backward = fig["layout"]["shapes"]
    assert (forward["x0"], forward["x1"], backward["x1"]) == (0.5, 20.5, 40.5)
    rows = [{"start": 0, "end": 3, "nbytes": 2**20, "fate": "kept", "text": "t"}]
    band = [x for x in figures.tensor_figure(rows, 4, 2)["data"][0]["x"] if x is not None]
    assert min(band) == 0.5 and max(band) == 3.5  # steps 1 to 3


def test_tradeoff_marks_the_budget_and_puts_the_current_method_first():
    fig = figures.tradeoff_figure(
        {"sqrt_n": [(60, 30)], "rockmate": [(40, 50), (70, 10), (100, 0)]},
        {"rockmate": "Rockmate"},
        "rockmate",
        70,
    )
    mine = fig["data"][-1]  # drawn last: on top
    assert mine["meta"] == "rockmate" and mine["x"] == [40, 70, 100]
    assert mine["legendrank"] < fig["data"][0]["legendrank"]  # first in the legend
    assert fig["layout"]["shapes"][0]["x0"] == 70


def test_tradeoff_curves_that_meet_stay_visible_and_say_they_coincide():
    labels = {"sqrt_n": "√n", "checkpoint_blocks": "every block", "offload": "remat + offload"}
    fig = figures.tradeoff_figure(
        {
            "offload": [(10, 0.0), (40, 0.0), (100, 0.0)],  # hidden behind compute: no extra
            "rockmate": [(30, 40), (60, 5), (100, 0)],
            "sqrt_n": [(35, 33), (52, 21), (100, 0)],
            "checkpoint_blocks": [(52, 21)],  # a point on the √n line
        },
        labels,
        "offload",
        50,
    )
    drawn = [t["meta"] for t in fig["data"]]
    by = {t["meta"]: t for t in fig["data"]}
    # the point on the √n line is drawn over it, and its legend says where it is
    assert drawn.index("checkpoint_blocks") > drawn.index("sqrt_n")
    assert by["checkpoint_blocks"]["name"] == "every block (coincides with √n)"
    assert all("coincides" not in by[m]["name"] for m in ("sqrt_n", "rockmate", "offload"))
    # told apart by marker and dash, not by colour alone
    looks = {(t["marker"]["symbol"], t["line"]["dash"]) for t in fig["data"]}
    assert len(looks) == len(fig["data"])
    # the curve at 0% extra sits above the x-axis line, not on it; the current on top
    assert fig["layout"]["yaxis"]["range"][0] < 0 < fig["layout"]["yaxis"]["range"][1]
    assert drawn[-1] == "offload" and by["offload"]["legendrank"] == 1
    # nearly on it (less than 1.5% of the axis apart) looks the same: say how near
    near = figures.tradeoff_figure(
        {"sqrt_n": [(35, 33), (52, 21.5)], "checkpoint_blocks": [(35, 33.4), (52, 21)]},
        labels,
        "rockmate",
        50,
    )
    names = {t["meta"]: t["name"] for t in near["data"]}
    assert names["checkpoint_blocks"] == "every block (within 0.5 points of √n)"


def test_graph_stylesheet_colours_fates_and_highlights():
    sheet = figures.graph_stylesheet({"kept": [1, 2], "recomputed": [3], "freed": []}, [3], [1])
    selectors = [r["selector"] for r in sheet]
    assert "#o1, #o2" in selectors and "#o3" in selectors


def test_graph_ids_differ_between_models_and_stylesheets_follow_them():
    a, b = figures.graph_prefix("resnet18|estimated|cpu"), figures.graph_prefix("vit-small|x|y")
    assert a != b
    block = SimpleNamespace(index=0, name="b", kind=0, forward_ops=[0, 1])
    ops = [SimpleNamespace(label="aten.mm", name=f"mm_{i}", outputs=[i]) for i in range(2)]
    values = [
        SimpleNamespace(index=0, producer=0, consumers=[1]),
        SimpleNamespace(index=1, producer=1, consumers=[]),
    ]
    ids_a = {e["data"]["id"] for e in figures.graph_elements([block], ops, values, a)}
    ids_b = {e["data"]["id"] for e in figures.graph_elements([block], ops, values, b)}
    assert ids_a.isdisjoint(ids_b) and all(i.startswith(a) for i in ids_a)
    sheet = figures.graph_stylesheet({"kept": [1]}, prefix=a)
    assert any(r["selector"] == f"#{a}o1" for r in sheet)


def test_block_graph_is_at_module_level_and_opens_a_layer_into_its_ops():
    blocks = [
        SimpleNamespace(index=0, name="a", kind=0, forward_ops=[0, 1]),
        SimpleNamespace(index=1, name="b", kind=1, forward_ops=[2, 3]),
    ]
    ops = [SimpleNamespace(label="aten.mm", name=f"mm_{i}", outputs=[i]) for i in range(4)]
    values = [
        SimpleNamespace(index=i, producer=i, consumers=[i + 1] if i < 3 else []) for i in range(4)
    ]
    closed = figures.graph_elements(blocks, ops, values, "p-", titles=["embed", "h.0"])
    nodes = [e for e in closed if "source" not in e["data"]]
    assert [n["classes"].split()[0] for n in nodes] == ["layer", "layer"]
    assert nodes[1]["data"]["text"] == "1 · h.0\n2 ops" and "parent" not in nodes[1]["data"]
    edges = [e["data"] for e in closed if "source" in e["data"]]
    assert [(e["source"], e["target"]) for e in edges] == [("p-b0", "p-b1")]  # layer to layer
    opened = figures.graph_elements(blocks, ops, values, "p-", expanded={1})
    parents = {e["data"]["id"]: e["data"].get("parent") for e in opened}
    assert parents["p-o2"] == parents["p-o3"] == "p-b1" and "p-o0" not in parents
    edges = {(e["data"]["source"], e["data"]["target"]) for e in opened if "source" in e["data"]}
    assert edges == {("p-b0", "p-o2"), ("p-o2", "p-o3")}
    sheet = figures.graph_stylesheet(block=1, prefix="p-", layers={"recomputed": [0]})
    styles = {r["selector"]: r["style"] for r in sheet}
    layer0, layer1 = 'node.layer[id = "p-b0"]', 'node.layer[id = "p-b1"]'
    assert styles[layer0]["border-color"] == figures.palette.FATE_COLORS["recomputed"]
    assert styles[layer1]["border-width"] >= 8  # the running layer, closed


def test_lru_keeps_at_most_size_and_evicts_least_recent():
    cache = LRU(2)
    cache.put("a", 1)
    cache.put("b", 2)
    assert cache.get("a") == 1  # a is now the most recent
    cache.put("c", 3)
    assert cache.keys() == ["a", "c"] and len(cache) == 2
    with pytest.raises(ValueError):
        LRU(0)


def test_lru_makes_each_key_once_across_threads():
    cache = LRU(4)
    calls = []

    def make():
        calls.append(1)
        time.sleep(0.05)
        return object()

    results = []
    threads = [
        threading.Thread(target=lambda: results.append(cache.get_or_make("k", make)))
        for _ in range(8)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(calls) == 1 and len({id(r) for r in results}) == 1


def test_plan_views_on_a_real_model():
    studio = Studio()
    key = studio.key("gpt-1layer", "estimated", "cpu")
    problem = studio.problem(key)
    peak = problem.store_all_peak
    method = "checkpoint_blocks"
    minimum = studio.minimum(key, method)
    assert minimum <= peak and slider_minimum(minimum, peak) <= 100
    plan = studio.plan(key, method, minimum)
    assert studio.plan(key, method, minimum) is plan  # cached
    fates = op_fates(problem, plan)
    assert sorted(sum(fates.values(), [])) == sorted(problem.graph.forward_ops)
    assert fates["recomputed"]
    recompute = next(s.index for s in plan.timeline if s.recompute)
    assert "Recompute" in step_view(problem, plan, recompute)["why"]
    fig = figures.timeline_figure(plan.timeline, plan.backward_start, plan.budget)
    assert fig["data"][figures.T_PEAK]["y"][0] <= fig["data"][figures.T_BUDGET]["y"][0]


def test_the_numbers_say_the_plans_peak_run_natively():
    """gpt-tiny at 40%: native execution cannot express Rockmate's cuts inside a layer, so
    the plan's native peak is higher than its own; the numbers show both, the native one
    as `core.lower` predicts it (held to the measured peak by tests/core/native/test_native_sim.py)."""
    from app.callbacks.budget import solved
    from core.errors import fmt_bytes

    studio = Studio()
    key = studio.key("gpt-tiny", "estimated", "cpu")
    peak = studio.problem(key).store_all_peak
    context = {"key": key, "peak": peak, "method": "rockmate", "for": "gpt-tiny", "min_pct": 0}
    shown = solved(studio, context, 40.0, None)
    plan = studio.plan(key, "rockmate", int(0.4 * peak))
    native = core.lower(plan).prediction.peak
    assert shown["native"] == fmt_bytes(native) and shown["peak"] == fmt_bytes(plan.predicted_peak)
    assert native > plan.predicted_peak


def test_a_bad_model_spec_is_refused_in_plain_words():
    from app.models import ModelSpecError, resolve_builder

    with pytest.raises(ModelSpecError, match="cannot import 'no_such_package.models'"):
        resolve_builder("no_such_package.models:build")
    with pytest.raises(ModelSpecError, match="package.module:callable"):
        resolve_builder("no-such-sample")
    with pytest.raises(ModelSpecError, match="has no callable"):
        resolve_builder("sample_models:nothing_here")
    with pytest.raises(ModelSpecError, match="unknown zoo model 'hf-nope': choose one of hf-gpt2"):
        resolve_builder("hf-nope")
    call = resolve_builder("gpt-tiny")()
    assert isinstance(call.model, torch.nn.Module) and call.args and call.loss_fn is None


def test_zoo_models_and_builders_of_model_calls_open_with_keywords_and_an_outside_loss():
    """A builder may return a core.ModelCall (keyword inputs, a loss outside the model), and
    the zoo's names resolve: the app measures a plan of it as it predicts."""
    from app.measure import measure_plan
    from app.models import resolve_builder

    call = resolve_builder("hf-bert")()
    assert call.kwargs and call.loss_fn is not None and call.targets
    studio = Studio({"bert": lambda: call})
    key = studio.key("bert", "estimated", "cpu")
    problem = studio.problem(key)
    plan = studio.plan(key, "checkpoint_blocks", problem.store_all_peak)
    got = measure_plan(studio.builders["bert"](), plan)
    assert got.peak == plan.predicted_peak + 4


def test_tensor_figure_stacks_bands_in_allocation_order_and_sums_the_rest():
    rows = [
        {"start": 0, "end": 4, "nbytes": 4, "fate": "kept", "text": "a"},
        {"start": 1, "end": 2, "nbytes": 2, "fate": "freed", "text": "b"},
        {"start": 2, "end": 4, "nbytes": 8, "fate": "temporary", "text": "c"},
        {"start": 1, "end": 3, "nbytes": 1, "fate": "gradient", "text": "d"},
    ]
    fig = figures.tensor_figure(rows, 4, 2, unit=("B", 1), max_bands=3)
    hover = next(t for t in fig["data"] if t.get("meta") == "hover")
    assert hover["text"] == ["a", "b", "c"]  # the 3 largest, by allocation, one stretch each
    fills = {t["name"]: t for t in fig["data"] if t.get("meta") == "bands"}
    assert len(fills) == 3  # one trace per fate, not one per storage
    c = [y for y in fills["temporary"]["y"] if y is not None]
    # b is freed before c is allocated: c sits on a alone; d (smallest) goes in the rest
    assert min(c) == 4 and max(c) == 12
    rest = next(t for t in fig["data"] if t.get("meta") == "rest")
    assert max(rest["y"]) == 13  # 4 + 8 + 1 at step 2: the stack equals the live total
    assert fig["layout"]["meta"]["storages"] == 4


def test_per_tensor_bands_sum_to_the_timeline_and_name_their_source():
    studio = Studio()
    key = studio.key("gpt-1layer", "estimated", "cpu")
    problem = studio.problem(key)
    plan = studio.plan(key, "checkpoint_blocks", studio.minimum(key, "checkpoint_blocks"))
    bands = live_bands(problem, plan)
    size = {b.value: problem.graph.values[b.value].nbytes for b in bands}
    for step in plan.timeline:
        alive = sum(size[b.value] for b in bands if b.start <= step.index < b.end)
        assert alive == step.live
    rows = tensor_rows(problem, plan, bands)
    peak = max(range(len(plan.timeline)), key=lambda i: plan.timeline[i].live)
    top = alive_at(rows, peak)
    assert sum(r["nbytes"] for r in top) == plan.predicted_peak
    assert [r["nbytes"] for r in top] == sorted((r["nbytes"] for r in top), reverse=True)
    forward = [r for r in rows if r["kind"] == "activation"]
    assert any(".py:" in r["text"] and "transformer" in r["text"] for r in forward)
    assert {r["fate"] for r in forward} >= {"kept", "recomputed"}
    fig = figures.tensor_figure(rows, len(plan.program), plan.backward_start)
    assert fig["layout"]["meta"]["bands"] == min(len(rows), figures.MAX_BANDS)
    assert isinstance(peak_hint(plan.timeline), str)


@pytest.mark.slow
def test_measure_here_runs_the_real_step_and_reads_it_back_per_program_step():
    from app.measure import measure_plan

    studio = Studio()
    key = studio.key("gpt-1layer", "estimated", "cpu")
    problem = studio.problem(key)
    plan = studio.plan(key, "rockmate", int(0.6 * problem.store_all_peak))
    call = studio.builders["gpt-1layer"]()
    model = call.model
    got = measure_plan(call, plan)
    assert got.peak == plan.predicted_peak + 4  # the scalar seed of loss.backward()
    assert len(got.live) == len(plan.program) and max(got.live) <= got.peak
    assert got.matched >= 0.8 * got.nodes  # program nodes found among the real ATen calls
    close = sum(abs(m - s.live) <= 4 for m, s in zip(got.live, plan.timeline))
    assert close >= 0.7 * len(plan.timeline)  # measured 85% (gpt-tiny store-all) here
    assert all(p.grad is not None for p in model.parameters())  # a real backward ran


def test_step_reasons_name_the_backward_reader_and_the_price():
    studio = Studio()
    key = studio.key("gpt-1layer", "estimated", "cpu")
    problem = studio.problem(key)
    plan = studio.plan(key, "rockmate", int(0.6 * problem.store_all_peak))
    whys = [step_view(problem, plan, i)["why"] for i in range(plan.backward_start)]
    graph = problem.graph
    readers = {op_name(graph, op.index).words for op in graph.ops if op.phase == "backward"}
    kept = [w for w in whys if "; kept: " in w]
    assert kept and all("recomputing it would cost" in w for w in kept)
    # the backward reader by module and kind ("… · gradient of the GELU activation")
    assert any(w.split("; kept: ")[1].startswith(r + " ") for w in kept for r in readers)
    assert any("the plan recomputes it there (" in w for w in whys)


@pytest.mark.slow
def test_app_reads_back_an_offload_plan():
    """An offload plan's step-through, per-tensor rows and graph colours: offloaded ops have
    their own fate, offload and prefetch steps their own sentences."""
    model, inputs = fresh("gpt-tiny")
    problem = core.analyze(model, inputs, device="h100")
    plan = core.solve(problem, 0.5, "offload")
    fates = op_fates(problem, plan)
    assert fates["offloaded"]
    kinds = {kind for kind, _ in plan.program}
    assert {"offload", "prefetch"} <= kinds
    whys = {kind: step_view(problem, plan, i)["why"] for i, (kind, _) in enumerate(plan.program)}
    assert whys["offload"].startswith("Offload ") and whys["prefetch"].startswith("Prefetch ")
    first = next(
        i for i, (k, t) in enumerate(plan.program) if k == "run" and t in fates["offloaded"]
    )
    assert "offloaded:" in step_view(problem, plan, first)["why"]
    rows = tensor_rows(problem, plan, live_bands(problem, plan))
    assert any(r["fate"] == "offloaded" for r in rows)
    figures.tensor_figure(rows, len(plan.program), plan.backward_start)
    figures.graph_stylesheet(fates, prefix="m")
