"""Published GPU memory tables, reproduced from their configurations (`remat bench --tables`).

Nobody here has run CUDA, so the device model is checked against measurements other people
published. Each row of `ROWS` is one published figure written down as its configuration: the
model's shape, the batch, the precision, the attention it ran, the activation checkpointing,
how its framework holds parameters, gradients and optimizer state, and the parallelism. From
that configuration alone the whole step is predicted:

- parameters, gradients, optimizer state: bytes per trainable parameter on one device (`State`),
  the parameters counted on the model built on the meta device;
- the parallelism's own buffers (`FSDP`: the unsharded parameters gathered for compute and one
  layer's gradients before their reduce-scatter);
- the step: our planner's peak of activations and temporaries (`core.analyze` on the meta
  device with the GPU's preset), for store-all, every layer checkpointed, or torchtitan's
  selective op policy as a keep set; the batch;
- what the figure counts beyond the allocator (NVML: the CUDA context the same page measured).

The framework keeps the gradients in buffers of its own (Megatron's fp32 `main_grad`, FSDP's
sharded fp32 gradients, the Trainer's `.grad` kept across steps by `zero_grad()`), counted once
under gradients; the gradient autograd makes is added into it and freed, so the step term is
the planner's activations and temporaries, not its gradients.

The residual is (predicted - measured) / measured. A row more than `TOLERANCE` off must name its
reason (`Row.reason`); `check` says which do not. Adding a row is writing its configuration.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

import core
from core import (
    Autocast,
    Plan,
    Problem,
    Recompute,
    Simulation,
    autocast_casts,
    fmt_bytes,
    graph_dag,
    plan_from_runs,
    store_all_plan,
)
from sample_models.zoo import ZooCase

MIB, GIB = 1 << 20, 1 << 30
TOLERANCE = 0.10  # a row further off than this must name its reason
DOC = Path(__file__).resolve().parent.parent / "docs" / "gpu-tables.md"

# What each published figure counts (read in the frameworks' sources, cited per row).
COUNTS: dict[str, str] = {
    "allocated": "`torch.cuda.max_memory_allocated` (`allocated_bytes.all.peak`): the blocks "
    "the caching allocator handed out, each request rounded up to 512 B, an unsplit cached "
    "block counted whole",
    "active": "`active_bytes.all.peak` (torchtitan's max_active): allocated blocks, each "
    "counted until the last stream using it is done with it",
    "reserved": "`torch.cuda.max_memory_reserved` (`reserved_bytes.all.peak`): the segments the "
    "caching allocator holds from `cudaMalloc`, allocated blocks and cached free ones",
    "nvml": "NVML's `used` memory of the whole GPU (`nvidia-smi`): the CUDA context and "
    "kernels, the allocator's reserved segments and library workspaces",
}
STRATEGIES: dict[str, str] = {
    "none": "no step: what stays allocated between steps",
    "store_all": "every activation kept (plain PyTorch)",
    "checkpoint_blocks": "every layer checkpointed (its input kept, the rest recomputed): "
    "Hugging Face's gradient checkpointing, torchtitan's full AC",
    "selective_op": "torchtitan's selective op checkpointing of every layer",
}


@dataclass(frozen=True)
class State:
    """How a framework holds each trainable parameter on one device: bytes per parameter."""

    params: float
    grads: float
    optimizer: float
    describe: str


@dataclass(frozen=True)
class FSDP:
    """FSDP2 over `degree` ranks with a mixed-precision policy: besides each rank's shards
    (in `State`), the step holds the unsharded parameters in `param_bytes` per parameter for
    the root module (embeddings, final norm, output: gathered through forward and backward)
    and two layers (the current and the prefetched one), and one layer's unsharded gradients
    in the autograd dtype (`param_bytes`) and cast to `reduce_bytes` for the reduce-scatter."""

    degree: int
    param_bytes: int = 2
    reduce_bytes: int = 4


@dataclass(frozen=True)
class Row:
    """One published figure and the configuration that produced it."""

    table: str  # the table it belongs to, e.g. "Megatron-LM functional tests, A100"
    label: str  # the row, as the source names it
    source: str  # where the figure is: URL at a commit or version
    counts: str  # a key of COUNTS
    measured: int  # bytes, as published (MiB and GiB converted exactly)
    device: str  # the core.costs preset the step is traced for
    build: Callable[[], ZooCase]  # the model and one step's call, on the meta device
    strategy: str  # a key of STRATEGIES
    state: State
    fsdp: FSDP | None = None
    fixed: int = 0  # bytes the source itself measured outside the step (the CUDA context)
    fixed_what: str = ""
    attention: str | None = None  # the SDPA kernel stated by the row (None: torch's rules)
    autocast: tuple[tuple[str, str], ...] = ()  # e.g. (("cuda", "float16"),)
    config: str = ""  # the configuration, in the source's words
    reason: str = ""  # why the residual is what it is (required beyond TOLERANCE)


@dataclass(frozen=True)
class Prediction:
    """A row's whole-step prediction, by part; `refused` instead when the planner refused it."""

    row: Row
    n_params: int = 0
    parameters: int = 0
    gradients: int = 0
    optimizer: int = 0
    parallel: int = 0
    step: int = 0  # activations + temporaries at the step's peak, and the batch
    kernels: tuple[str, ...] = ()  # the attention ops the traced step holds
    refused: str = ""
    seconds: float = 0.0  # time to trace and plan this row here

    @property
    def total(self) -> int:
        return (
            self.parameters
            + self.gradients
            + self.optimizer
            + self.parallel
            + self.step
            + self.row.fixed
        )

    @property
    def residual(self) -> float:
        """(predicted - measured) / measured; NaN when refused."""
        if self.refused:
            return math.nan
        return (self.total - self.row.measured) / self.row.measured

    @property
    def needs_reason(self) -> bool:
        return bool(self.refused) or abs(self.residual) > TOLERANCE


# ---------------------------------------------------------------------------------------------
# The models, built on the meta device as their sources configure them


def hf_model(
    model_class: str,
    config: dict[str, Any],
    batch: int,
    seq: int,
    loss: Callable[..., torch.Tensor] | None,
    dtype: torch.dtype | None = None,
    device: str = "meta",
) -> Callable[[], ZooCase]:
    """The builder of every row's step: transformers' `model_class` made from `config` on
    `device` (then in `dtype`), training on token ids of batch x seq; `loss(output, labels)`
    over per-token labels, or, where `loss` is None, the model's own loss from one label per
    sequence (`labels=`)."""

    def build() -> ZooCase:
        import transformers

        cls = getattr(transformers, model_class)
        cfg = cls.config_class(**config)
        with torch.device(device):
            model: nn.Module = cls(cfg)
            if dtype is not None:
                model = model.to(dtype)
            ids = torch.zeros(batch, seq, dtype=torch.long)
            labels = torch.zeros((batch,) if loss is None else (batch, seq), dtype=torch.long)
        layers = cfg.num_hidden_layers
        if loss is None:
            return ZooCase(model.train(), (ids,), {"labels": labels}, _own_loss, (), layers)
        return ZooCase(model.train(), (ids,), {}, loss, (labels,), layers)

    return build


def fp32_token_loss(output: Any, labels: torch.Tensor) -> torch.Tensor:
    """Cross-entropy over the logits upcast to fp32, as torchtitan's loss."""
    logits = output.logits
    return nn.functional.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(0, 1))


class _MegatronCrossEntropy(torch.autograd.Function):
    """Megatron's vocab-parallel cross-entropy on one rank (megatron/core/tensor_parallel/
    cross_entropy.py): the logits upcast to fp32, the softmax saved, the backward updating the
    saved softmax in place into the logits' gradient. Its forward works in place too; traced
    out of place here (the tracer refuses an in-place op on a tensor read before it)."""

    @staticmethod
    def forward(ctx: Any, logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        x = logits.float()
        x = x - x.max(dim=-1)[0].unsqueeze(-1)
        predicted = x.gather(-1, target.unsqueeze(-1)).squeeze(-1)
        x = torch.exp(x)
        total = x.sum(dim=-1)
        loss = torch.log(total) - predicted
        x = x / total.unsqueeze(-1)
        ctx.save_for_backward(x, target)
        return loss

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        softmax, target = ctx.saved_tensors
        ones = torch.full_like(target, -1.0, dtype=softmax.dtype).unsqueeze(-1)
        softmax.scatter_add_(-1, target.unsqueeze(-1), ones)
        softmax.mul_(grad.unsqueeze(-1))
        return softmax, None


def megatron_loss(output: Any, labels: torch.Tensor) -> torch.Tensor:
    """Megatron's GPT loss: per-token cross-entropy over [sequence, batch] logits, averaged."""
    logits = output.logits.transpose(0, 1)
    return _MegatronCrossEntropy.apply(logits, labels.transpose(0, 1).contiguous()).mean()


def megatron_gpt(attention: str) -> Callable[[], ZooCase]:
    """Megatron-LM's functional-test GPT: 12 layers, hidden 512, 8 heads, sequence 1024,
    GPT-2's vocabulary padded to a multiple of 128 (50,304), tied embeddings, learned
    positions, dropout 0.1, bf16 parameters; micro-batch 4. Megatron's bias-GeLU is one
    kernel: GeLU's tanh form as one op. `attention`: "eager" for the unfused backend,
    "sdpa" for the fused one."""
    config = _kw(
        vocab_size=50304,
        n_positions=1024,
        n_embd=512,
        n_layer=12,
        n_head=8,
        activation_function="gelu_pytorch_tanh",
        attn_implementation=attention,
    )
    return hf_model("GPT2LMHeadModel", config, 4, 1024, megatron_loss, torch.bfloat16)


def llama31_8b(batch: int = 2, seq: int = 8192) -> Callable[[], ZooCase]:
    """Llama 3.1 8B as torchtitan's `8B` flavour: dim 4096, 32 layers, 32 heads, 8 KV heads,
    FFN 14,336, vocabulary 128,256, RoPE theta 500,000, untied output; bf16 compute (FSDP's
    mixed-precision policy), loss over fp32 logits."""
    config = _kw(
        vocab_size=128256,
        hidden_size=4096,
        intermediate_size=14336,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=8,
        rope_theta=500000.0,
        max_position_embeddings=seq,
        tie_word_embeddings=False,
        attn_implementation="sdpa",
    )
    return hf_model("LlamaForCausalLM", config, batch, seq, fp32_token_loss, torch.bfloat16)


def bert_large(batch: int, seq: int = 512, device: str = "meta") -> Callable[[], ZooCase]:
    """`bert-large-uncased` for sequence classification (2 labels), fp32: 24 layers, hidden
    1024, 16 heads, FFN 4096, vocabulary 30,522; the attention as transformers 4.21 wrote it
    (eager: matmul, softmax, dropout, matmul); the loss computed by the model from `labels`.
    `device`: "meta", or "cpu" for a step under CUDA autocast (analyze refuses a meta model
    there: docs/gpu.md)."""
    config = _kw(
        vocab_size=30522,
        hidden_size=1024,
        num_hidden_layers=24,
        num_attention_heads=16,
        intermediate_size=4096,
        max_position_embeddings=512,
        num_labels=2,
        attn_implementation="eager",
    )
    return hf_model("BertForSequenceClassification", config, batch, seq, None, device=device)


def _kw(**kwargs: Any) -> dict[str, Any]:
    """A config's keywords (transformers' configs take more than their signatures say)."""
    return kwargs


def _own_loss(output: Any) -> torch.Tensor:
    return output.loss


# ---------------------------------------------------------------------------------------------
# The rows

_MEGATRON = (
    "https://github.com/NVIDIA/Megatron-LM/tree/d98e8a64ddf34856e74b24714e3bedb2f5a39553/"
    "tests/functional_tests/test_cases/gpt/"
)
_TITAN = (
    "https://github.com/pytorch/torchtitan/blob/b5bcd76c66d0acb1a08b176d9639425bc55e0b2a/"
    "benchmarks/llama3_h100_202412_torchtitan.md"
)
_HF = "https://huggingface.co/docs/transformers/v4.21.0/perf_train_gpu_one"

# Megatron, bf16 with the distributed optimizer over 8 data-parallel ranks: bf16 parameters,
# an fp32 main_grad buffer, and an fp32 master copy plus Adam's two fp32 moments sharded 8 ways.
MEGATRON_STATE = State(2, 4, 12 / 8, "bf16 params, fp32 main grads, fp32 master + Adam / 8")
# FSDP2, fp32 parameters sharded 8 (or 128) ways, fp32 gradients and AdamW's moments likewise.
TITAN_STATE = State(4 / 8, 4 / 8, 8 / 8, "fp32 params, grads and AdamW sharded / 8")
TITAN_128_STATE = State(4 / 128, 4 / 128, 8 / 128, "fp32 params, grads and AdamW sharded / 128")
# The Trainer: fp32 parameters and gradients, AdamW's two fp32 moments (also under fp16 amp).
TRAINER_STATE = State(4, 4, 8, "fp32 params, fp32 grads, AdamW")
WEIGHTS_ONLY = State(4, 0, 0, "fp32 params")
HF_CONTEXT = 1343 * MIB  # the page's own reading after `torch.ones((1, 1)).to("cuda")`

_MEGATRON_CONFIG = (
    "12 layers, hidden 512, 8 heads, seq 1024, micro-batch 4, global batch 32 on 8 A100s "
    "(TP 1, PP 1, DP 8), bf16, distributed optimizer, Transformer Engine layers"
)
_MEGATRON_WHY = (
    "Megatron allocates besides the model: torch's cuBLAS workspaces (CUBLAS_WORKSPACE_CONFIG="
    ":4096:8, 32 MiB) and Transformer Engine's, the gradient buckets' padding; ~71 MB are "
    "held between steps that this row does not model"
)
# Megatron's loss at micro-batch 4: logits of 4 x 1024 tokens x 50,304, fp32 and bf16
_LOGITS_FP32, _LOGITS_BF16 = 4 * 1024 * 50304 * 4, 4 * 1024 * 50304 * 2
_MEGATRON_PEAK_WHY = (
    "the trace holds two fp32 logits-sized tensors (4 x 1024 x 50,304 x 4 B = "
    f"{_LOGITS_FP32 / 1e9:.3f} GB each) at once, where Megatron's cross-entropy holds one: "
    "it works in place (x -= max; exp(x, out=x); x /= sum; its backward updates the saved "
    "softmax), which the tracer writes out of place (an op owns its storage), so the fp32 "
    "copy and the next result are live together (forward: sub, exp; backward: the "
    "softmax's division). Megatron's peak holds its fp32 softmax with the bf16 logits "
    "(forward) or with their bf16 gradient (backward: autograd casts the loss's fp32 "
    "gradient to the logits' dtype while the saved softmax is held), "
    f"{_LOGITS_FP32 / 1e9:.3f} + {_LOGITS_BF16 / 1e9:.3f} GB: both rows are "
    f"{_LOGITS_BF16 / 1e9:.3f} GB over by the loss alone (net of it: the residual analysis). "
    "The fused row's attention is the flash kernel: out and a log-sum-exp per row"
)
_TITAN_CONFIG = (
    "Llama 3.1 8B, FSDP2 (bf16 params, fp32 reduce), local batch 2, seq 8192, selective op "
    "AC (save every second mm, SDPA), AdamW, no compile"
)
_TITAN_WHY = (
    "reserved, not allocated: FSDP2 all-gathers and reduce-scatters on their own streams, "
    "whose blocks the caching allocator keeps in separate pools, and the fp32 logits "
    "(2 x 8192 x 128,256, 8 GiB each) leave cached segments no smaller request reuses"
)
_BERT_WHY = (
    "NVML counts what the allocator reserved (allocated blocks and its cache) and library "
    "memory (cuBLAS's workspace and kernels), neither modelled; the context is the page's "
    "own 1343 MiB; the allocator's rules replayed over the step account for only ~0.2 GB "
    "of the under-count (the residual analysis)"
)
# bert-large's Linear weights (24 layers: query, key, value, output 1024 x 1024; 4096 x 1024
# in and out), which CUDA autocast casts to fp16 and keeps into the backward
_BERT_LINEAR = 24 * (4 * 1024 * 1024 + 2 * 1024 * 4096)
_BERT_FP16_WHY = (
    "; under fp16 (transformers 4.21's Trainer: torch.cuda.amp.autocast around forward and "
    "loss, a GradScaler, fp32 weights) the trace holds what CUDA autocast holds: each "
    f"Linear's fp16 weight copy ({_BERT_LINEAR / 1e6:.0f}M weights x 2 B = "
    f"{_BERT_LINEAR * 2 / 1e9:.3f} GB, cached for the forward, saved by addmm into the "
    "backward), the fp32 softmax and the fp16 copy of the dropped-out probabilities "
    "(64 + 32 MiB a layer), each Linear's input cast to fp16; the GradScaler unscales in "
    "place and the AdamW step is fp32's. The part of this row's under-count beyond the fp32 "
    "row's (the residual analysis) is not explained: the step holds what torch's autocast "
    "rules and 4.21's BERT make, and the caching allocator's rules replayed over the traced "
    "step (bench/allocator_replay.py) leave reserved less than 0.25 GB over allocated in "
    "both rows"
)

_GPT_UNFUSED, _GPT_FUSED = megatron_gpt("eager"), megatron_gpt("sdpa")
_LLAMA_8B = llama31_8b()
_BERT_1, _BERT_4 = bert_large(1), bert_large(4)
_BERT_1_CPU, _BERT_4_CPU = bert_large(1, device="cpu"), bert_large(4, device="cpu")


def _megatron(
    label: str,
    case: str,
    measured: int,
    build: Callable[[], ZooCase],
    strategy: str,
    reason: str,
    config: str = "",
    attention: str | None = None,
) -> Row:
    """A row of Megatron-LM's functional-test golden values (`mem-*-bytes`, A100)."""
    return Row(
        "Megatron-LM functional tests, A100",
        label,
        _MEGATRON + case,
        "allocated",
        measured,
        "a100",
        build,
        strategy,
        MEGATRON_STATE,
        attention=attention,
        config=_MEGATRON_CONFIG + config,
        reason=reason,
    )


def _titan(table: str, label: str, gib: float, state: State, gpus: int, batch: int) -> Row:
    """A row of torchtitan's Llama 3.1 8B H100 benchmark (peak reserved, GiB)."""
    return Row(
        f"torchtitan Llama 3.1 8B, H100 ({table})",
        label,
        _TITAN,
        "reserved",
        round(gib * GIB),
        "h100",
        _LLAMA_8B,
        "selective_op",
        state,
        fsdp=FSDP(gpus),
        attention="flash",
        config=_TITAN_CONFIG + f"; {gpus} GPUs, global batch {batch}",
        reason=_TITAN_WHY,
    )


def _hf(
    label: str,
    mib: int,
    build: Callable[[], ZooCase],
    strategy: str,
    state: State,
    config: str,
    reason: str = _BERT_WHY,
    fp16: bool = False,
) -> Row:
    """A row of Hugging Face's perf_train_gpu_one page (NVML MiB on a V100, its context)."""
    return Row(
        "Hugging Face perf_train_gpu_one, V100 16 GB",
        label,
        _HF,
        "nvml",
        mib * MIB,
        "v100",
        build,
        strategy,
        state,
        fixed=HF_CONTEXT,
        fixed_what="CUDA context",
        autocast=(("cuda", "float16"),) if fp16 else (),
        config=config,
        reason=reason,
    )


_UNFUSED_CASE = "gpt3_mcore_te_tp1_pp1_dist_optimizer_no_mmap_bin_files"
ROWS: tuple[Row, ...] = (
    _megatron(
        "between steps (mem-allocated-bytes), unfused",
        _UNFUSED_CASE,
        552_128_512,
        _GPT_UNFUSED,
        "none",
        _MEGATRON_WHY,
    ),
    _megatron(
        "peak (mem-max-allocated-bytes), unfused attention",
        _UNFUSED_CASE,
        4_673_069_568,
        _GPT_UNFUSED,
        "store_all",
        _MEGATRON_PEAK_WHY,
        "; --attention-backend unfused",
    ),
    _megatron(
        "peak (mem-max-allocated-bytes), fused attention",
        "gpt3_mcore_te_tp1_pp1_resume_torch_dist_dist_optimizer",
        2_711_714_304,
        _GPT_FUSED,
        "store_all",
        _MEGATRON_PEAK_WHY,
        "; attention backend auto (Transformer Engine's fused)",
        attention="flash",
    ),
    _titan("Table 1", "FSDP, 8 GPUs", 82.4, TITAN_STATE, 8, 16),
    _titan("Table 3", "FSDP, 128 GPUs", 67.0, TITAN_128_STATE, 128, 256),
    _hf(
        "model loaded",
        2631,
        _BERT_1,
        "none",
        WEIGHTS_ONLY,
        "bert-large-uncased on the GPU, no training",
        "NVML: the weights in the allocator's segments and the page's own context reading",
    ),
    _hf(
        "vanilla, batch 4",
        14949,
        _BERT_4,
        "store_all",
        TRAINER_STATE,
        "Trainer, AdamW (adamw_hf), fp32, per-device batch 4, seq 512",
    ),
    _hf(
        "batch 1, gradient accumulation 4",
        8681,
        _BERT_1,
        "store_all",
        TRAINER_STATE,
        "Trainer, AdamW, fp32, per-device batch 1, 4 accumulation steps, seq 512",
    ),
    _hf(
        "batch 1, accumulation 4, gradient checkpointing",
        6775,
        _BERT_1,
        "checkpoint_blocks",
        TRAINER_STATE,
        "as above, gradient_checkpointing=True (every BertLayer)",
    ),
    _hf(
        "batch 4, fp16",
        13939,
        _BERT_4_CPU,
        "store_all",
        TRAINER_STATE,
        "Trainer, AdamW, fp16=True (CUDA autocast, GradScaler), batch 4, seq 512",
        _BERT_WHY + _BERT_FP16_WHY,
        fp16=True,
    ),
    _hf(
        "batch 1, accumulation 4, checkpointing, fp16",
        7275,
        _BERT_1_CPU,
        "checkpoint_blocks",
        TRAINER_STATE,
        "Trainer, AdamW, fp16, batch 1, 4 accumulation steps, gradient checkpointing",
        fp16=True,
    ),
)


# ---------------------------------------------------------------------------------------------
# Prediction


def predict(row: Row) -> Prediction:
    """The whole-step prediction of `row` from its configuration; a planner refusal (or a
    model the installed libraries cannot build) becomes the prediction's `refused` text."""
    start = time.perf_counter()
    try:
        case = row.build()
        n_params = sum(p.numel() for p in case.model.parameters() if p.requires_grad)
        step, kernels = (0, ()) if row.strategy == "none" else _step_of(row, case)
    except Exception as e:  # a row the planner refuses is reported, not fatal
        return Prediction(row, refused=f"{type(e).__name__}: {e}"[:300])
    state = row.state
    return Prediction(
        row,
        n_params,
        round(state.params * n_params),
        round(state.grads * n_params),
        round(state.optimizer * n_params),
        _fsdp_buffers(row.fsdp, case) if row.fsdp and row.strategy != "none" else 0,
        step,
        kernels,
        seconds=time.perf_counter() - start,
    )


def analyze_row(row: Row, case: ZooCase) -> Problem:
    """`core.analyze` of the row's step for its device preset: the attention kernel, dropout
    and allocator rounding that device runs (`core.trace.device`, `core.allocator`), the
    kernel `row.attention` where the row states it."""
    return core.analyze(
        case.model,
        case.args,
        case.kwargs,
        loss_fn=case.loss_fn,
        targets=case.targets,
        device=row.device,
        attention=row.attention or "auto",
        autocast=Autocast(row.autocast),
        name=row.label,
    )


# Rows that differ only in what the framework holds (the 8- and 128-GPU torchtitan rows) share
# one traced step: keyed by what the step depends on, the builder included.
_STEPS: dict[tuple[Any, ...], tuple[int, tuple[str, ...]]] = {}


def _step_of(row: Row, case: ZooCase) -> tuple[int, tuple[str, ...]]:
    """`_step_peak`, once per builder, device, attention, autocast and strategy."""
    key = (row.build, row.device, row.attention, row.autocast, row.strategy)
    if key not in _STEPS:
        _STEPS[key] = _step_peak(row, case)
    return _STEPS[key]


def _step_peak(row: Row, case: ZooCase) -> tuple[int, tuple[str, ...]]:
    """The step's peak of activations and temporaries under the row's strategy, plus the
    batch; and the attention ops the trace holds."""
    problem = analyze_row(row, case)
    _check_autocast(problem, row)
    simulation = strategy_plan(problem, row.strategy, case.model).simulate()
    return step_peak(problem, simulation), attention_ops(problem)


def step_peak(problem: Problem, simulation: Simulation) -> int:
    """The most activations and temporaries the step holds, with what autocast's cache
    holds beyond them (`autocast_cached`), plus the batch."""
    cached = autocast_cached(problem, simulation)
    peak = max(
        s.activations + s.temporaries + extra
        for s, extra in zip(simulation.timeline, cached, strict=True)
    )
    return peak + problem.input_bytes


def autocast_cached(problem: Problem, simulation: Simulation) -> list[int]:
    """Bytes autocast's cache holds after each step of `simulation` beyond what the plan
    keeps: eager autocast caches each parameter's lower-precision cast (`cached_cast`) from
    its first use until the outermost autocast exits, at the forward's end, also under a
    checkpoint's no-grad forward (Hugging Face's gradient checkpointing, reentrant), where
    the plan frees a cast after its last read. All zeros without autocast."""
    graph = problem.graph
    extra = [0] * len(simulation.timeline)
    end = simulation.backward_start
    for o in autocast_casts(graph):
        for v in graph.ops[o].outputs:
            spans = simulation.intervals.get(v, [])
            if spans and spans[0][1] < end:
                for i in range(spans[0][1], end):
                    extra[i] += graph.values[v].nbytes
    return extra


class AutocastNotTraced(RuntimeError):
    """The row's autocast left no tensor of its dtype in the trace: the step traced is not
    the row's (torch.autocast("cuda") is disabled on a torch without CUDA)."""


def _check_autocast(problem: Problem, row: Row) -> None:
    """Refuse a row whose autocast dtype appears nowhere in its trace."""
    for device, dtype in row.autocast:
        if not any(s.dtype == dtype for n in problem.graph.trace.nodes for s in n.specs):
            raise AutocastNotTraced(
                f"autocast({device}, {dtype}) left no {dtype} tensor in the trace: this torch "
                f"cannot trace {device}'s autocast policy, so the step traced would be the "
                "full-precision one"
            )


def strategy_plan(problem: Problem, strategy: str, model: nn.Module) -> Plan:
    """The plan a strategy runs: store-all, every layer checkpointed, or torchtitan's
    selective op policy."""
    if strategy == "store_all":
        return store_all_plan(problem)
    if strategy == "checkpoint_blocks":
        return core.solve(problem, problem.store_all_peak, "checkpoint_blocks")
    if strategy == "selective_op":
        return selective_op_plan(problem, model)
    raise ValueError(f"unknown strategy {strategy!r}: choose one of {', '.join(STRATEGIES)}")


# torchtitan's `_save_list` (torchtitan/parallelisms/parallelize_llama.py at 9dec370): the
# outputs its policy must save; `aten.mm` only every second one within a layer's forward.
TITAN_SAVE = frozenset(
    {
        "aten.mm",
        "aten._scaled_dot_product_efficient_attention",
        "aten._scaled_dot_product_flash_attention",
        "_c10d_functional.reduce_scatter_tensor",
        "aten.abs",
        "aten.max",
    }
)


def selective_op_plan(problem: Problem, model: nn.Module) -> Plan:
    """torchtitan's selective op checkpointing as a keep set: in each layer, the outputs of
    its `TITAN_SAVE` ops (every odd-numbered `aten.mm` of the layer's forward, counted from
    1), and the layer's input (checkpoint keeps its inputs); everything outside the layers
    kept; the rest recomputed in the backward (`Recompute`)."""
    graph = problem.graph
    layer_names = _layer_names(model)
    keep: set[int] = set()
    mm_count: dict[str, int] = {}
    for block in problem.blocks:
        if block.output_value is not None:
            keep.add(block.output_value)
        layer = _layer_of(block.name, layer_names)
        for o in block.forward_ops:
            op = graph.ops[o]
            if layer is None:
                keep.update(op.outputs)
                continue
            if op.label not in TITAN_SAVE:
                continue
            if op.label == "aten.mm":
                mm_count[layer] = mm_count.get(layer, 0) + 1
                if mm_count[layer] % 2 == 0:
                    continue
            keep.update(op.outputs)
    dag = graph_dag(graph)
    kept = frozenset(v for v in keep if v in dag.sizes)
    runs = [dag.order[i] for i in Recompute(dag).runs(kept)]
    return plan_from_runs(problem, runs, dag.n_forward, "selective_op", problem.store_all_peak)


def _layer_names(model: nn.Module) -> list[str]:
    """Names of the model's repeated layers (bench.strategies.find_blocks), longest first."""
    from bench.strategies import find_blocks

    layers = {id(m) for m in find_blocks(model)}
    names = [n for n, m in model.named_modules() if id(m) in layers]
    return sorted(names, key=len, reverse=True)


def _layer_of(block_name: str, layer_names: Sequence[str]) -> str | None:
    for name in layer_names:
        if block_name == name or block_name.startswith(name + "."):
            return name
    return None


def attention_ops(problem: Problem) -> tuple[str, ...]:
    """The attention kernels the traced forward holds (fused SDPA ops), or the unfused
    marker: the softmax ops of a matrix attention."""
    labels = [problem.graph.ops[o].label for o in problem.graph.forward_ops]
    fused = sorted({lb for lb in labels if "scaled_dot_product" in lb})
    if fused:
        return tuple(fused)
    return ("matrix (softmax)",) if any("softmax" in lb for lb in labels) else ()


def _fsdp_buffers(fsdp: FSDP, case: ZooCase) -> int:
    """FSDP2's unsharded buffers during the step (see `FSDP`)."""
    model = case.model
    names = _layer_names(model)
    sizes = {n: p.numel() for n, p in model.named_parameters()}
    per_layer = [sum(k for n, k in sizes.items() if n.startswith(f"{m}.")) for m in names]
    layer = max(per_layer, default=0)
    root = sum(sizes.values()) - sum(per_layer)
    gathered = (root + 2 * layer) * fsdp.param_bytes
    return gathered + layer * (fsdp.param_bytes + fsdp.reduce_bytes)


# ---------------------------------------------------------------------------------------------
# The table


def predict_all(
    rows: Sequence[Row] = ROWS, log: Callable[[str], None] = lambda _: None
) -> list[Prediction]:
    """Every row's prediction, in order; `log` hears each as it finishes."""
    out = []
    for row in rows:
        p = predict(row)
        log(f"{row.table} / {row.label}: {_residual_text(p)} ({p.seconds:.0f} s)")
        out.append(p)
    return out


def check(predictions: Sequence[Prediction]) -> list[str]:
    """The rows beyond TOLERANCE (or refused) that name no reason: should be empty."""
    return [
        f"{p.row.table} / {p.row.label}"
        for p in predictions
        if p.needs_reason and not p.row.reason.strip()
    ]


def _gb(n: int) -> str:
    return f"{n / 1e9:.3f}"


def _residual_text(p: Prediction) -> str:
    return "refused" if p.refused else f"{p.residual:+.1%}"


def markdown_table(predictions: Sequence[Prediction]) -> str:
    """One Markdown table: measured against predicted (GB = 1e9 B) and its parts."""
    head = (
        "| table | row | counts | measured GB | predicted GB | residual | params | grads | "
        "optimizer | parallel | step | fixed | attention traced | reason |\n"
        "|---|---|---|--:|--:|--:|--:|--:|--:|--:|--:|--:|---|---|"
    )
    lines = [head]
    for p in predictions:
        r = p.row
        if p.refused:
            lines.append(
                f"| {r.table} | {r.label} | {r.counts} | {_gb(r.measured)} | - | refused | "
                f"| | | | | | | {p.refused} |"
            )
            continue
        why = r.reason if p.needs_reason else (r.reason or "within 10%")
        lines.append(
            f"| {r.table} | {r.label} | {r.counts} | {_gb(r.measured)} | {_gb(p.total)} | "
            f"{_residual_text(p)} | {_gb(p.parameters)} | {_gb(p.gradients)} | "
            f"{_gb(p.optimizer)} | {_gb(p.parallel)} | {_gb(p.step)} | {_gb(r.fixed)} | "
            f"{', '.join(p.kernels) or '-'} | {why} |"
        )
    return "\n".join(lines)


def configurations(rows: Sequence[Row]) -> str:
    """Each row's configuration and source, as a Markdown list."""
    out = []
    for r in rows:
        extra = [STRATEGIES[r.strategy], r.state.describe]
        if r.fsdp:
            extra.append(f"FSDP over {r.fsdp.degree} ranks")
        if r.attention:
            extra.append(f"attention assumed: {r.attention}")
        if r.autocast:
            extra.append(Autocast(r.autocast).describe())
        if r.fixed:
            extra.append(f"{r.fixed_what} {fmt_bytes(r.fixed)} as published")
        out.append(
            f"- **{r.table} / {r.label}** ({r.device}): {r.config}. Predicted with: "
            f"{'; '.join(extra)}. Source: {r.source}"
        )
    return "\n".join(out)


NOTES = """\
- **Transformer Engine (Megatron's rows).** Megatron runs its layers through Transformer
  Engine: LayerNorm fused into the QKV and FC1 GEMMs, bias-GeLU and bias-dropout-add as fused
  kernels, and with the default attention backend TE's fused attention (cuDNN or
  FlashAttention-2), which keeps the output, the softmax statistics (one fp32 value per row
  and head) and the RNG state, as torch's flash kernel does. We trace Hugging Face's GPT-2 of
  the same shape with the GPU's device model instead: torch's flash kernel for the fused row,
  the matrix softmax for the unfused one, GeLU's tanh form as one op, CUDA's boolean dropout
  masks. Net of the loss (below), both peak rows come within 2% of their measurement (the
  residual analysis): what TE keeps beyond GPT-2's layers is not visible at this size.
- **The loss.** Each row computes its loss as its framework does: Megatron's vocab-parallel
  cross-entropy (fp32 softmax saved, updated in place by its backward), torchtitan's
  cross-entropy over `pred.float()`, the model's own loss for Hugging Face's classifier.
  Megatron's cross-entropy works in place on one fp32 copy of the logits; our tracer
  writes an in-place op on a tensor already read out of place, so two fp32 logits-sized
  tensors are live at once where Megatron holds one fp32 and one bf16 (the logits, or
  their gradient): 0.412 GB more on both Megatron peaks.
- **Reserved and NVML rows.** We predict what the allocator hands out (allocated, each
  storage rounded to 512 B). A reserved figure adds the allocator's cached free blocks, an
  NVML figure also the CUDA context (the Hugging Face page measured its own: 1343 MiB, added
  as published) and library workspaces; neither is in the prediction, so those rows are
  expected to come out under. `python -m bench.allocator_replay ROW` replays the caching
  allocator's rules over a row's traced step: for the Hugging Face steps it leaves reserved
  only about 0.2 GB over allocated, less than those rows' under-count.
- **Autocast (the Hugging Face fp16 rows).** The Trainer keeps fp32 weights and runs the
  forward and loss under `torch.cuda.amp.autocast`: each Linear's weight is cast to fp16
  once per forward and the cast kept in autocast's cache until the forward ends; addmm saves
  it for the backward. The trace holds those casts, and under gradient checkpointing (a
  no-grad forward that still caches) the step's peak counts them to the forward's end.
- **Adding a row** (a second table): append a `Row` to `ROWS` with the figure, what it
  counts, the device preset, a builder of the model and one step's call on the meta device,
  the strategy (store-all, every layer checkpointed, torchtitan's selective op policy, or none
  for what stays allocated between steps), the framework's bytes per parameter (`State`), its
  FSDP degree if any, and bytes the source measured outside the step. `remat bench --tables`
  predicts it; a row beyond 10% must say why (`Row.reason`).
"""


def _under(p: Prediction) -> int:
    """Bytes measured beyond the prediction (negative: predicted beyond the measurement)."""
    return p.row.measured - p.total


def _megatron_analysis(rows: dict[str, Prediction]) -> list[str]:
    out = []
    between = rows.get("between steps (mem-allocated-bytes), unfused")
    if between:
        out.append(
            f"Between steps Megatron holds {_under(between) / 1e6:.0f} MB beyond the "
            "parameters, the fp32 gradient buffer and the sharded optimizer state we predict "
            "(cuBLAS and Transformer Engine workspaces, bucket padding); they stay allocated "
            "through the step, so they are in both peaks too."
        )
    peaks = [(k, p) for k, p in rows.items() if k.startswith("peak")]
    for label, p in peaks:
        net = (p.total - _LOGITS_BF16 - p.row.measured) / p.row.measured
        out.append(
            f"{label.split(', ')[-1].capitalize()}: {p.residual:+.1%} as traced; "
            f"{net:+.1%} without the {_LOGITS_BF16 / 1e9:.3f} GB the trace's out-of-place "
            "cross-entropy holds beyond Megatron's in-place one."
        )
    if len(peaks) == 2:
        (_, a), (_, b) = peaks
        out.append(
            f"The two peaks differ by {(a.total - b.total) / 1e9:.2f} GB predicted and "
            f"{(a.row.measured - b.row.measured) / 1e9:.2f} GB measured: the attention "
            "matrix (softmax output, dropout mask and output, per layer) that the fused "
            "kernel never materialises."
        )
    return out


def _titan_analysis(rows: dict[str, Prediction]) -> list[str]:
    out = [
        f"{label}: {_under(p) / 1e9:.1f} GB under ({p.residual:+.1%}); the step traced is "
        f"{p.step / 1e9:.1f} GB of it."
        for label, p in rows.items()
    ]
    if len(rows) == 2:
        a, b = rows.values()
        out.append(
            f"The two rows differ by {(a.total - b.total) / 1e9:.2f} GB predicted and "
            f"{(a.row.measured - b.row.measured) / 1e9:.2f} GB measured, the sharded state "
            "(8 against 128 ranks): that part is modelled. The under-count, about the same "
            "in both, is put on what peak reserved counts beyond allocated (the rows' "
            "reason); no replay of the allocator checks that here."
        )
    return out


def _hf_analysis(rows: dict[str, Prediction]) -> list[str]:
    out = []
    loaded = rows.get("model loaded")
    if loaded:
        out.append(
            f"Model loaded: {loaded.residual:+.1%}: the weights and the page's own context "
            "reading account for the figure."
        )
    stepped = [(k, p) for k, p in rows.items() if p.step]
    if stepped:
        parts = "; ".join(
            f"{k}: {_under(p) / 1e9:.2f} GB under, {_under(p) / p.step:.0%} of the step's "
            f"{p.step / 1e9:.2f} GB"
            for k, p in stepped
        )
        out.append(
            f"Training rows: {parts}. The under-count grows with the step's activations. "
            "NVML counts the allocator's reserved segments, not what it handed out; but "
            "the allocator's rules replayed over the traced step (bench/allocator_replay.py: "
            "best fit, splits, 2 and 20 MiB segments, three iterations with AdamW's state "
            "made after the first) put reserved only 0.21 GB (fp32) and 0.16 GB (fp16) "
            "over allocated at batch 4, so what NVML counts beyond is not explained by the "
            "allocator as modelled: eager's own order of frees, library workspaces and "
            "module images are the candidates left."
        )
    fp32, fp16 = rows.get("vanilla, batch 4"), rows.get("batch 4, fp16")
    if fp32 and fp16:
        extra = _under(fp16) - _under(fp32)
        out.append(
            f"Batch 4 under fp16 is {_under(fp16) / 1e9:.2f} GB under against fp32's "
            f"{_under(fp32) / 1e9:.2f} GB: {extra / 1e9:.2f} GB more, "
            f"{(fp16.residual - fp32.residual) * 100:+.1f} points. Until the trace held "
            f"autocast's fp16 weight copies ({_BERT_LINEAR * 2 / 1e9:.3f} GB: the emulated "
            "cast cache was reused across the capture's two runs of the forward, so they "
            "were constants outside the step) the gap was 0.93 GB and 7 points (the table "
            "of 2026-11-27). The rest is not explained (the fp16 row's reason says what "
            "was ruled out)."
        )
    return out


# Each table's residual analysis: (the tables' common prefix, its paragraph's sentences)
ANALYSES: tuple[tuple[str, Callable[[dict[str, Prediction]], list[str]]], ...] = (
    ("Megatron-LM", _megatron_analysis),
    ("torchtitan", _titan_analysis),
    ("Hugging Face", _hf_analysis),
)


def residual_analysis(predictions: Sequence[Prediction]) -> str:
    """A paragraph per table: what its residuals consist of, computed from the rows
    predicted (refused rows left out)."""
    out = []
    for prefix, analyse in ANALYSES:
        rows = {
            p.row.label: p for p in predictions if p.row.table.startswith(prefix) and not p.refused
        }
        sentences = analyse(rows) if rows else []
        if sentences:
            out.append(f"- **{prefix}.** " + " ".join(sentences))
    return "\n".join(out)


def document(predictions: Sequence[Prediction], environment: str) -> str:
    """docs/gpu-tables.md: what each figure counts, the table, the configurations."""
    counts = "\n".join(f"- **{k}**: {v}" for k, v in COUNTS.items())
    unchecked = check(predictions)
    status = (
        f"Rows beyond {TOLERANCE:.0%} without a named reason: {', '.join(unchecked)}."
        if unchecked
        else f"Every row beyond {TOLERANCE:.0%} (or refused) names its reason."
    )
    return (
        "# Published GPU tables, predicted from their configurations\n\n"
        "Generated by `remat bench --tables --out docs/gpu-tables.md` (bench/gpu_tables.py): "
        "do not edit by hand. Each row is one published measurement, written down as its "
        "configuration (`bench.gpu_tables.ROWS`); the prediction is the whole step's: "
        "parameters, gradients and optimizer state per trainable parameter as the framework "
        "holds them, the parallelism's buffers, our planner's peak of activations and "
        "temporaries for the step traced on the meta device for the GPU's preset, and what "
        "the figure counts beyond the allocator. Residual = (predicted - measured) / "
        f"measured. GB = 1e9 bytes.\n\n{environment}\n\n"
        f"## What each figure counts\n\n{counts}\n\n"
        f"## The rows\n\n{markdown_table(predictions)}\n\n{status}\n\n"
        f"## Residual analysis\n\n{residual_analysis(predictions)}\n\n"
        f"## Notes\n\n{NOTES}\n"
        f"## Configurations and sources\n\n{configurations([p.row for p in predictions])}\n"
    )


def _environment() -> str:
    import transformers

    return (
        f"Run {_dt.date.today():%Y-%m-%d} on a CPU-only machine: torch {torch.__version__}, "
        f"transformers {transformers.__version__}; each step traced for its GPU's device model "
        "(`core.analyze(..., device=, attention=)`: the SDPA kernel torch's rules pick, CUDA's "
        "fused dropout, the caching allocator's 512 B rounding of every storage)."
    )


def main(argv: Sequence[str] | None = None) -> int:
    """`remat bench --tables [--out PATH] [--rows SUBSTRING]`."""
    p = argparse.ArgumentParser(prog="remat bench --tables", description=__doc__)
    p.add_argument("--out", help="write the Markdown document here (docs/gpu-tables.md)")
    p.add_argument("--rows", help="only rows whose table or label contains this text")
    args = p.parse_args(list(argv) if argv is not None else None)
    rows = [r for r in ROWS if not args.rows or args.rows.lower() in f"{r.table} {r.label}".lower()]
    predictions = predict_all(rows, log=lambda text: print(text, flush=True))
    print(markdown_table(predictions))
    missing = check(predictions)
    if args.out:
        Path(args.out).write_text(document(predictions, _environment()))
        print(f"wrote {args.out}")
    if missing:
        print(f"rows beyond {TOLERANCE:.0%} with no reason named: {', '.join(missing)}")
        return 1
    return 0


__all__ = [
    "COUNTS",
    "FSDP",
    "ROWS",
    "STRATEGIES",
    "TOLERANCE",
    "Prediction",
    "Row",
    "State",
    "autocast_cached",
    "check",
    "document",
    "hf_model",
    "main",
    "markdown_table",
    "predict",
    "predict_all",
    "residual_analysis",
    "selective_op_plan",
    "step_peak",
    "strategy_plan",
]
