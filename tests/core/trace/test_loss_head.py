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
from core.memory import StorageTracker, step_tensors
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


def _hf_llama(vocab: int = 512, layers: int = 1) -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=vocab,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=4,
    )
    return LlamaForCausalLM(cfg).train()


def upcast_loss(out, y):
    """The loss outside the model, as bf16 recipes write it: the logits upcast to fp32."""
    return F.cross_entropy(out.logits.float().flatten(0, 1), y.flatten())


def bf16_loss(out, y):
    """The loss outside the model on the logits as they come (bf16 in a bf16 model)."""
    return F.cross_entropy(out.logits.flatten(0, 1), y.flatten())


def hf_call(model: nn.Module, loss: str, vocab: int, tokens: int = 128) -> tuple:
    """(args, kwargs, loss_fn, targets) of a step on 2 x `tokens` tokens: the loss outside
    (`upcast_loss`; "as-is": `bf16_loss`, which autocast upcasts) or Hugging Face's own
    (`labels=`, `loss_fn=lambda out: out.loss`)."""
    g = torch.Generator().manual_seed(1)
    ids, y = (torch.randint(0, vocab, (2, tokens), generator=g) for _ in range(2))
    if loss in ("outside", "as-is"):
        return (ids,), {"use_cache": False}, upcast_loss if loss == "outside" else bf16_loss, (y,)
    return (ids,), {"use_cache": False, "labels": ids}, lambda out: out.loss, ()


@pytest.fixture
def one_thread():
    """Bit-identity below the head is held on 1 thread, as in test_mixed_precision.py."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


BF16 = {  # how the head runs in bf16: under autocast (fp32 weights), or a bf16 model
    "autocast": (torch.float32, lambda: torch.autocast("cpu", torch.bfloat16)),
    "bf16-model": (torch.bfloat16, contextlib.nullcontext),
}


def bf16_step(model: nn.Module, call: tuple, precision: str, head: LossHead | None):
    """One eager step as `precision` runs it (the backward after the autocast block),
    the LM head as `head` says: (loss, grads, the mode's heads)."""
    args, kwargs, loss_fn, targets = call
    model.zero_grad(set_to_none=True)
    with BF16[precision][1](), chunked_head(head or LossHead()) as mode:
        loss = loss_fn(model(*args, **kwargs), *targets)
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}, mode.found


def planned_step(model: nn.Module, call: tuple, precision: str, plan: core.Plan):
    """One step of `plan` applied to `model`, as `precision` runs it, under a storage
    tracker: (peak bytes, loss, grads)."""
    args, kwargs, _, targets = call
    model.zero_grad(set_to_none=True)
    given = [t for t in (*args, *kwargs.values(), *targets) if torch.is_tensor(t)]
    run = core.apply_plan(model, plan)
    with StorageTracker(step_tensors(model, given)) as tracker:
        with BF16[precision][1]():
            loss = run(*args, **kwargs, **({"targets": targets} if targets else {}))
        loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return tracker.peak, loss.detach(), grads


def assert_chunked_contract(got: tuple, plain: tuple) -> None:
    """docs/floor.md's contract on a bf16 head whose loss runs in fp32, (loss, grads) of the
    chunked step against the plain step's: every gradient below the head bit-identical; the
    head's weight (and bias) gradient one rounding apart; the loss summation order apart."""
    assert (got[0] - plain[0]).abs().item() <= 1e-6
    for name, g in plain[1].items():
        assert got[1][name].dtype == g.dtype
        if name in ("lm_head.weight", "head.weight", "head.bias"):
            assert_one_rounding_apart(got[1][name], g)
        else:
            assert torch.equal(got[1][name], g), name


def assert_one_rounding_apart(got: torch.Tensor, want: torch.Tensor) -> None:
    """The bf16 contract for a gradient summed in fp32 and rounded once to bf16 (docs/floor.md):
    the two fp32 sums differ by summation order (the fp32 contract's bound, 2e-6 of the largest
    entry), then each rounds to bf16 (one bf16 ulp of the entry), so an entry differs only
    where its sums straddle a rounding boundary: few do."""
    got, want = got.float(), want.float()
    big = torch.maximum(got.abs(), want.abs())
    ulp = torch.ldexp(torch.ones_like(big), torch.frexp(big).exponent - 8)  # bf16: 8 bits
    diff = (got - want).abs()
    over = (diff - ulp).max().item() / want.abs().max().item()
    assert over <= 2e-6, f"{over:.3g} of the largest entry over one bf16 ulp"
    assert (diff > 0).sum().item() <= 1e-3 * diff.numel(), f"{(diff > 0).sum().item()} differ"


def test_the_bf16_bound_tells_summation_order_from_rounding():
    """The bound above fails a weight gradient rounded to bf16 chunk by chunk (eager's single
    bf16 matmul against four), and holds for the chunked head's fp32 sum rounded once."""
    torch.manual_seed(0)
    x, g = torch.randn(256, 64).bfloat16(), (torch.randn(256, 1024) * 1e-3).bfloat16()
    want = torch.mm(x.t(), g)
    chunks = [(x[i : i + 64].t(), g[i : i + 64]) for i in range(0, 256, 64)]
    rounded = sum(torch.mm(a, b) for a, b in chunks)
    once = sum(torch.mm(a.float(), b.float()) for a, b in chunks).bfloat16()
    with pytest.raises(AssertionError, match="over one bf16 ulp"):
        assert_one_rounding_apart(rounded, want)
    assert_one_rounding_apart(once, want)


class BiasHead(nn.Module):
    """A head with a bias, its logits upcast before the loss."""

    def __init__(self) -> None:
        super().__init__()
        self.body, self.head = nn.Linear(16, 16), nn.Linear(16, 300, bias=True)

    def forward(self, x, y):
        return F.cross_entropy(self.head(torch.tanh(self.body(x))).float(), y)


@pytest.mark.parametrize(
    "precision, loss",
    [(p, loss) for p in sorted(BF16) for loss in ("outside", "inside", "bias")]
    + [("autocast", "as-is")],
)
def test_a_bf16_head_chunked_keeps_the_contract(precision, loss, one_thread):
    """docs/floor.md's contract, with 64 and 48 rows per chunk (`assert_chunked_contract`)."""
    dtype = BF16[precision][0]
    if loss == "bias":
        torch.manual_seed(0)
        model: nn.Module = BiasHead().to(dtype)
        call: tuple = ((torch.randn(256, 16, dtype=dtype), torch.randint(0, 300, (256,))), {})
        call += (lambda out: out, ())
    else:
        model = _hf_llama().to(dtype)
        call = hf_call(model, loss, 512)
    plain_loss, plain, _ = bf16_step(model, call, precision, None)
    for rows in (64, 48):
        got_loss, got, found = bf16_step(model, call, precision, LossHead("chunked", rows))
        assert [h.chunk_rows for h in found] == [rows]
        assert all(g.dtype == dtype for g in got.values())
        assert_chunked_contract((got_loss, got), (plain_loss, plain))


@pytest.mark.parametrize("precision, loss", [("autocast", "outside"), ("bf16-model", "inside")])
def test_bf16_chunked_plans_equal_the_eager_chunked_step(precision, loss, one_thread):
    """Plans of the chunked bf16 step, recomputing or not, equal `chunked_head()`'s eager
    step under the same precision bit for bit, at measured = predicted + 4 B."""
    dtype, context = BF16[precision]
    model = _hf_llama().to(dtype)
    call = hf_call(model, loss, 512)
    with context():
        chunked = core.analyze(model, *call, loss_head="chunked")
    labels = [op.label for op in chunked.graph.ops]
    assert labels.count("aten.nll_loss_forward") == 4  # 256 rows in chunks of 64
    assert chunked.floor.label != "aten._log_softmax_backward_data"
    want_loss, want, _ = bf16_step(model, call, precision, LossHead("chunked"))
    for method in ("store_all", "checkpoint_blocks"):
        plan = core.solve(chunked, 1.0, method=method)
        assert (plan.recomputed_ops > 0) == (method == "checkpoint_blocks")
        peak, got_loss, grads = planned_step(model, call, precision, plan)
        assert peak == plan.predicted_peak + SEED_BYTES, method
        assert torch.equal(got_loss, want_loss)
        for name, g in want.items():
            assert torch.equal(grads[name], g), (method, name)


@pytest.mark.slow
def test_the_chunked_head_lowers_a_bf16_llamas_floor(one_thread):
    """The issue's must-show: a bf16 HF Llama (hidden 64, 4 heads, 2 layers, vocabulary
    32,000) at 2 x 128 tokens, loss outside with the upcast under autocast, and `labels=`
    inside a bf16 model: the floor falls 4x (docs/floor.md), the chunked step keeps the
    contract, and a plan at a budget below the plain step's floor runs, equal to the eager
    chunked step."""
    for precision, loss in (("autocast", "outside"), ("bf16-model", "inside")):
        dtype, context = BF16[precision]
        model = _hf_llama(32_000, layers=2).to(dtype)
        call = hf_call(model, loss, 32_000)
        with context():
            plain = core.analyze(model, *call)
            chunked = core.analyze(model, *call, loss_head="chunked")
        assert plain.floor.label == "aten._log_softmax_backward_data"
        assert chunked.floor.nbytes * 3.9 < plain.floor.nbytes, (precision, loss)
        plan = core.solve(chunked, plain.floor.nbytes - 1)
        want = bf16_step(model, call, precision, LossHead("chunked"))
        assert_chunked_contract(want[:2], bf16_step(model, call, precision, None)[:2])
        peak, got_loss, grads = planned_step(model, call, precision, plan)
        assert peak == plan.predicted_peak + SEED_BYTES < plain.floor.nbytes
        assert torch.equal(got_loss, want[0])
        for name, g in want[1].items():
            assert torch.equal(grads[name], g), name


def test_a_head_left_plain_is_refused_naming_why():
    """Each refusal names its reason, not 'no LM-head loss': a batch whose rows fit one
    chunk, a bf16 loss (no upcast); 'auto' keeps such a step plain."""
    model = _hf_llama()
    kw = {"use_cache": False}
    ids, y = torch.randint(0, 512, (2, 32)), torch.randint(0, 512, (2, 32))
    with pytest.raises(core.UnsupportedModel, match=r"64 rows, which fit in one chunk of 64"):
        core.analyze(model, (ids,), kw, loss_fn=bf16_loss, targets=(y,), loss_head="chunked")
    model = model.to(torch.bfloat16)
    ids, y = torch.randint(0, 512, (2, 64)), torch.randint(0, 512, (2, 64))
    with pytest.raises(core.UnsupportedModel, match=r"the loss runs in bfloat16: each chunk"):
        core.analyze(model, (ids,), kw, loss_fn=bf16_loss, targets=(y,), loss_head="chunked")
    plain = core.analyze(model, (ids,), kw, loss_fn=bf16_loss, targets=(y,), loss_head="auto")
    assert plain.loss_head.kind == "plain"


def downcast_loss(out, y):
    """The fp32 logits through bf16 and back: a cast the chunked head does not make."""
    return F.cross_entropy(out.logits.bfloat16().float().flatten(0, 1), y.flatten())


@pytest.mark.parametrize(
    "autocast, loss_fn, why",
    [
        (None, downcast_loss, "cast from float32 to bfloat16 between the head and the loss"),
        (torch.float16, upcast_loss, "cast from float16 to float32 between the head"),
        (torch.float16, bf16_loss, "matmul runs in float16 and its loss in float32"),
    ],
    ids=["downcast", "fp16-upcast", "fp16-autocast"],
)
def test_heads_in_other_dtypes_are_left_plain_naming_why(autocast, loss_fn, why):
    """Casts and dtypes the contract is not kept for (only fp32 throughout, or a bf16 head
    with an fp32 loss): the mode leaves the loss plain and says why."""
    model = _hf_llama()
    ids, y = torch.randint(0, 512, (2, 64)), torch.randint(0, 512, (2, 64))
    on = torch.autocast("cpu", autocast) if autocast else contextlib.nullcontext()
    with on, LossHeadMode(LossHead("chunked")) as mode:
        loss_fn(model(ids, use_cache=False), y)
    assert mode.found == [] and len(mode.refused) == 1 and why in mode.refused[0]
