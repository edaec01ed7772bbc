"""The page's step switches and memory against batch size: the optimizer in the step marked on
the timeline and said in the intro, the chunked head's floor, and the batch chart."""

from __future__ import annotations

import pytest

import core
from app.batch import batch_figure, batch_rows
from app.callbacks.analysis import intro_numbers
from app.callbacks.budget import update_steps
from app.callbacks.common import context_sig
from app.figures import timeline_figure
from app.state import Studio, base_key
from app.words import intro
from core.fit import BatchProblems
from core.footprint import CAPACITY


@pytest.fixture(scope="module")
def studio():
    return Studio()


def test_optimizer_in_the_step_marks_its_updates_and_the_intro_says_what_it_saves(studio):
    key = studio.key("gpt-tiny", "estimated", "cpu", ["optimizer"])
    assert key == "gpt-tiny|estimated|cpu|optimizer" and base_key(key) == "gpt-tiny|estimated|cpu"
    assert context_sig("gpt-tiny", "estimated", "cpu", "rockmate", False, ["optimizer"]).endswith(
        "|off+optimizer"
    )
    problem = studio.problem(key)
    plan = core.solve(problem, problem.store_all_peak, "store_all")
    updates = update_steps(problem, plan.timeline)
    assert updates and all(problem.graph.ops[plan.timeline[i].target].update for i in updates)
    fig = timeline_figure(plan.timeline, plan.backward_start, plan.budget, updates=updates)
    marked = [t for t in fig["data"] if t.get("meta") == "updates"]
    assert len(marked) == 1 and len(marked[0]["x"]) == len(updates)
    numbers = intro_numbers(studio, key, problem, studio.methods(problem))
    plain = studio.problem(base_key(key)).store_all_peak
    assert numbers["plain_step_peak"] == plain >= problem.store_all_peak
    assert numbers["updates"] == sum(1 for op in problem.graph.ops if op.update) > 0
    words = str(intro("gpt-tiny", "tiny", numbers))
    assert "saved" in words and "optimizer.step()" in words


def test_chunked_loss_head_reaches_the_analysis_and_its_refusal_is_clear(studio):
    # gpt-tiny's loss is not an LM head at the model's top level: the switch reaches
    # core.analyze, which refuses by name (the page shows the message)
    with pytest.raises(core.UnsupportedModel, match="loss_head='chunked'"):
        studio.problem(studio.key("gpt-tiny", "estimated", "cpu", ["chunked"]))


def test_memory_against_batch_grows_and_draws_the_device_capacity(studio):
    probe = BatchProblems(studio.builders["gpt-tiny"](), None, "v100")
    rows, refused = batch_rows(probe, "rockmate", 0.6, batches=(1, 2, 4))
    assert refused == []
    eager = [r.eager for r in rows]
    assert eager == sorted(eager) and eager[0] < eager[-1]
    assert all(r.ours is None or r.fixed < r.ours < r.eager for r in rows)
    fig = batch_figure(rows, CAPACITY["v100"], "Rockmate at 60%", "a V100's memory")
    assert [t["x"] for t in fig["data"]][1] == [1, 2, 4]
    # a few MiB against 32 GiB: the axis ends at the data, the device is named at its break
    assert fig["layout"]["meta"]["scale"] == "break" and fig["layout"]["shapes"] == []
    assert "is off this scale" in fig["layout"]["annotations"][0]["text"]
    fig = batch_figure(rows, 4 * rows[-1].eager, "Rockmate at 60%", "a small device's memory")
    assert fig["layout"]["shapes"][0]["y0"] > 0 and fig["layout"]["meta"]["scale"] == "device"


def test_memory_against_batch_leaves_out_the_batch_sizes_that_do_not_trace(studio):
    """resnet-tiny's batch-norm refuses a batch of 1 in training: the chart shows the other
    batch sizes and says why 1 is missing, instead of failing whole."""
    probe = BatchProblems(studio.builders["resnet-tiny"](), None, "v100")
    rows, refused = batch_rows(probe, "rockmate", 0.6, (1, 2))
    assert [r.batch for r in rows] == [2]
    ((batch, why),) = refused
    assert batch == 1 and "more than 1 value per channel" in why and "BatchNorm2d" in why
