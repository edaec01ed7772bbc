"""The step a device runs: a trace for a GPU preset holds the attention kernel torch's
dispatcher picks there (core.trace.attention), with the outputs torch's meta kernels give and
no s x s tensor; a trace for CPU holds what CPU eager dispatches; GPU storages are counted as
the CUDA caching allocator rounds them, CPU's exactly."""

from __future__ import annotations

import copy
import math

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

import core
from core.trace import fingerprint
from core.trace.autocast import Autocast
from core.trace.device import DeviceModel
from core.trace.nodes import Trace
from sample_models.hf_zoo import llama as zoo_llama

SEQ, BATCH, LAYERS = 24, 2, 2  # SEQ: no other dimension of these models has this size
FLASH = "aten._scaled_dot_product_flash_attention"
EFFICIENT = "aten._scaled_dot_product_efficient_attention"
CUDNN = "aten._scaled_dot_product_cudnn_attention"
CPU_FLASH = "aten._scaled_dot_product_flash_attention_for_cpu"


def _llama(kv_heads: int = 4, dtype: torch.dtype = torch.float32) -> nn.Module:
    cfg = LlamaConfig(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=LAYERS,
        num_attention_heads=4,
        num_key_value_heads=kv_heads,
        max_position_embeddings=64,
    )
    torch.manual_seed(0)
    return LlamaForCausalLM(cfg).to(dtype).train()


def _gpt2(dtype: torch.dtype = torch.float32) -> nn.Module:
    cfg = GPT2Config(vocab_size=128, n_positions=64, n_embd=64, n_layer=LAYERS, n_head=4)
    torch.manual_seed(0)
    return GPT2LMHeadModel(cfg).to(dtype).train()  # attention and residual dropout 0.1


MODELS = {"llama": _llama, "gpt2": _gpt2}


def _ids() -> torch.Tensor:
    return torch.randint(0, 128, (BATCH, SEQ), generator=torch.Generator().manual_seed(0))


def _analyze(model: nn.Module, **options) -> core.Problem:
    ids = _ids() if next(model.parameters()).device.type != "meta" else _ids().to("meta")
    return core.analyze(model, (ids,), {"labels": ids}, lambda out: out.loss, **options)


def _labels(trace: Trace, prefix: str) -> list[str]:
    return [n.label for n in trace.nodes if n.label.startswith(prefix)]


def _no_square(trace: Trace) -> None:
    squares = [
        (n.label, str(s))
        for n in trace.nodes
        for s in n.specs
        if len(s.shape) >= 2 and s.shape[-2:] == (SEQ, SEQ)
    ]
    assert not squares, f"s x s tensors in the trace: {squares[:4]}"


def _meta_sizes_hold(trace: Trace, label: str) -> int:
    """Each `label` node's results are what torch's meta kernel returns for its inputs;
    returns how many were checked."""
    checked = 0
    for node in trace.nodes:
        if node.label != label:
            continue

        def meta(arg):
            if hasattr(arg, "index"):
                src = trace.nodes[arg.index]
                spec, stride = src.specs[0], src.strides[0]
                return torch.empty_strided(
                    spec.shape, stride, dtype=getattr(torch, spec.dtype), device="meta"
                )
            return arg

        args = torch.utils._pytree.tree_map(meta, node.args)
        kwargs = torch.utils._pytree.tree_map(meta, node.kwargs)
        out = node.target(*args, **kwargs)
        mine = [(tuple(t.shape), t.dtype) for t in out if isinstance(t, torch.Tensor)]
        assert [(s.shape, getattr(torch, s.dtype)) for s in node.specs] == mine
        checked += 1
    return checked


@pytest.mark.parametrize("device", ["h100", "a100"])
@pytest.mark.parametrize(
    "dtype, kernel", [(torch.bfloat16, FLASH), (torch.float32, EFFICIENT)], ids=["bf16", "fp32"]
)
@pytest.mark.parametrize("name", ["llama", "gpt2"])
def test_a_gpu_trace_holds_the_fused_kernel_torch_picks(name, dtype, kernel, device):
    """bf16 on sm80/sm90: flash; fp32: flash takes only fp16/bf16, so memory-efficient. Each
    layer's forward kernel and its own backward, sized by torch's meta kernels; no s x s
    scores; GPT-2's dropout is CUDA's fused native_dropout (a bool mask), not bernoulli_."""
    problem = _analyze(MODELS[name](dtype=dtype), device=device)
    trace = problem.graph.trace
    assert _labels(trace, kernel) == [kernel] * LAYERS + [kernel + "_backward"] * LAYERS
    assert _meta_sizes_hold(trace, kernel) == LAYERS
    assert _meta_sizes_hold(trace, kernel + "_backward") == LAYERS
    assert not _labels(trace, "aten._safe_softmax") and not _labels(trace, CPU_FLASH)
    _no_square(trace)
    words = "flash attention" if kernel == FLASH else "memory-efficient attention"
    dt = str(dtype).removeprefix("torch.")
    assert problem.attention == (
        f"attention: {words} (assumed for {device}, {dt}, head dim 16) in {LAYERS} calls"
    )
    if name == "gpt2":
        assert _labels(trace, "aten.native_dropout") and not _labels(trace, "aten.bernoulli")


def test_flash_keeps_the_log_sum_exp_and_the_dropout_seed():
    """flash's saved tensors: out, a float32 log-sum-exp of batch x heads x s, the philox
    seed and offset (GPT-2's attention dropout), read again by its backward."""
    trace = _analyze(_gpt2(torch.bfloat16), device="h100").graph.trace
    fwd = [n for n in trace.nodes if n.label == FLASH][-1]  # the last layer's: backward first
    assert [str(s) for s in fwd.specs] == [
        f"bfloat16[{BATCH}, 4, {SEQ}, 16]",
        f"float32[{BATCH}, 4, {SEQ}]",
        "uint64[2]",
        "uint64[]",
        "bfloat16[0]",
    ]
    assert fwd.args[3] == 0.1  # the dropout probability reaches the kernel
    bwd = next(n for n in trace.nodes if n.label == FLASH + "_backward")
    read = {s for r in bwd.reads for s in trace.nodes[r].storages}
    assert set(fwd.storages[:4]) <= read  # out, lse, seed, offset


def test_efficient_attention_keeps_its_seed_on_the_host():
    """CUDA's memory-efficient attention returns its dropout seed and offset as CPU tensors
    (outside graph capture): the trace counts no device bytes for them, the output and the
    log-sum-exp in full (an H200 measured this: docs/validate.md)."""
    problem = _analyze(_gpt2(torch.float32), device="h100")
    graph = problem.graph
    calls = [op for op in graph.ops if op.label == EFFICIENT]
    assert len(calls) == LAYERS
    for op in calls:
        out, lse, seed, offset = (graph.values[v].nbytes for v in op.outputs)
        assert out == BATCH * 4 * SEQ * 16 * 4 and lse > 0
        assert seed == offset == 0


def test_a_probed_host_seed_still_counts_no_device_bytes(monkeypatch) -> None:
    """On the GPU the probe runs the efficient attention forward for real, and its seed and
    offset come back as 8-byte host tensors: they stay at 0 device bytes (the H200 measured
    the 12 phantom blocks again, -5,632 B, while the probe gave them their host size)."""
    from core.trace import convert

    def host_probe(node, vals):  # noqa: ANN001, ANN202
        return [(10_000 + node.index * 8 + i, 8) for i in range(len(node.storages))]

    monkeypatch.setattr(convert, "_probeable", lambda node, vals: bool(convert._host_results(node)))
    monkeypatch.setattr(convert, "_probe", host_probe)
    graph = _analyze(_gpt2(torch.float32), device="h100").graph
    calls = [op for op in graph.ops if op.label == EFFICIENT]
    assert len(calls) == LAYERS
    for op in calls:
        out, lse, seed, offset = (graph.values[v].nbytes for v in op.outputs)
        assert out == lse == 512  # the probe's 8 B taken (a 512 B block) where on the device
        assert seed == offset == 0


def test_grouped_query_attention():
    """Flash takes grouped-query heads (enable_gqa: key and value keep 2 heads, and so do
    their gradients). fp32 takes math here, and the note says the trace holds the s x s
    matrix: torch 2.13's meta kernel for mem-efficient's backward gives the key and value
    gradients the query's heads, which autograd rejects (core.trace.attention's docstring)."""
    trace = _analyze(_llama(kv_heads=2, dtype=torch.bfloat16), device="h100").graph.trace
    bwd = next(n for n in trace.nodes if n.label == FLASH + "_backward")
    assert [s.shape[1] for s in bwd.specs] == [4, 2, 2]
    _no_square(trace)
    fp32 = _analyze(_llama(kv_heads=2), device="h100")
    assert _labels(fp32.graph.trace, "aten._safe_softmax")
    assert "math attention (the s x s matrix)" in fp32.attention


def test_a_padding_mask_rules_out_flash():
    """The zoo's Llama passes a padding mask (and dropout 0.1): flash takes no mask, so
    mem-efficient runs it, its boolean mask made additive first as torch does (`where`)."""
    case = zoo_llama()
    problem = core.analyze(
        case.model, case.args, case.kwargs, case.loss_fn, case.targets, device="h100"
    )
    trace = problem.graph.trace
    assert _labels(trace, EFFICIENT) == [EFFICIENT] * 2 + [EFFICIENT + "_backward"] * 2
    eff = next(n for n in trace.nodes if n.label == EFFICIENT)
    mask = trace.nodes[eff.args[3].index]
    assert mask.specs[0].dtype == "float32"


def test_the_user_chooses_what_cpu_cannot_know():
    """cuDNN comes first only with a runtime cuDNN newer than 9.15, which CPU cannot see:
    attention="cudnn" assumes it; a choice the call rules out falls back by torch's order,
    and the note says so."""
    cudnn = _analyze(_llama(dtype=torch.bfloat16), device="h100", attention="cudnn")
    assert _labels(cudnn.graph.trace, CUDNN) == [CUDNN] * LAYERS + [CUDNN + "_backward"] * LAYERS
    assert "cuDNN attention (assumed for h100, bfloat16, head dim 16; cuDNN attention " in (
        cudnn.attention
    )
    flash = _analyze(_llama(), device="h100", attention="flash")  # fp32: flash cannot
    assert _labels(flash.graph.trace, EFFICIENT)
    assert "flash attention assumed, not possible here" in flash.attention
    math = _analyze(_llama(dtype=torch.bfloat16), device="h100", attention="math")
    assert _labels(math.graph.trace, "aten._safe_softmax")
    with pytest.raises(ValueError, match="unknown attention 'fast'"):
        _analyze(_llama(), device="h100", attention="fast")


class _Sdpa(TorchDispatchMode):
    """The attention ops eager dispatches."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = f"aten.{func._opname}"
        if "scaled_dot_product" in name or name == "aten._safe_softmax":
            self.ops.append(name)
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("name", ["llama", "gpt2"])
def test_a_cpu_trace_holds_what_cpu_eager_dispatches(name):
    """Llama (no dropout): CPU's flash kernel; GPT-2 (attention dropout): the math path. The
    same step from the meta device, traced for CPU, holds the same attention ops (the rest
    of a meta trace is not the subject here: Hugging Face's Python differs on meta)."""
    model = MODELS[name]()
    ids = _ids()
    with _Sdpa() as seen:
        model(ids, labels=ids).loss.backward()
    problem = _analyze(model, device="cpu")
    trace = problem.graph.trace
    traced = [n.label for n in trace.nodes if n.label in set(seen.ops)]
    assert traced == seen.ops and seen.ops
    assert (CPU_FLASH in seen.ops) == (name == "llama")
    meta = MODELS[name]().to("meta")
    from_meta = _analyze(meta, device="cpu").graph.trace

    def attention(t: Trace) -> list[tuple[str, list[str]]]:
        return [(n.label, [str(s) for s in n.specs]) for n in t.nodes if n.label in seen.ops]

    assert attention(from_meta) == attention(trace)


@pytest.mark.slow
def test_gpu_storages_are_rounded_as_the_caching_allocator_does_cpu_stays_exact():
    """core.allocator: on a GPU preset every storage takes a multiple of 512 B (0 stays 0);
    on CPU the values are the trace's own bytes."""
    gpu = _analyze(_gpt2(), device="h100")
    sizes = gpu.graph.trace.storage_bytes
    assert any(b % 512 for b in sizes.values())  # the tiny step has small storages
    for v in gpu.graph.values:
        assert v.nbytes == -(-sizes[v.index] // 512) * 512
    cpu = _analyze(_gpt2(), device="cpu")
    assert all(v.nbytes == cpu.graph.trace.storage_bytes[v.index] for v in cpu.graph.values)
    assert gpu.allocator.unit == 512 and cpu.allocator.unit == 1
    plan = core.solve(gpu, "80%")  # a GPU trace plans as any other
    assert plan.predicted_peak <= 0.8 * gpu.store_all_peak


@pytest.mark.slow
def test_a_gpu_plan_records_its_device_and_is_refused_on_another(tmp_path):
    """A plan for an H100 carries its device model in its file and binds only on an H100:
    on a CPU model it is refused, naming both, made in this process or loaded."""
    model = _gpt2(torch.bfloat16)
    plan = core.solve(_analyze(model, device="h100", attention="flash"), "80%")
    assert plan.graph_meta.device == DeviceModel("h100", "cuda", (9, 0), "flash")
    plan.save(tmp_path / "plan.pkl")
    loaded = core.load_plan(tmp_path / "plan.pkl")
    assert loaded.graph_meta.device == plan.graph_meta.device
    said = r"made for h100 \(cuda, sm 9\.0\), the model is on cpu \(cpu\)"
    for p in (plan, loaded):
        with pytest.raises(core.PlanMismatch, match=said):
            core.apply_plan(model, p, loss_fn=lambda out: out.loss)
    cpu_plan = core.solve(_analyze(model, device="cpu"), "80%")
    assert cpu_plan.graph_meta.device == DeviceModel()
    assert "device" not in cpu_plan.graph_meta.to_data()  # CPU plans' files as before


def test_a_gpu_step_under_autocast_takes_cudas_cast_lists():
    """GPT-2 in fp32 under bf16 autocast: traced for an H100, CUDA's lists apply (GELU's
    `pow` in fp32, attention cast to bf16 first, so flash); traced for CPU, CPU's (`pow` in
    bf16, not on CPU's fp32 list). A meta model under CUDA autocast is refused by name."""
    gpu = _analyze(_gpt2(), device="h100", autocast=Autocast((("cuda", "bfloat16"),)))
    cpu = _analyze(_gpt2(), device="cpu", autocast=Autocast((("cpu", "bfloat16"),)))

    def pow_dtypes(p: core.Problem) -> set[str]:
        return {n.specs[0].dtype for n in p.graph.trace.nodes if n.label == "aten.pow"}

    assert pow_dtypes(gpu) == {"float32"} and pow_dtypes(cpu) == {"bfloat16"}
    assert "flash attention (assumed for h100, bfloat16" in gpu.attention
    assert _labels(gpu.graph.trace, FLASH)
    with pytest.raises(core.UnsupportedModel, match="CUDA autocast on a model on the meta"):
        _analyze(_gpt2().to("meta"), device="h100", autocast=Autocast((("cuda", "bfloat16"),)))


def test_a_gpu_plans_fingerprint_leaves_the_tensors_device_out():
    """The GPU's own trace records its factory ops on cuda:0 where a trace on CPU tensors
    recorded cpu: a GPU plan's fingerprint leaves those devices out (the device model is
    checked apart), a CPU plan's keeps them."""
    problem = _analyze(_gpt2(torch.bfloat16), device="h100")
    trace = problem.graph.trace
    on_gpu = copy.deepcopy(trace)
    moved = 0
    for node in on_gpu.nodes:
        if node.kwargs.get("device") == torch.device("cpu"):
            node.kwargs["device"], moved = torch.device("cuda", 0), moved + 1
    assert moved  # GPT-2's position ids: arange(..., device=cpu)
    assert fingerprint(on_gpu, any_device=True) == problem.fingerprint
    assert fingerprint(on_gpu) != fingerprint(trace)
    cpu = _analyze(_gpt2(torch.bfloat16), device="cpu")
    assert cpu.fingerprint == fingerprint(cpu.graph.trace)  # devices kept
    assert cpu.fingerprint != fingerprint(cpu.graph.trace, any_device=True)


def test_measured_costs_of_a_step_for_another_device_are_refused():
    """Measured costs run the ops on the model's device: a GPU step's flash kernel does not
    run on CPU, so the request is refused with what to do."""
    with pytest.raises(ValueError, match="costs='measured' times the ops on the model's"):
        _analyze(_llama(dtype=torch.bfloat16), device="h100", costs="measured")


@pytest.mark.parametrize(
    "dtype, causal, gqa", [(torch.float32, True, False), (torch.bfloat16, False, True)]
)
def test_the_math_path_written_out_is_torchs_op_for_op(dtype, causal, gqa):
    """`math_attention` (the math kernel with CUDA's dropout for a GPU step) is torch's
    `_scaled_dot_product_attention_math`, traced op for op, when given torch's dropout."""
    from torch.fx.experimental.proxy_tensor import make_fx

    from core.trace.attention import _additive_mask, _Call, math_attention

    q = torch.randn(2, 4, 8, 16, dtype=dtype, requires_grad=True)
    kv = torch.randn(2, 2 if gqa else 4, 8, 16, dtype=dtype, requires_grad=True)

    def bool_mask() -> torch.Tensor | None:
        return None if causal else torch.ones(8, 8, dtype=torch.bool).tril()

    def ours(q, kv):
        mask = _additive_mask(bool_mask(), q.dtype, -math.inf)
        call = _Call(q, kv, kv, mask, 0.1, causal, None, gqa)
        return math_attention(call, mask, lambda t: torch.dropout(t, 0.1, True))

    def torchs(q, kv):
        mask = _additive_mask(bool_mask(), q.dtype, -math.inf)
        return torch.ops.aten._scaled_dot_product_attention_math(
            q, kv, kv, mask, 0.1, causal, enable_gqa=gqa
        )[0]

    def ops(fn):
        gm = make_fx(fn, tracing_mode="fake")(q, kv)
        return [
            (str(n.target), str(getattr(n.meta.get("val"), "shape", "")))
            for n in gm.graph.nodes
            if n.op == "call_function"
        ]

    assert ops(ours) == ops(torchs)


def test_a_gpu_math_step_drops_out_with_cudas_kernel():
    """V100 (sm 7.0) in bf16: no flash, mem-efficient or cuDNN for bf16 there, so math; its
    attention dropout is CUDA's native_dropout (a bool mask), not bernoulli_."""
    problem = _analyze(_gpt2(torch.bfloat16), device="v100")
    trace = problem.graph.trace
    assert _labels(trace, "aten._safe_softmax") and not _labels(trace, "aten.bernoulli")
    drops = [n for n in trace.nodes if n.label == "aten.native_dropout"]
    assert len(drops) == 1 + 3 * LAYERS  # embeddings; attention, residual, MLP per layer
    assert "math attention (the s x s matrix) (assumed for v100, bfloat16" in problem.attention
