"""The chunked LM-head loss (`analyze(..., loss_head=...)`): it lowers the floor, plans on it
run exactly (against the eager chunked step) with measured = predicted + 4 B, and its numbers
keep the contract of docs/floor.md against the plain step."""

import contextlib

import pytest
import torch
import torch.nn.functional as F
from helpers import SEED_BYTES, measured_step
from torch import nn

import core
from core.errors import UnsupportedModel
from core.trace.loss_head import LossHead, LossHeadMode, chunked_head
from sample_models.gpt import GPT, GPTConfig


def tiny_gpt(seed: int = 0) -> tuple[nn.Module, tuple[torch.Tensor, torch.Tensor]]:
    """A GPT whose head dominates: vocabulary 600, width 32, 3 x 64 tokens, dropout on."""
    torch.manual_seed(seed)
    cfg = GPTConfig(block_size=64, vocab_size=600, n_layer=1, n_head=2, n_embd=32, dropout=0.1)
    model = GPT(cfg)
    idx, targets = torch.randint(0, 600, (3, 64)), torch.randint(0, 600, (3, 64))
    targets[0, :5] = -100  # some ignored rows: the mean divides by the rows counted
    return model, (idx, targets)


def eager_step(model: nn.Module, inputs: tuple, head: LossHead | None, seed: int = 3):
    """One eager step, the LM head as `head` says (None: the model as written)."""
    model.zero_grad(set_to_none=True)
    torch.manual_seed(seed)
    with chunked_head(head) if head is not None else contextlib.nullcontext():
        loss = model(*inputs)
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.fixture(scope="module")
def gpt():
    """The tiny GPT, its inputs, and its step analysed plain and chunked."""
    model, inputs = tiny_gpt()
    plain = core.analyze(model, inputs)
    return model, inputs, plain, core.analyze(model, inputs, loss_head="chunked")


def test_chunked_head_goes_below_the_plain_floor_and_runs_exactly(gpt):
    model, inputs, plain, chunked = gpt
    assert plain.floor.label == "aten._log_softmax_backward_data"
    assert chunked.floor.nbytes < plain.floor.nbytes / 2
    assert chunked.store_all_peak < plain.store_all_peak
    assert chunked.loss_head == LossHead("chunked")
    budget = plain.floor.nbytes - 1  # below every plan of the plain step (Problem.floor)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    want_loss, want = eager_step(model, inputs, LossHead("chunked"))
    for method, b in (("store_all", 1.0), ("checkpoint_blocks", 1.0), ("rockmate", budget)):
        plan = core.solve(chunked, b, method=method)
        model.load_state_dict(state)
        peak, loss, grads = measured_step(model, inputs, seed=3, run=core.apply_plan(model, plan))
        assert peak == plan.predicted_peak + SEED_BYTES, method
        assert loss == want_loss.item()
        for name, g in want.items():  # bit-identical to the eager chunked step
            assert torch.equal(grads[name], g), (method, name)


def test_chunked_numbers_against_the_plain_step():
    """The contract of docs/floor.md: below the head every gradient is bit-identical; the
    head's weight gradient and the loss differ by summation order only."""
    model, inputs = tiny_gpt()
    plain_loss, plain = eager_step(model, inputs, None)
    for rows in (64, 48):
        loss, grads = eager_step(model, inputs, LossHead("chunked", rows))
        assert (loss - plain_loss).abs().item() <= 1e-6
        for name, g in plain.items():
            if name == "lm_head.weight":
                assert (grads[name] - g).abs().max().item() <= 2e-6 * g.abs().max().item()
            else:
                assert torch.equal(grads[name], g), (rows, name)


def test_auto_chunks_a_head_and_leaves_other_models_alone(gpt):
    model, inputs, _, chunked = gpt
    auto = core.analyze(model, inputs, loss_head="auto")
    assert auto.loss_head == LossHead("chunked") and auto.fingerprint == chunked.fingerprint
    mlp = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    x = torch.randn(32, 8)
    plain = core.analyze(mlp, (x,))
    auto = core.analyze(mlp, (x,), loss_head="auto")
    assert auto.loss_head == LossHead() and auto.fingerprint == plain.fingerprint
    with pytest.raises(UnsupportedModel, match="no LM-head loss"):
        core.analyze(mlp, (x,), loss_head="chunked")
    with pytest.raises(ValueError, match="unknown loss_head"):
        core.analyze(mlp, (x,), loss_head="fast")


class LogitsToo(nn.Module):
    """Returns the logits beside the loss: the head's output feeds more than the loss."""

    def __init__(self) -> None:
        super().__init__()
        self.body, self.head = nn.Linear(16, 16), nn.Linear(16, 300, bias=True)

    def forward(self, x, y):
        logits = self.head(torch.tanh(self.body(x)))
        return F.cross_entropy(logits, y), logits


def test_logits_used_beyond_the_loss_are_not_chunked():
    torch.manual_seed(0)
    model, x, y = LogitsToo(), torch.randn(256, 16), torch.randint(0, 300, (256,))
    with pytest.raises(UnsupportedModel, match="logits are used beyond the loss"):
        core.analyze(model, (x, y), loss_head="chunked")
    auto = core.analyze(model, (x, y), loss_head="auto")
    assert auto.loss_head == LossHead()
    assert auto.fingerprint == core.analyze(model, (x, y)).fingerprint
    # with a loss_fn keeping the logits out, the head is chunked, bias included
    chunked = core.analyze(
        model, (x, y), loss_fn=lambda out: out[0], loss_head=LossHead("chunked", 64)
    )
    assert chunked.loss_head == LossHead("chunked", 64)
    plan = core.solve(chunked, 1.0, method="store_all")
    run = core.apply_plan(model, plan)
    model.zero_grad(set_to_none=True)
    peak, loss, grads = measured_step(model, (x, y), run=run)
    assert peak == plan.predicted_peak + SEED_BYTES
    with chunked_head(LossHead("chunked", 64)):
        want = model(x, y)[0]
    model.zero_grad(set_to_none=True)
    want.backward()
    assert loss == want.item()
    for n, p in model.named_parameters():
        assert torch.equal(grads[n], p.grad), n


class FusedHead(nn.Module):
    """Calls F.linear_cross_entropy itself, with torch's chunking options."""

    def __init__(self) -> None:
        super().__init__()
        self.body, self.head = nn.Linear(16, 16), nn.Linear(16, 300, bias=False)

    def forward(self, x, y):
        h = torch.tanh(self.body(x))
        options = torch.nn.LinearCrossEntropyOptions(batch_chunk_size=64)
        return F.linear_cross_entropy(h, self.head.weight, y, options=options)


@pytest.mark.parametrize("kind", ["plain", "chunked"])
def test_models_calling_linear_cross_entropy_are_planned(kind):
    torch.manual_seed(0)
    model, x, y = FusedHead(), torch.randn(256, 16), torch.randint(0, 300, (256,))
    problem = core.analyze(model, (x, y), loss_head=kind)
    labels = {op.label for op in problem.graph.ops}
    assert "aten.nll_loss_forward" in labels and all(lb.startswith("aten.") for lb in labels)
    plan = core.solve(problem, 1.0, method="checkpoint_blocks")
    peak, loss, grads = measured_step(model, (x, y), run=core.apply_plan(model, plan))
    assert peak == plan.predicted_peak + SEED_BYTES
    head = LossHead("chunked") if kind == "chunked" else LossHead()
    want_loss, want = eager_step(model, (x, y), head, seed=1)
    assert loss == want_loss.item()
    for n, g in want.items():
        assert torch.equal(grads[n], g), n
    torch_loss, torch_grads = eager_step(model, (x, y), None, seed=1)  # torch's own chunked op
    assert (torch_loss - want_loss).abs().item() <= 1e-6
    for n, g in torch_grads.items():
        torch.testing.assert_close(want[n], g, rtol=1e-5, atol=1e-7)


def test_a_saved_chunked_plan_binds_to_a_fresh_model(gpt, tmp_path):
    model, inputs, _, chunked = gpt
    plan = core.solve(chunked, 1.0, method="checkpoint_blocks")
    plan.save(tmp_path / "plan.pkl")
    twin, _ = tiny_gpt()
    run = core.apply_plan(twin, core.load_plan(tmp_path / "plan.pkl"))
    assert run.plan.problem.loss_head == LossHead("chunked")
    peak, loss, grads = measured_step(twin, inputs, run=run)
    assert peak == plan.predicted_peak + SEED_BYTES
    want_loss, want = eager_step(model, inputs, LossHead("chunked"), seed=1)
    assert loss == want_loss.item()


def test_the_mode_passes_other_code_through():
    x = torch.randn(4, 8)
    with LossHeadMode(LossHead("chunked")) as mode:
        y = F.linear(x, torch.randn(5, 8)).view(2, 2, 5).sum()
    assert mode.found == [] and y.dim() == 0
    with pytest.raises(ValueError, match="positive int"):
        LossHead("chunked", 0)


def _hf_llama(vocab: int = 512) -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=vocab,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=4,
    )
    return LlamaForCausalLM(cfg).train()


def test_a_head_left_plain_is_refused_naming_why():
    """The issue's two cases: a bf16 model whose loss upcasts the logits, and a batch whose
    rows fit one chunk. Each refusal names its reason, not 'no LM-head loss'."""
    model = _hf_llama()
    ids, y = torch.randint(0, 512, (2, 32)), torch.randint(0, 512, (2, 32))

    def loss(out, y):
        return F.cross_entropy(out.logits.flatten(0, 1), y.flatten())

    def upcast(out, y):
        return F.cross_entropy(out.logits.float().flatten(0, 1), y.flatten())

    kw = {"use_cache": False}
    with pytest.raises(core.UnsupportedModel, match=r"64 rows, which fit in one chunk of 64"):
        core.analyze(model, (ids,), kw, loss_fn=loss, targets=(y,), loss_head="chunked")
    model = model.to(torch.bfloat16)
    ids, y = torch.randint(0, 512, (2, 64)), torch.randint(0, 512, (2, 64))
    with pytest.raises(core.UnsupportedModel, match=r"cast from bfloat16 to float32 between"):
        core.analyze(model, (ids,), kw, loss_fn=upcast, targets=(y,), loss_head="chunked")
    plain = core.analyze(model, (ids,), kw, loss_fn=upcast, targets=(y,), loss_head="auto")
    assert plain.loss_head.kind == "plain"
