"""The runtime runs the simulator's program: same gradients as eager, predicted peak = measured."""

from dataclasses import dataclass

import pytest
import torch
from helpers import SEED_BYTES, assert_same_grads, fresh, measured_step
from torch import nn

import core
from core.errors import PlanMismatch
from sample_models import SMALL

SIMPLE = ["store_all", "checkpoint_blocks", "sqrt_n"]
MODELS = [*SMALL, "gpt-1layer", "resnet-bottleneck-tiny", "unet-tiny", "two-tower-tiny"]


@pytest.mark.parametrize("name", MODELS)
def test_simple_plans_match_eager_gradients_state_rng_and_predicted_peak(name):
    model, inputs = fresh(name)
    problem = core.analyze(model, inputs)
    start_state = {k: v.clone() for k, v in model.state_dict().items()}
    _, eager_loss, eager_grads = measured_step(model, inputs, seed=3)
    eager_state = {k: v.clone() for k, v in model.state_dict().items()}
    eager_rng = torch.get_rng_state()
    for method in SIMPLE:
        plan = core.solve(problem, 1.0, method=method)
        model.load_state_dict(start_state)
        peak, loss, grads = measured_step(model, inputs, seed=3, run=core.apply_plan(model, plan))
        assert loss == eager_loss
        assert_same_grads(grads, eager_grads)
        for key, value in model.state_dict().items():  # batch-norm statistics updated once
            torch.testing.assert_close(value, eager_state[key], rtol=0, atol=0)
        assert torch.equal(torch.get_rng_state(), eager_rng)
        assert peak == plan.predicted_peak + SEED_BYTES, method


def test_dropout_replays_on_every_step_of_training():
    """Three optimizer steps with dropout: each step's recompute replays that step's masks."""
    model, inputs = fresh("gpt-tiny")
    twin, _ = fresh("gpt-tiny")
    problem = core.analyze(model, inputs)
    plan = core.solve(problem, 1.0, method="checkpoint_blocks")
    assert plan.recomputed_ops > 0 and any(problem.graph.ops[o].random for k, o in plan.program)
    wrapped = core.apply_plan(twin, plan)
    opt_a = torch.optim.SGD(model.parameters(), lr=0.1)
    opt_b = torch.optim.SGD(twin.parameters(), lr=0.1)
    torch.manual_seed(7)
    for _ in range(3):
        state = torch.get_rng_state()
        opt_a.zero_grad()
        model(*inputs).backward()
        torch.set_rng_state(state)
        opt_b.zero_grad()
        wrapped(*inputs).backward()
        for (n, p), q in zip(model.named_parameters(), twin.parameters(), strict=True):
            torch.testing.assert_close(q.grad, p.grad, msg=n)
        opt_a.step()
        opt_b.step()


def test_gradients_accumulate_like_eager():
    model, inputs = fresh("mlp-tiny")
    plan = core.solve(core.analyze(model, inputs), 1.0, method="sqrt_n")
    wrapped = core.apply_plan(model, plan)
    model(*inputs).backward()
    model(*inputs).backward()
    want = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    wrapped(*inputs).backward()
    wrapped(*inputs).backward()
    for n, p in model.named_parameters():
        torch.testing.assert_close(p.grad, want[n])


@dataclass
class Out:
    main: torch.Tensor
    extra: dict


class _Multi(nn.Module):
    """Two inputs (one needs grad), a dataclass of several outputs, one unused by the loss,
    one integer output, a frozen parameter and an unused one."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(8, 8)
        self.b = nn.Linear(8, 8)
        self.frozen = nn.Linear(8, 8).requires_grad_(False)
        self.unused = nn.Linear(8, 8)

    def forward(self, x, y):
        h = self.a(x).relu()
        g = self.b(h) * y
        return Out(main=self.frozen(g).sum(), extra={"side": h * 2, "ids": g.argmax(-1)})


def test_multiple_inputs_and_structured_outputs():
    torch.manual_seed(0)
    model = _Multi()
    x, y = torch.randn(4, 8), torch.randn(4, 8, requires_grad=True)
    problem = core.analyze(model, (x, y))
    out = model(x, y)
    (out.main + out.extra["side"].sum()).backward()
    want = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    want_y = y.grad.clone()
    model.zero_grad(set_to_none=True)
    y.grad = None
    for method in SIMPLE:
        wrapped = core.apply_plan(model, core.solve(problem, 1.0, method=method))
        got = wrapped(x, y)
        assert isinstance(got, Out) and got.extra["ids"].dtype == torch.int64
        (got.main + got.extra["side"].sum()).backward()
        assert model.unused.weight.grad is None and model.frozen.weight.grad is None
        for n, p in model.named_parameters():
            if p.grad is not None:
                torch.testing.assert_close(p.grad, want[n])
        torch.testing.assert_close(y.grad, want_y)
        model.zero_grad(set_to_none=True)
        y.grad = None
        # an output the loss does not use
        wrapped(x, y).main.backward()
        assert model.a.weight.grad is not None
        model.zero_grad(set_to_none=True)
        y.grad = None


def test_no_grad_runs_the_model_and_eval_with_grad_is_refused():
    model, inputs = fresh("resnet-tiny")
    plan = core.solve(core.analyze(model, inputs), 1.0, method="checkpoint_blocks")
    wrapped = core.apply_plan(model, plan)
    with torch.no_grad():
        torch.testing.assert_close(wrapped(*inputs), model(*inputs))
    wrapped.eval()
    assert not model.training
    smaller = tuple(t[:1] for t in inputs)  # no_grad runs the model itself: any shape works
    with torch.no_grad():
        torch.testing.assert_close(wrapped(*smaller), model(*smaller))
    # eval with gradients on is not the traced training step: refused, never run unplanned
    with pytest.raises(core.PlanMismatch, match="training"):
        wrapped(*inputs)


def test_backward_twice_errors_unless_retain_graph():
    model, inputs = fresh("gpt-tiny")
    wrapped = core.apply_plan(
        model, core.solve(core.analyze(model, inputs), 0.6, "checkpoint_blocks")
    )
    loss = wrapped(*inputs)
    loss.backward()
    with pytest.raises(RuntimeError, match="backward through the graph a second time"):
        loss.backward()
    model.zero_grad()
    torch.manual_seed(0)
    loss = wrapped(*inputs)
    loss.backward(retain_graph=True)
    first = {n: p.grad.clone() for n, p in model.named_parameters()}
    loss.backward()
    for n, p in model.named_parameters():
        torch.testing.assert_close(p.grad, 2 * first[n])


def test_plan_mismatch_says_what_differs():
    model, inputs = fresh("gpt-tiny")
    plan = core.solve(core.analyze(model, inputs), 1.0, "store_all")
    wrapped = core.apply_plan(model, plan)
    with pytest.raises(PlanMismatch, match=r"input 0 is int64\[4, 1, 64\].*int64\[4, 64\]"):
        wrapped(inputs[0][:, None], inputs[1])
    other, _ = fresh("gpt-1layer")
    with pytest.raises(PlanMismatch, match="parameter"):
        core.apply_plan(other, plan)
    double, _ = fresh("gpt-tiny")
    with pytest.raises(PlanMismatch, match="float64"):
        core.apply_plan(double.double(), plan)


class _TinyLM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(50, 16)
        self.head = nn.Linear(16, 50)

    def forward(self, input_ids):
        return self.head(torch.tanh(self.embed(input_ids)))


def _lm_loss(logits, labels):
    return nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten())


def test_one_tensor_passed_as_input_and_as_target_traces_as_two(tmp_path):
    """Causal language models are planned with `targets=(input_ids,)`: one tensor in two
    places. Each place is its own placeholder, so a later call with other labels computes
    eager's loss and gradients (it used to feed one tensor to both), and the plan file loads
    into a new trace of the model (it used to be refused as another model)."""
    torch.manual_seed(0)
    model, ids = _TinyLM(), torch.randint(0, 50, (2, 8))
    problem = core.analyze(model, (), {"input_ids": ids}, _lm_loss, (ids,))
    plan = core.solve(problem, 1.0, "store_all")
    labels = torch.randint(0, 50, (2, 8))
    plan.save(tmp_path / "plan.pkl")
    loaded = core.load_plan(tmp_path / "plan.pkl")
    for run in (core.apply_plan(model, plan), core.apply_plan(model, loaded, _lm_loss)):
        model.zero_grad(set_to_none=True)
        want = _lm_loss(model(input_ids=ids), labels)
        want.backward()
        eager = [p.grad.clone() for p in model.parameters()]
        model.zero_grad(set_to_none=True)
        got = run(input_ids=ids, targets=labels)
        got.backward()
        assert torch.equal(got, want)
        assert all(torch.equal(p.grad, g) for p, g in zip(model.parameters(), eager, strict=True))
