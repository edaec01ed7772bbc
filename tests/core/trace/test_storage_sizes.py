"""What a step really allocates: an op's result can hold a larger storage than its shape needs
(on CPU, `mse_loss`, `smooth_l1_loss`, `binary_cross_entropy` return their 0-dim loss as a view
of an input-sized buffer). The trace asks the real kernel for each storage's size, so a plan's
predicted peak is the run's, + the 4 B seed of loss.backward()."""

import pytest
import torch
import torch.nn.functional as F
from helpers import SEED_BYTES, assert_same_grads, fresh
from torch import nn

import core
from core.memory import StorageTracker, step_tensors
from core.schedule import store_all_plan

# losses over a diffusion U-Net's predicted noise, as diffusers' training scripts compute them
LOSSES = {
    "mse": lambda pred, noise: F.mse_loss(pred, noise),
    "mse_sum": lambda pred, noise: F.mse_loss(pred, noise, reduction="sum"),
    "smooth_l1": lambda pred, noise: F.smooth_l1_loss(pred, noise),
    "bce": lambda pred, noise: F.binary_cross_entropy(torch.sigmoid(pred), torch.sigmoid(noise)),
}
LOSS_OPS = {
    "mse": torch.ops.aten.mse_loss.default,
    "mse_sum": torch.ops.aten.mse_loss.default,
    "smooth_l1": torch.ops.aten.smooth_l1_loss.default,
    "bce": torch.ops.aten.binary_cross_entropy.default,
}


class WithLoss(nn.Module):
    """The U-Net with the loss inside its forward: the same op, traced without a loss_fn."""

    def __init__(self, unet: nn.Module, loss: str) -> None:
        super().__init__()
        self.unet, self.loss = unet, loss

    def forward(self, x: torch.Tensor, t: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
        return LOSSES[self.loss](self.unet(x, t), noise)


def _unet() -> tuple[nn.Module, tuple[torch.Tensor, torch.Tensor], torch.Tensor]:
    model, (x, t, noise) = fresh("unet-tiny")
    return model, (x, t), noise


def _step(model: nn.Module, args: tuple, noise: torch.Tensor, run) -> tuple[int, float, dict]:
    """One step from zero grads and seed 3 under the storage tracker: (peak, loss, grads)."""
    model.zero_grad(set_to_none=True)
    torch.manual_seed(3)
    with StorageTracker(step_tensors(model, (*args, noise))) as tracker:
        loss = run(*args, noise)
        loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return tracker.peak, loss.item(), grads


def _plans(problem: core.Problem) -> list[core.Plan]:
    """Store-all and a plan that recomputes (Rockmate at 70% of the store-all peak)."""
    recompute = core.solve(problem, 0.7, "rockmate")
    assert recompute.recomputed_ops > 0
    assert recompute.predicted_peak < problem.store_all_peak
    return [store_all_plan(problem), recompute]


@pytest.mark.parametrize(
    "loss", [pytest.param(n, marks=pytest.mark.slow) if n == "bce" else n for n in LOSSES]
)
def test_a_loss_fn_runs_at_its_predicted_peak(loss):
    """The loss outside the model (`loss_fn`, as a diffusion training loop calls it)."""
    model, args, noise = _unet()
    loss_fn = LOSSES[loss]
    problem = core.analyze(model, args, loss_fn=loss_fn, targets=(noise,))
    state = {k: v.clone() for k, v in model.state_dict().items()}
    _, eager_loss, eager_grads = _step(
        model, args, noise, lambda *a: loss_fn(model(*a[:-1]), a[-1])
    )
    for plan in _plans(problem):
        model.load_state_dict(state)
        run = core.apply_plan(model, plan, loss_fn=loss_fn)
        peak, got, grads = _step(model, args, noise, lambda *a, r=run: r(*a[:-1], targets=a[-1]))
        assert got == eager_loss
        assert_same_grads(grads, eager_grads)
        assert peak == plan.predicted_peak + SEED_BYTES, plan.method


@pytest.mark.parametrize("loss", ["mse", "bce"])
def test_a_loss_inside_the_model_runs_at_its_predicted_peak(loss):
    unet, args, noise = _unet()
    model = WithLoss(unet, loss)
    problem = core.analyze(model, (*args, noise))
    for plan in _plans(problem):
        run = core.apply_plan(model, plan)
        peak, _, _ = _step(model, args, noise, run)
        assert peak == plan.predicted_peak + SEED_BYTES, plan.method


@pytest.mark.parametrize("loss", LOSSES)
def test_the_trace_counts_the_storage_the_kernel_returns(loss):
    """The loss's storage in the trace is the size the real kernel's result holds (on CPU the
    input's, 6 KiB here, not the 4 B its 0-dim shape needs)."""
    model, args, noise = _unet()
    trace = core.analyze(model, args, loss_fn=LOSSES[loss], targets=(noise,)).graph.trace
    (node,) = [n for n in trace.nodes if n.target == LOSS_OPS[loss]]
    real = LOSSES[loss](model(*args).detach(), noise)
    assert real.dim() == 0
    assert trace.storage_bytes[node.storages[0]] == real.untyped_storage().nbytes()


class DrawsNoise(nn.Module):
    """A diffusion step that draws its noise inside forward (`randn_like`: an op that
    allocates its result and draws from the random stream)."""

    def __init__(self, unet: nn.Module) -> None:
        super().__init__()
        self.unet = unet

    def forward(self, x: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        noise = torch.randn_like(x)
        return F.mse_loss(self.unet(x + noise, t), noise)


def test_analysis_leaves_the_random_stream_alone():
    """Asking the kernels runs random ops too: the caller's random stream must not move, or a
    seeded step after analysis draws other values than the same step without it."""
    unet, args, _ = _unet()
    model = DrawsNoise(unet)
    torch.manual_seed(5)
    before, threads = torch.get_rng_state(), torch.get_num_threads()
    problem = core.analyze(model, args)
    assert torch.equal(torch.get_rng_state(), before)
    assert torch.get_num_threads() == threads
    run = core.apply_plan(model, store_all_plan(problem))
    torch.manual_seed(5)
    want = model(*args).item()
    torch.manual_seed(5)
    assert run(*args).item() == want


def test_the_tracker_counts_no_storage_made_before_the_step():
    """An in-place update of a tensor made before the step (a plan's scratch statistics)
    returns that tensor: the tracker sees its storage for the first time, and it is not an
    allocation of the step."""
    scratch = torch.zeros(1000)
    x = torch.ones(10)
    with StorageTracker([x]) as tracker:
        scratch.add_(1)
        scratch[:10].mul_(2)
        y = x * 2
    assert tracker.peak == y.untyped_storage().nbytes() == 40
