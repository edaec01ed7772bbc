"""Models nobody here wrote (sample_models/hf_zoo.py), called as users call them: keyword
inputs, the loss computed outside the model. Plans must be exact: gradients, loss and random
stream equal eager's bit for bit, measured peak = predicted + 4 bytes (the scalar seed of
backward)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers import SEED_BYTES

import bench.solvers
import core
from app import cli
from bench import MissingExtra
from bench.solvers import zoo_builders, zoo_rows, zoo_table
from core.errors import PlanMismatch
from core.memory import StorageTracker, step_tensors
from sample_models.hf_zoo import ZOO, ZooCase, gpt2_meta


@pytest.fixture(autouse=True)
def _one_thread():
    """Bit-identical gradients are held on 1 thread. On 2, Mixtral's expert weights came out
    4.7e-10 off eager's in one store_all run (a kernel's work split across threads), while
    eager repeated on 2 threads was stable: not yet explained, left for a GPU/threads check."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _step(case: ZooCase, run=None, seed: int = 3) -> tuple[int, torch.Tensor, dict]:
    """One training step from zero grads under a storage tracker: peak, loss, grads."""
    model = case.model
    model.zero_grad(set_to_none=True)
    torch.manual_seed(seed)
    given = [x for x in (*case.args, *case.kwargs.values(), *case.targets) if torch.is_tensor(x)]
    with StorageTracker(step_tensors(model, given)) as tracker:
        if run is None:
            loss = case.loss_fn(model(*case.args, **case.kwargs), *case.targets)
        else:
            loss = run(*case.args, **case.kwargs, targets=case.targets)
        loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return tracker.peak, loss.detach(), grads


@pytest.mark.parametrize("name", sorted(ZOO))
def test_zoo_plans_are_exact_with_keywords_and_an_outside_loss(name):
    case = ZOO[name]()
    problem = core.analyze(case.model, case.args, case.kwargs, case.loss_fn, case.targets)
    start = {k: v.clone() for k, v in case.model.state_dict().items()}
    _, eager_loss, eager_grads = _step(case)
    eager_state = {k: v.clone() for k, v in case.model.state_dict().items()}
    eager_rng = torch.get_rng_state()
    assert eager_grads, "the model has trainable parameters that get gradients"
    # one block per repeated layer at least, the layers grouped into shared kinds
    assert len(problem.blocks) >= case.layers
    assert len({b.kind for b in problem.blocks}) < len(problem.blocks)
    plans = [core.solve(problem, 1.0, method="checkpoint_blocks")]
    between = (problem.store_all_peak + plans[0].predicted_peak) // 2  # bytes
    plans.append(core.solve(problem, between, method="rockmate"))
    assert plans[0].recomputed_ops > 0
    for plan in plans:
        case.model.load_state_dict(start)
        peak, loss, grads = _step(case, core.apply_plan(case.model, plan))
        assert torch.equal(loss, eager_loss), plan.method
        assert grads.keys() == eager_grads.keys()
        for key, want in eager_grads.items():  # bit-identical: the same ops in the same order
            assert torch.equal(grads[key], want), (plan.method, key)
        for key, value in case.model.state_dict().items():
            assert torch.equal(value, eager_state[key]), key
        assert torch.equal(torch.get_rng_state(), eager_rng)
        assert peak == plan.predicted_peak + 4, plan.method


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


def test_the_plain_benchmarks_do_not_import_transformers():
    """`remat bench --quick` runs on a plain install (.ci/run): the CLI and the benchmark
    modules load without transformers, which only the zoo imports."""
    code = (
        "import sys, app.cli, bench.compare, bench.solvers, sample_models\n"
        "assert 'transformers' not in sys.modules, 'transformers imported'\n"
    )
    root = Path(__file__).resolve().parent.parent
    done = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]
