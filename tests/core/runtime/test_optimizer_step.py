"""The optimizer in the step (`analyze(..., optimizer=opt)`): each parameter updated inside the
backward, its gradient freed after the update; parameters bit-identical to eager torch.optim
(single-tensor) after 20 steps, measured = predicted + 4 B on every step."""

import pytest
import torch
from helpers import SEED_BYTES
from torch import nn

import core
from core.memory import StorageTracker, step_tensors
from core.optimizer_step import UnsupportedOptimizer
from sample_models.gpt import GPT, GPTConfig

OPTIMIZERS = [
    (torch.optim.SGD, dict(lr=0.1)),
    (torch.optim.SGD, dict(lr=0.1, momentum=0.9, weight_decay=0.01, nesterov=True)),
    (torch.optim.Adam, dict(lr=1e-2, weight_decay=0.1)),
    (torch.optim.AdamW, dict(lr=1e-2, weight_decay=0.1, maximize=True)),
]


def mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 4)
    )


def loss_fn(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(out, y)


def opt_tensors(opt: torch.optim.Optimizer) -> list[torch.Tensor]:
    """The optimizer's state: persistent, like parameters, outside a step's peak."""
    return [t for s in opt.state.values() for t in s.values() if torch.is_tensor(t)]


def planned_steps(model, inputs, targets, opt, plan, steps: int) -> None:
    """`steps` steps of `plan`, each measured: peak = predicted + 4 B, no .grad left."""
    run = core.apply_plan(model, plan)
    for _ in range(steps):
        existing = step_tensors(model, [*inputs, *targets]) + opt_tensors(opt)
        with StorageTracker(existing) as tracker:
            run(*inputs, targets=targets).backward()
        assert tracker.peak == plan.predicted_peak + SEED_BYTES
        assert all(p.grad is None for p in model.parameters())


@pytest.mark.parametrize("opt_cls,kw", OPTIMIZERS)
def test_updates_in_the_step_equal_eager_optimizer_steps(opt_cls, kw):
    x, y = torch.randn(64, 16), torch.randint(0, 4, (64,))
    eager, planned = mlp(), mlp()
    opt_a = opt_cls(eager.parameters(), foreach=False, **kw)
    opt_b = opt_cls(planned.parameters(), foreach=False, **kw)
    problem = core.analyze(planned, (x,), loss_fn=loss_fn, targets=(y,), optimizer=opt_b)
    without = core.analyze(planned, (x,), loss_fn=loss_fn, targets=(y,))
    assert problem.store_all_peak < without.store_all_peak  # no gradient waits to the end
    assert any(op.update for op in problem.graph.ops)
    for method in ("store_all", "checkpoint_blocks"):
        planned_steps(planned, (x,), (y,), opt_b, core.solve(problem, 1.0, method=method), 10)
    for _ in range(20):
        opt_a.zero_grad()
        loss_fn(eager(x), y).backward()
        opt_a.step()
    for (n, p), q in zip(eager.named_parameters(), planned.parameters(), strict=True):
        assert torch.equal(p, q), n
    for s, t in zip(opt_tensors(opt_a), opt_tensors(opt_b), strict=True):
        assert torch.equal(s, t)


@pytest.mark.slow  # about 35 s on a shared 2-core machine
def test_a_gpt_with_dropout_and_adamw_under_a_recomputing_plan():
    cfg = GPTConfig(block_size=32, vocab_size=128, n_layer=2, n_head=2, n_embd=32, dropout=0.1)
    torch.manual_seed(0)
    eager = GPT(cfg)
    planned = GPT(cfg)
    planned.load_state_dict(eager.state_dict())
    idx, tgt = torch.randint(0, 128, (2, 32)), torch.randint(0, 128, (2, 32))
    opt_a = torch.optim.AdamW(eager.parameters(), lr=1e-3, foreach=False)
    opt_b = torch.optim.AdamW(planned.parameters(), lr=1e-3, foreach=False)
    problem = core.analyze(planned, (idx, tgt), optimizer=opt_b)
    plan = core.reorder(core.solve(problem, 0.6, method="rockmate"))
    assert plan.recomputed_ops > 0
    run = core.apply_plan(planned, plan)
    for step in range(3):
        torch.manual_seed(step)
        opt_a.zero_grad()
        eager(idx, tgt).backward()
        opt_a.step()
        torch.manual_seed(step)
        existing = step_tensors(planned, (idx, tgt)) + opt_tensors(opt_b)
        with StorageTracker(existing) as tracker:
            run(idx, tgt).backward()
        assert tracker.peak == plan.predicted_peak + SEED_BYTES
    for (n, p), q in zip(eager.named_parameters(), planned.parameters(), strict=True):
        assert torch.equal(p, q), n


def test_what_the_step_cannot_honour_is_refused_by_name():
    x, y = torch.randn(8, 16), torch.randint(0, 4, (8,))
    model = mlp()
    with pytest.raises(UnsupportedOptimizer, match="Adagrad"):
        core.analyze(
            model,
            (x,),
            loss_fn=loss_fn,
            targets=(y,),
            optimizer=torch.optim.Adagrad(model.parameters()),
        )
    with pytest.raises(UnsupportedOptimizer, match="amsgrad"):
        opt = torch.optim.Adam(model.parameters(), amsgrad=True)
        core.analyze(model, (x,), loss_fn=loss_fn, targets=(y,), optimizer=opt)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    problem = core.analyze(model, (x,), loss_fn=loss_fn, targets=(y,), optimizer=opt)
    run = core.apply_plan(model, core.solve(problem, 1.0, method="store_all"))
    run(x, targets=y).backward()
    scheduler = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    scheduler.step()  # a per-batch schedule changes the traced rate
    with pytest.raises(UnsupportedOptimizer, match="scheduler"):
        run(x, targets=y)
    opt.param_groups[0]["lr"] = 0.1
    model[0].weight.grad = torch.zeros_like(model[0].weight)  # accumulation from eager
    with pytest.raises(UnsupportedOptimizer, match="accumulation"):
        run(x, targets=y)


def test_a_saved_plan_binds_its_optimizer_in_a_fresh_model(tmp_path):
    """The optimizer is recorded in the plan file (kind, hyperparameters, groups): a fresh
    model and optimizer in another process apply it, and equal eager AdamW bit for bit."""
    x, y = torch.randn(64, 16), torch.randint(0, 4, (64,))
    kw = dict(lr=1e-2, weight_decay=0.1, foreach=False)
    made = mlp()
    problem = core.analyze(
        made,
        (x,),
        loss_fn=loss_fn,
        targets=(y,),
        optimizer=torch.optim.AdamW(made.parameters(), **kw),
    )
    core.solve(problem, 1.0, method="checkpoint_blocks").save(tmp_path / "plan.pkl")
    plan = core.load_plan(tmp_path / "plan.pkl")
    assert plan.graph_meta.optimizer["kind"] == "adamw"
    eager, fresh = mlp(), mlp()
    opt_a = torch.optim.AdamW(eager.parameters(), **kw)
    with pytest.raises(core.PlanMismatch, match="optimizer=opt"):
        core.apply_plan(fresh, plan, loss_fn=loss_fn)
    with pytest.raises(core.PlanMismatch, match="lr 0.02"):
        other = torch.optim.AdamW(fresh.parameters(), **{**kw, "lr": 2e-2})
        core.apply_plan(fresh, plan, loss_fn=loss_fn, optimizer=other)
    with pytest.raises(core.PlanMismatch, match="adam, the plan's is adamw"):
        other = torch.optim.Adam(fresh.parameters(), **kw)
        core.apply_plan(fresh, plan, loss_fn=loss_fn, optimizer=other)
    opt_b = torch.optim.AdamW(fresh.parameters(), **kw)
    run = core.apply_plan(fresh, plan, loss_fn=loss_fn, optimizer=opt_b)
    for _ in range(20):
        opt_a.zero_grad()
        loss_fn(eager(x), y).backward()
        opt_a.step()
        existing = step_tensors(fresh, [x, y]) + opt_tensors(opt_b)
        with StorageTracker(existing) as tracker:
            run(x, targets=y).backward()
        assert tracker.peak == run.plan.predicted_peak + SEED_BYTES
    for (n, p), q in zip(eager.named_parameters(), fresh.parameters(), strict=True):
        assert torch.equal(p, q), n
    for s, t in zip(opt_tensors(opt_a), opt_tensors(opt_b), strict=True):
        assert torch.equal(s, t)


def test_a_plan_file_with_a_damaged_optimizer_record_is_refused():
    from core.plan_io import check_graph_meta

    x, y = torch.randn(8, 16), torch.randint(0, 4, (8,))
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    meta = core.analyze(model, (x,), loss_fn=loss_fn, targets=(y,), optimizer=opt).graph_meta
    data = meta.to_data()
    check_graph_meta(data)
    for damage in (
        {"kind": "lion"},
        {"groups": [{**data["optimizer"]["groups"][0], "lr": "os.system"}]},
        {"of": [0]},
    ):
        with pytest.raises(core.PlanFileError, match="optimizer"):
            check_graph_meta({**data, "optimizer": {**data["optimizer"], **damage}})


@pytest.mark.parametrize(
    "opt_cls,kw",
    [
        (torch.optim.AdamW, dict(lr=1e-2, weight_decay=0.1)),
        (torch.optim.Adam, dict(lr=1e-2, weight_decay=0.1, maximize=True)),
        (torch.optim.SGD, dict(lr=0.1, momentum=0.9, nesterov=True)),
    ],
)
def test_the_update_holds_no_more_than_torchs_in_place_step(opt_cls, kw):
    """Where the update is the peak (one large weight, one row), the step with the optimizer
    in it holds no more than eager backward + torch's single-tensor step."""
    torch.manual_seed(0)
    model = nn.Linear(256, 256, bias=False)
    x, y = torch.randn(1, 256), torch.randint(0, 256, (1,))
    eager = opt_cls(model.parameters(), foreach=False, **kw)
    loss_fn(model(x), y).backward()
    eager.step()  # creates the states, so both sides start with them
    model.weight.grad = None
    existing = step_tensors(model, [x, y]) + opt_tensors(eager)
    with StorageTracker(existing) as tracker:
        loss_fn(model(x), y).backward()
        eager.step()
    model.weight.grad = None
    problem = core.analyze(model, (x,), loss_fn=loss_fn, targets=(y,), optimizer=eager)
    plan = core.solve(problem, 1.0, method="store_all")
    planned_steps(model, (x,), (y,), eager, plan, 1)
    # beyond torch's, bytes, not parameters: the loss and backward's seed (4 B each) live
    # while the updates run inside the backward; Adam's bias corrections are two float64
    # scalars (8 B each) where torch's are Python floats (the step count they come from
    # changes every step, so they are traced tensors). One more weight-sized temporary
    # (256 KiB) would fail.
    scalars = 2 * 8 if opt_cls is not torch.optim.SGD else 0
    assert plan.predicted_peak + SEED_BYTES <= tracker.peak + 4 + 4 + scalars


def test_a_program_reading_a_parameter_after_its_update_is_refused():
    """A recomputation of a forward op after its weight's update would read the new value."""
    x, y = torch.randn(8, 16), torch.randint(0, 4, (8,))
    model = mlp()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, foreach=False)
    problem = core.analyze(model, (x,), loss_fn=loss_fn, targets=(y,), optimizer=opt)
    plan = core.solve(problem, 1.0, method="store_all")
    first = next(op for op in problem.graph.ops if op.phase == "forward")
    late = [("run", first.index)] + [("free", v) for v in first.outputs]
    with pytest.raises(core.InvalidPlan, match="after .* updated it"):
        core.apply_plan(model, plan.replace(program=[*plan.program, *late]))


def test_the_native_runtime_refuses_a_plan_that_runs_the_optimizer():
    """Native execution leaves the backward to autograd, which runs no update: applying such
    a plan natively would train nothing, silently."""
    x, y = torch.randn(8, 16), torch.randint(0, 4, (8,))
    model = mlp()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, foreach=False)
    problem = core.analyze(model, (x,), loss_fn=loss_fn, targets=(y,), optimizer=opt)
    plan = core.solve(problem, 1.0, method="store_all")
    with pytest.raises(core.InvalidPlan, match="optimizer's updates .* runtime='interpreter'"):
        core.apply_plan(model, plan, loss_fn=loss_fn, runtime="native")
