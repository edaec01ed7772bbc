"""The step users run on GPUs: under `torch.autocast`, with the model's own checkpoints on.
Plans must equal eager's step bit for bit (loss, gradients, random stream), with measured
peak = predicted + 4 bytes; a call under another autocast state is refused by name."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import pytest
import torch
from helpers import SEED_BYTES
from torch import nn

import core
from core.memory import StorageTracker, step_tensors
from sample_models import build
from sample_models.hf_zoo import ZooCase, bert, gpt2, llama, qwen2

BF16 = ("cpu", torch.bfloat16)


@pytest.fixture(autouse=True)
def _one_thread() -> Iterator[None]:
    """Bit-identical gradients are held on 1 thread (a kernel's split across threads may
    change the order of a sum)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


class EncoderStack(nn.Module):
    """nn.TransformerEncoderLayer x 2 with dropout, then a mean-pooled linear head."""

    def __init__(self) -> None:
        super().__init__()
        layer = nn.TransformerEncoderLayer(32, 4, 64, dropout=0.1, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
        self.head = nn.Linear(32, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.encoder(x).mean(1))


def encoder_stack() -> ZooCase:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = EncoderStack().train()
        x, y = torch.randn(2, 8, 32), torch.randint(0, 10, (2,))
    return ZooCase(model, (x,), {}, nn.functional.cross_entropy, (y,), 2)


def _sample(name: str) -> ZooCase:
    """A sample model computing its loss inside."""
    model, inputs = build(name)
    return ZooCase(model, inputs, {}, None, (), 2)  # type: ignore[arg-type]


def unet() -> ZooCase:
    """The sample U-Net (with self-attention in its middle)."""
    return _sample("unet-tiny")


CASES: dict[str, Callable[[], ZooCase]] = {
    "hf-gpt2": gpt2,
    "hf-llama": llama,
    "hf-qwen2": qwen2,
    "hf-bert": bert,
    "encoder-stack": encoder_stack,
    "unet-tiny": unet,
    "siamese-tiny": lambda: _sample("siamese-tiny"),
}


@dataclass
class Step:
    peak: int
    loss: torch.Tensor
    grads: dict[str, torch.Tensor]
    rng: torch.Tensor


def _step(case: ZooCase, run: nn.Module | None, autocast: bool) -> Step:
    """One training step from zero grads and seed 3 under a storage tracker, the forward
    under bf16 autocast when asked, `loss.backward()` after it as users write it."""
    model = case.model
    model.zero_grad(set_to_none=True)
    torch.manual_seed(3)
    given = [x for x in (*case.args, *case.kwargs.values(), *case.targets) if torch.is_tensor(x)]
    context = torch.autocast(*BF16) if autocast else contextlib.nullcontext()
    with StorageTracker(step_tensors(model, given)) as tracker:
        with context:
            if run is not None:
                extra = {"targets": case.targets} if case.loss_fn is not None else {}
                loss = run(*case.args, **case.kwargs, **extra)
            else:
                out = model(*case.args, **case.kwargs)
                loss = out if case.loss_fn is None else case.loss_fn(out, *case.targets)
        loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return Step(tracker.peak, loss.detach(), grads, torch.get_rng_state())


def _analyze(case: ZooCase) -> core.Problem:
    return core.analyze(case.model, case.args, case.kwargs, case.loss_fn, case.targets)


def _assert_exact(case: ZooCase, plan: core.Plan, autocast: bool) -> None:
    """`plan`'s step equals eager's bit for bit, from the same state; peak as predicted."""
    start = {k: v.clone() for k, v in case.model.state_dict().items()}
    eager = _step(case, None, autocast)
    case.model.load_state_dict(start)
    run = core.apply_plan(case.model, plan)
    got = _step(case, run, autocast)
    assert torch.equal(got.loss, eager.loss) and got.loss.dtype == eager.loss.dtype
    assert got.grads.keys() == eager.grads.keys()
    for name, want in eager.grads.items():
        assert torch.equal(got.grads[name], want), name
    assert torch.equal(got.rng, eager.rng)
    assert got.peak == plan.predicted_peak + SEED_BYTES


def _recomputing(problem: core.Problem) -> core.Plan:
    """A plan that recomputes: Rockmate's at a budget halfway between checkpointing every
    block and store-all, or checkpointing every block where Rockmate's keeps everything."""
    blocks = core.solve(problem, 1.0, method="checkpoint_blocks")
    plan = core.solve(problem, (problem.store_all_peak + blocks.predicted_peak) // 2)
    if plan.recomputed_ops == 0:
        plan = blocks
    assert plan.recomputed_ops > 0
    return plan


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(CASES))
def test_autocast_plans_are_exact(name: str) -> None:
    case = CASES[name]()
    with torch.autocast(*BF16):
        problem = _analyze(case)
    casts = [n for n in problem.graph.trace.nodes if n.label == "aten._to_copy"]
    assert casts, "autocast's casts are ops of the traced step"
    plan = _recomputing(problem)
    _assert_exact(case, plan, autocast=True)


def test_a_plan_refuses_a_call_under_another_autocast_state(tmp_path) -> None:
    case = encoder_stack()
    fp32 = core.solve(_analyze(case), 1.0)
    run = core.apply_plan(case.model, fp32)
    with torch.autocast(*BF16), pytest.raises(core.PlanMismatch, match="autocast"):
        run(*case.args, targets=case.targets)
    with torch.autocast(*BF16):
        bf16 = core.solve(_analyze(case), 1.0)
    run = core.apply_plan(case.model, bf16)
    with pytest.raises(core.PlanMismatch, match=r"autocast off.*autocast\(cpu, bfloat16\)"):
        run(*case.args, targets=case.targets)
    # the plan file records the state: loaded outside autocast, it is bound under its own
    bf16.save(tmp_path / "bf16.pkl")
    loaded = core.apply_plan(
        case.model, core.load_plan(tmp_path / "bf16.pkl"), loss_fn=case.loss_fn
    )
    assert loaded.plan.fingerprint == bf16.fingerprint
    with torch.autocast(*BF16):
        loaded(*case.args, targets=case.targets).backward()


def test_fp16_with_grad_scaler_goes_through_the_plan() -> None:
    """fp16 autocast on CPU with torch.amp.GradScaler: the scaled loss's backward runs the
    plan and its gradients equal eager's, scaled the same way."""
    case = encoder_stack()
    fp16 = ("cpu", torch.float16)
    with torch.autocast(*fp16):
        problem = _analyze(case)
    plan = _recomputing(problem)
    start = {k: v.clone() for k, v in case.model.state_dict().items()}
    grads = []
    for run in (case.model, core.apply_plan(case.model, plan)):
        case.model.load_state_dict(start)
        case.model.zero_grad(set_to_none=True)
        torch.manual_seed(3)
        scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
        with torch.autocast(*fp16):
            if run is case.model:
                loss = case.loss_fn(run(*case.args), *case.targets)
            else:
                loss = run(*case.args, targets=case.targets)
        scaler.scale(loss).backward()
        grads.append({n: p.grad.clone() for n, p in case.model.named_parameters()})
    for name, want in grads[0].items():
        assert torch.equal(grads[1][name], want), name


CHECKPOINTED: dict[str, Callable[[], ZooCase]] = {
    "hf-gpt2": gpt2,
    "hf-llama": llama,
    "hf-qwen2": qwen2,
}


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(CHECKPOINTED))
def test_models_that_checkpoint_themselves_plan_one_block_per_layer(name: str) -> None:
    """transformers' gradient_checkpointing_enable() (non-reentrant): its checkpoints are
    traced as plain forward ops, so the chain has a block per layer, and the plan, which
    replaces them, equals the checkpointed eager step with dropout on."""
    case = CHECKPOINTED[name]()
    for module in case.model.modules():
        if isinstance(module, nn.Dropout):
            module.p = 0.1
    case.model.gradient_checkpointing_enable()
    problem = _analyze(case)
    assert len(problem.blocks) >= case.layers
    plan = _recomputing(problem)
    _assert_exact(case, plan, autocast=False)


def test_a_checkpointed_dropout_block_plans_exactly() -> None:
    """The issue's minimal case: checkpoint(Linear -> Dropout(0.5) -> Linear)."""

    class Checkpointed(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.body = nn.Sequential(nn.Linear(16, 32), nn.Dropout(0.5), nn.Linear(32, 16))
            self.head = nn.Linear(16, 1)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            y = torch.utils.checkpoint.checkpoint(self.body, x, use_reentrant=False)
            return self.head(torch.relu(y)).square().mean()

    torch.manual_seed(0)
    case = ZooCase(Checkpointed(), (torch.randn(8, 16),), {}, None, (), 1)  # type: ignore[arg-type]
    problem = _analyze(case)
    _assert_exact(case, core.solve(problem, 1.0), autocast=False)


def test_a_weight_used_twice_is_cast_once_as_eager_does() -> None:
    """A shared tower: eager's autocast caches the bf16 copy of each weight, so its two
    gradients are summed in bf16 before the cast back; the trace must do the same (make_fx
    turns the cache off; summing in fp32 gave gradients off by 2.4e-4)."""
    case = _sample("siamese-tiny")
    with torch.autocast(*BF16):
        problem = _analyze(case)
    weight = problem.graph.trace.param_names.index("tower_a.layers.0.fc1.weight")
    casts = [
        n for n in problem.graph.trace.nodes if n.label == "aten._to_copy" and n.reads == (weight,)
    ]
    assert len(casts) == 1
    start = {k: v.clone() for k, v in case.model.state_dict().items()}
    eager = _step(case, None, autocast=True)
    case.model.load_state_dict(start)
    got = _step(case, core.apply_plan(case.model, _recomputing(problem)), True)
    assert torch.equal(got.loss, eager.loss)
    for name, want in eager.grads.items():
        assert torch.equal(got.grads[name], want), name
