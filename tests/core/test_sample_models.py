import math

import pytest
import torch
from helpers import measured_step

import core
import sample_models
from core.frontier import minimum_budget
from sample_models import REGISTRY, SMALL, build, describe, names

BIG = {"gpt2-small", "resnet50", "vit-small", "regnet-small", "mlp"}
FAST = [n for n in names() if n not in BIG]


@pytest.mark.parametrize("name", FAST)
def test_one_training_step(name):
    model, inputs = build(name)
    assert model.training
    assert all(p.dtype == torch.float32 for p in model.parameters())

    loss = model(*inputs)
    assert loss.dim() == 0
    assert torch.isfinite(loss)
    loss.backward()

    for pname, p in model.named_parameters():
        if p.requires_grad:
            assert p.grad is not None, pname
            assert torch.isfinite(p.grad).all(), pname


@pytest.mark.parametrize("name", SMALL)
def test_logits_without_targets(name):
    model, inputs = build(name)
    with torch.no_grad():
        logits = model(inputs[0])
    assert logits.dim() >= 2
    assert logits.shape[0] == inputs[0].shape[0]


def test_build_is_deterministic_and_leaves_global_rng_alone():
    torch.manual_seed(123)
    expected = torch.rand(3)
    torch.manual_seed(123)
    m1, in1 = build("gpt-tiny")
    m2, in2 = build("gpt-tiny")
    assert torch.equal(torch.rand(3), expected)
    for a, b in zip(in1, in2, strict=True):
        assert torch.equal(a, b)
    for (n1, p1), (n2, p2) in zip(m1.named_parameters(), m2.named_parameters(), strict=True):
        assert n1 == n2 and torch.equal(p1, p2)


def test_big_presets_on_meta_device():
    counts = {}
    for name in sorted(BIG):
        with torch.device("meta"):
            model = REGISTRY[name].make_model()
        assert all(p.is_meta for p in model.parameters())
        counts[name] = sum(p.numel() for p in model.parameters())
    assert 120e6 <= counts["gpt2-small"] <= 130e6
    assert 20e6 <= counts["resnet50"] <= 30e6


def test_registry_listing():
    assert names() == list(REGISTRY)
    assert set(SMALL) <= set(REGISTRY)
    assert BIG <= set(REGISTRY)
    families = {type(REGISTRY[n]).__name__ + REGISTRY[n].model_cls.__name__ for n in SMALL}
    assert len(families) == len(SMALL)
    for name in names():
        text = describe(name)
        assert text and "\n" not in text


def test_unknown_name_lists_valid_names():
    with pytest.raises(KeyError) as excinfo:
        build("nope")
    message = str(excinfo.value)
    assert "nope" in message
    for name in names():
        assert name in message
    with pytest.raises(KeyError):
        describe("nope")


def test_gpt_loss_near_uniform_at_init():
    model, inputs = build("gpt-1layer")
    loss = model(*inputs)
    vocab = sample_models.REGISTRY["gpt-1layer"].config.vocab_size
    assert abs(loss.item() - math.log(vocab)) < 0.5


JOINS = ["unet-tiny", "two-tower-tiny", "siamese-tiny"]  # graphs that are not chains


@pytest.mark.parametrize("name", JOINS)
def test_join_models_plan_and_run_exactly(name):
    """Skips, two towers, a shared tower: Rockmate's plans at 80% and at its minimum run with
    eager's loss, gradients and batch-norm statistics, and the peak the simulator predicted
    (+4 bytes: the scalar seed of loss.backward())."""
    model, inputs = build(name)
    problem = core.analyze(model, inputs)
    assert all(type(p) is torch.nn.Parameter for p in model.parameters())  # not left fake
    start = {k: v.clone() for k, v in model.state_dict().items()}
    _, eager_loss, eager_grads = measured_step(model, inputs, seed=3)
    eager_state = {k: v.clone() for k, v in model.state_dict().items()}
    assert any(not torch.equal(v, start[k]) for k, v in eager_state.items()) == ("unet" in name)
    lowest = minimum_budget(problem, "rockmate")
    for budget in (max(int(0.8 * problem.store_all_peak), lowest), lowest):
        plan = core.solve(problem, budget, "rockmate")
        model.load_state_dict(start)
        run = core.apply_plan(model, plan)
        peak, loss, grads = measured_step(model, inputs, seed=3, run=run)
        assert peak == plan.predicted_peak + 4
        assert loss == eager_loss
        assert grads.keys() == eager_grads.keys()
        for key, grad in grads.items():
            torch.testing.assert_close(grad, eager_grads[key], rtol=0, atol=0, msg=key)
        for key, value in model.state_dict().items():
            torch.testing.assert_close(value, eager_state[key], rtol=0, atol=0, msg=key)
