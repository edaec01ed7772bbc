"""Models nobody here wrote (sample_models/hf_zoo.py), called as users call them: keyword
inputs, the loss computed outside the model. Plans must be exact, recomputing or offloading:
gradients, loss, buffers and random stream equal eager's bit for bit, measured peak =
predicted + 4 bytes (the scalar seed of backward), host bytes = predicted."""

from __future__ import annotations

import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from helpers import SEED_BYTES, forced, zoo_step
from zoo_exact import eager as _eager
from zoo_exact import run_exactly as _run_exactly

import bench.solvers
import core
from app import cli
from bench import MissingExtra
from bench.solvers import zoo_builders, zoo_rows, zoo_table
from core.errors import PlanMismatch
from core.simulator import OFFLOAD
from core.validate import check_program
from sample_models.hf_zoo import ZOO, ZooCase, gpt2_meta

# Budgets (fractions of store-all) where each zoo model's plans offload, found by trying
# (estimated cpu costs, its 17.5 GB/s link): the offload solver's near its minimum, POFO's
# where its table offloads a checkpoint (bert, t5) or, where it never does on these 2-layer
# chains, well below store-all, with offloads forced on top of its recomputation.
OFFLOAD_BUDGETS = {
    "hf-bert": 0.6,
    "hf-gpt2": 0.6,
    "hf-llama": 0.5,
    "hf-mixtral": 0.4,
    "hf-resnet": 0.9,
    "hf-t5": 0.4,
    "hf-vit": 0.7,
}
POFO_BUDGETS = {
    "hf-bert": 0.6,
    "hf-gpt2": 0.6,
    "hf-llama": 0.6,
    "hf-mixtral": 0.5,
    "hf-resnet": 0.8,
    "hf-t5": 0.6,
    "hf-vit": 0.7,
}
POFO_OFFLOADS = {"hf-bert", "hf-t5"}  # where POFO's own table offloads at its budget
FORCED = 2  # offloads added to POFO's plan elsewhere


pytestmark = pytest.mark.usefixtures("one_thread")  # bit-identical on 1 thread


# the zoo's largest tiny models: their tests take 5-15 s each, so only `make test` runs them
SLOW_ZOO = ("hf-bert", "hf-gpt2", "hf-llama", "hf-mixtral", "hf-t5", "hf-vit")


@pytest.fixture(
    scope="module",
    params=[pytest.param(n, marks=pytest.mark.slow) if n in SLOW_ZOO else n for n in sorted(ZOO)],
)
def zoo(request) -> tuple[str, ZooCase, core.Problem, dict]:
    """Each zoo model analysed once for this module's tests: name, case, problem and its
    starting state (parameters and buffers)."""
    case = ZOO[request.param]()
    problem = core.analyze(case.model, case.args, case.kwargs, case.loss_fn, case.targets)
    return request.param, case, problem, {k: v.clone() for k, v in case.model.state_dict().items()}


def _step(case: ZooCase, run=None, seed: int = 3) -> tuple[int, torch.Tensor, dict]:
    """One training step from zero grads under a storage tracker: peak, loss, grads."""
    peak, _, loss, grads = zoo_step(case, run, seed)
    return peak, loss, grads


def test_zoo_plans_are_exact_with_keywords_and_an_outside_loss(zoo):
    _, case, problem, start = zoo
    eager = _eager(case, start)
    assert eager.grads, "the model has trainable parameters that get gradients"
    # one block per repeated layer at least, the layers grouped into shared kinds
    assert len(problem.blocks) >= case.layers
    assert len({b.kind for b in problem.blocks}) < len(problem.blocks)
    plans = [core.solve(problem, 1.0, method="checkpoint_blocks")]
    between = (problem.store_all_peak + plans[0].predicted_peak) // 2  # bytes
    plans.append(core.solve(problem, between, method="rockmate"))
    assert plans[0].recomputed_ops > 0
    for plan in plans:
        assert _run_exactly(case, start, plan, eager).host_peak == 0


def _offloaded_bytes(plan: core.Plan) -> int:
    values = plan.problem.graph.values
    return sum(values[v].nbytes for kind, v in plan.program if kind == OFFLOAD)


def test_zoo_offload_plans_are_exact_and_round_trip(zoo, tmp_path):
    """The offload solver's plan, and POFO's (its own offloads, or offloads forced on top of
    its recomputation), at a budget where they offload: bit-identical to eager's step, device
    peak = predicted + 4 bytes, host bytes = predicted; saved, loaded into a fresh trace of
    the model (with the loss_fn again) and run again, exactly the same. Two steps of one
    planned module: the second reuses the first's host pool."""
    name, case, problem, start = zoo
    eager = _eager(case, start)
    offload = core.solve(problem, OFFLOAD_BUDGETS[name], method="offload")
    pofo = core.solve(problem, POFO_BUDGETS[name], method="pofo")
    if name in POFO_OFFLOADS:
        assert _offloaded_bytes(pofo) > 0, "POFO's table offloads a checkpoint here"
    else:  # POFO's plan with offloads: its method, budget and graph for the plan file
        pofo = replace(
            forced(problem, pofo, FORCED),
            method="pofo",
            budget=pofo.budget,
            notes=[f"{FORCED} offloads forced on top of POFO's plan"],
        )
    for plan in (offload, pofo):
        sim = check_program(plan, problem)
        assert _offloaded_bytes(plan) > 0 and sim.host_peak > 0, plan.method
        assert plan.predicted_peak <= plan.budget, plan.method
        host = _run_exactly(case, start, plan, eager, steps=2).host_peak  # the pool used again
        assert host == plan.predicted_host_bytes == sim.host_peak
        plan.save(tmp_path / f"{plan.method}.pkl")
    # as in another process: the first file is bound to a new trace of the model (the loss_fn
    # given again), the second to that same trace (one more trace would only cost time)
    run = _run_exactly(
        case, start, core.load_plan(tmp_path / f"{offload.method}.pkl"), eager, loss_fn=case.loss_fn
    )
    first, host = run.plan, run.host_peak  # the plan apply_plan bound to the new trace
    assert first.problem is not problem and host == offload.predicted_host_bytes
    second = core.load_plan(tmp_path / f"{pofo.method}.pkl").on(first.problem)
    assert _run_exactly(case, start, second, eager).host_peak == pofo.predicted_host_bytes
    for loaded, plan in ((first, offload), (second, pofo)):
        assert (loaded.program, loaded.predicted_peak) == (plan.program, plan.predicted_peak)


def test_zoo_model_in_eval_mode_and_a_wrong_call():
    """Outside training the planned module runs the model (and the loss); a call that differs
    from the plan's (a keyword missing, another bound value) is a PlanMismatch saying so."""
    case = ZOO["hf-gpt2"]()
    case.kwargs["use_cache"] = False
    problem = core.analyze(case.model, case.args, case.kwargs, case.loss_fn, case.targets)
    planned = core.apply_plan(case.model, core.solve(problem, 1.0, method="checkpoint_blocks"))
    with torch.no_grad():
        loss = planned(*case.args, **case.kwargs, targets=case.targets)
    assert loss.dim() == 0
    with pytest.raises(PlanMismatch, match="keywords \\['attention_mask', 'use_cache'\\]"):
        planned(*case.args, targets=case.targets)
    with pytest.raises(PlanMismatch, match="'use_cache' is True"):
        planned(
            *case.args,
            attention_mask=case.kwargs["attention_mask"],
            use_cache=True,
            targets=case.targets,
        )


def test_zoo_plan_file_round_trip_with_keywords_and_loss_fn(tmp_path):
    """A saved plan carries the call (keywords, bound values, targets): loaded and applied
    with the same loss_fn it runs exactly as in the process that made it; without the
    loss_fn it is a PlanMismatch saying to pass it."""
    case = ZOO["hf-llama"]()
    case.kwargs["use_cache"] = False
    problem = core.analyze(case.model, case.args, case.kwargs, case.loss_fn, case.targets)
    plan = core.solve(problem, 1.0, method="checkpoint_blocks")
    plan.save(tmp_path / "plan.pkl")
    loaded = core.load_plan(tmp_path / "plan.pkl")
    start = {k: v.clone() for k, v in case.model.state_dict().items()}
    _, eager_loss, eager_grads = _step(case)
    case.model.load_state_dict(start)
    peak, loss, grads = _step(case, core.apply_plan(case.model, loaded, loss_fn=case.loss_fn))
    assert torch.equal(loss, eager_loss) and peak == plan.predicted_peak + 4
    assert all(torch.equal(grads[k], v) for k, v in eager_grads.items())
    with pytest.raises(PlanMismatch, match="loss_fn"):  # a fresh load: apply bound the first
        core.apply_plan(case.model, core.load_plan(tmp_path / "plan.pkl"))


@pytest.mark.slow  # a `remat bench --solvers` zoo run
def test_bench_zoo_rows_for_a_tiny_and_a_meta_model():
    """`remat bench --solvers`'s zoo path, real solver: the tiny ResNet (the quickest to solve),
    whose plans run (measured = predicted + 4 bytes), and a 2-layer GPT-2 of d768 from the meta
    device (later budgets timed). The 50% cell is at 50% or, below Rockmate's minimum, at the
    minimum."""
    rows = zoo_rows({"hf-resnet": ZOO["hf-resnet"]}, {"hf-gpt2-2l": lambda: gpt2_meta(2)})
    tiny, meta = rows
    assert (tiny.name, meta.name) == ("hf-resnet", "hf-gpt2-2l")
    for row in rows:
        assert row.blocks >= 2 and row.kinds < row.blocks
        assert row.analyze_s > 0 and row.first_solve_s > 0
        for p in (row.half, row.lowest):
            assert 0 < p.peak <= p.budget <= 1 and p.overhead >= 1
        assert row.lowest.budget <= row.half.budget
        assert row.half.budget == 0.5 or row.half == row.lowest
    assert tiny.measured_minus_predicted == (SEED_BYTES,) * (1 + (tiny.half != tiny.lowest))
    assert tiny.new_budget_ms is None
    assert meta.measured_minus_predicted is None and meta.new_budget_ms > 0
    assert meta.store_all_peak > 2**27  # d768 x 512 tokens: the real shapes, not the tiny ones
    table = zoo_table(rows).splitlines()
    assert table[3].startswith(f"| hf-resnet | {tiny.blocks} ({tiny.kinds}) |")
    assert table[3].endswith(f" {SEED_BYTES} B |")
    assert table[-1].startswith(f"| hf-gpt2-2l | {meta.blocks} ({meta.kinds}) |")


def test_zoo_without_transformers_is_one_error_line(monkeypatch, capsys):
    """`remat bench --zoo` on an install without the bench extra: one line naming the extra;
    `--solvers` prints its sample-model part and says the zoo was left out and why."""
    monkeypatch.setitem(sys.modules, "transformers", None)  # `import transformers` raises
    monkeypatch.delitem(sys.modules, "sample_models.hf_zoo")
    with pytest.raises(
        MissingExtra, match=r"needs transformers: pip install 'remat-studio\[bench\]'"
    ):
        zoo_builders()
    assert cli.main(["bench", "--zoo"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: the zoo of `remat bench --solvers` needs transformers")
    assert err.count("\n") == 1 and "Traceback" not in err
    monkeypatch.setattr(bench.solvers, "bench_solvers", lambda: "the sample models' table")
    assert cli.main(["bench", "--solvers"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0] == "the sample models' table" and out[1].startswith("zoo left out: ")


@pytest.mark.slow
def test_the_plain_benchmarks_do_not_import_transformers():
    """`remat bench --quick` runs on a plain install (.ci/run): the CLI and the benchmark
    modules load without transformers, which only the zoo imports."""
    code = (
        "import sys, app.cli, bench.compare, bench.solvers, sample_models\n"
        "assert 'transformers' not in sys.modules, 'transformers imported'\n"
    )
    root = Path(__file__).resolve().parents[2]
    done = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]
