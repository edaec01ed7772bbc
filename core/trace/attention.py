"""Which kernel `F.scaled_dot_product_attention` runs on the device a step is planned for, and
that kernel in the trace.

A step traced on CPU or the meta device for a GPU would otherwise hold CPU's attention: on
CPU, and on meta (no fused kernel there), the math path keeps batch x heads x s x s scores
and probabilities, which a GPU's flash kernel never makes. So while a step is traced for a
target other than the tensors' own device, `AttentionMode` answers each call as PyTorch's
dispatcher would on that target: it picks the backend by torch's own rules and calls the
backend's ATen op as `scaled_dot_product_attention` does, so the trace holds the kernel's
real outputs and saved tensors (out, log-sum-exp, the dropout RNG seed and offset), sized by
torch's meta kernels (`torch/_meta_registrations.py`), and autograd records the matching
backward kernel (`_scaled_dot_product_flash_attention_backward`, ...). Tensors on the
target's own device type are left to torch (a CPU trace for CPU holds what CPU eager runs).

The rules, from pytorch/pytorch (main, read 2026-11-27; torch 2.13 here):
- `aten/src/ATen/native/transformers/cuda/sdp_utils.cpp`: `select_sdp_backend` walks the
  priority order (`torch._C._get_sdp_priority_order()`: flash, efficient, math, cuDNN by
  default; cuDNN first on sm90/sm100 when the runtime cuDNN is newer than 9.15,
  `check_prefer_cudnn_attention`) and takes the first backend whose checks pass:
  `can_use_flash_attention`, `can_use_mem_efficient_attention`, `can_use_cudnn_attention`.
- `aten/src/ATen/native/transformers/sdp_utils_cpp.h`: the checks they share (4-d inputs,
  batch and heads, grouped-query heads, zero lengths, last-dim stride, mask shape, dtypes,
  the `torch.backends.cuda.enable_*_sdp` switches).
- `aten/src/ATen/native/transformers/sdp_utils_cpp.cpp`: CPU's rule (flash for CPU unless
  dropout, nested inputs or a bad shape; else math).
- `aten/src/ATen/native/transformers/attention.cpp`: `scaled_dot_product_attention` converts a
  boolean mask to an additive one (`at::where`), pads the head dim to 8 for flash and the mask
  for mem-efficient (`preprocess_mask`), and asks for the log-sum-exp only when an input needs
  a gradient (`should_compute_logsumexp`).
What CPU cannot know is assumed and said: the runtime cuDNN version (cuDNN attention comes
first only with cuDNN > 9.15; `attention="cudnn"` assumes it), and whether the GPU's torch
was built with flash and mem-efficient attention (the CUDA wheels are). One departure from
main: torch 2.13's meta kernel for mem-efficient attention's backward returns key and value
gradients with the query's head count, which autograd rejects for grouped-query inputs, so
grouped-query calls are not given to mem-efficient attention here (they take the next
backend, and the note says so).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from core.trace.cuda_autocast import cached_cast, emulated_dtype

# the kernels a user may assume, by the names PyTorch users know
KERNELS = ("flash", "efficient", "cudnn", "math")
NAMES = {
    "flash": "flash attention",
    "efficient": "memory-efficient attention",
    "cudnn": "cuDNN attention",
    "math": "math attention (the s x s matrix)",
}
# torch._C._SDPBackend values (sdp_utils_cpp.h's SDPBackend) -> our names
_BACKENDS = {0: "math", 1: "flash", 2: "efficient", 3: "cudnn"}
_HALF = (torch.float16, torch.bfloat16)
# backward kernels torch tags `nondeterministic_seeded` that draw no numbers of their own:
# they replay the dropout of their forward from the seed and offset it saved, so a trace
# treats them as plain ops (a random op runs once, in the forward)
REPLAYS_SAVED_SEED = frozenset(
    {
        torch.ops.aten._scaled_dot_product_efficient_attention_backward.default,
        torch.ops.aten._scaled_dot_product_cudnn_attention_backward.default,
    }
)


@dataclass(frozen=True)
class Target:
    """The device a step is traced for: its type ("cuda" or "cpu") and, for a GPU, its
    compute capability; `prefer` is the kernel the user assumes first ("auto": torch's order)."""

    type: str
    capability: tuple[int, int] | None = None
    prefer: str = "auto"


@dataclass(frozen=True)
class Choice:
    """One attention call's kernel, and what it was picked on."""

    kernel: str  # one of KERNELS
    dtype: str
    head_dim: int
    seq: int  # the query's length
    why: str  # "" when the rules decided alone; else what was assumed


@dataclass(frozen=True)
class _Call:
    """The arguments of one `scaled_dot_product_attention` call (sdp_params)."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    mask: torch.Tensor | None
    dropout: float
    causal: bool
    scale: float | None
    gqa: bool

    @property
    def needs_grad(self) -> bool:
        """`input_requires_grad`: an input requires grad and grad mode is on."""
        any_grad = self.q.requires_grad or self.k.requires_grad or self.v.requires_grad
        return any_grad and torch.is_grad_enabled()


def select(call: _Call, target: Target) -> tuple[str, str]:
    """The backend torch picks for `call` on `target`, and what was assumed ("" if nothing)."""
    if target.type != "cuda":
        return _select_cpu(call), ""
    order = [_BACKENDS[b] for b in torch._C._get_sdp_priority_order() if b in _BACKENDS]
    why = ""
    if target.prefer != "auto":
        order = [target.prefer] + [b for b in order if b != target.prefer]
        why = f"{NAMES[target.prefer]} assumed first"
    checks: dict[str, Callable[[_Call, tuple[int, int]], bool]] = {
        "flash": _can_flash,
        "efficient": _can_efficient,
        "cudnn": _can_cudnn,
        "math": lambda c, cap: torch.backends.cuda.math_sdp_enabled(),
    }
    capability = target.capability or (0, 0)
    for backend in order:
        if checks[backend](call, capability):
            return backend, why
    raise RuntimeError("scaled_dot_product_attention: no available kernel (all are disabled)")


def _select_cpu(call: _Call) -> str:
    """`select_sdp_backend_cpp`: flash for CPU where its checks pass, else math."""
    ok = (
        torch.backends.cuda.flash_sdp_enabled()
        and call.dropout == 0.0
        and _shapes_4d(call)
        and _batch_and_heads(call, gqa_ok=True)
        and _mask_shape_ok(call)
        and call.q.shape[-1] == call.k.shape[-1] == call.v.shape[-1]
        and _nonzero_lengths(call)
        and _last_dim_stride_1(call, ignore_singleton=False, cpu=True)
        and _same_dtype(call, (torch.float32, torch.float64, torch.bfloat16, torch.float16))
    )
    return "flash" if ok else "math"


def _can_flash(c: _Call, cap: tuple[int, int]) -> bool:
    """`can_use_flash_attention` for dense inputs."""
    d = c.q.shape[-1] if c.q.dim() else 0
    return (
        torch.backends.cuda.flash_sdp_enabled()
        and _shapes_4d(c)
        and c.mask is None  # check_for_attn_mask
        and c.q.shape[-1] == c.k.shape[-1] == c.v.shape[-1]
        and d <= 256  # check_head_dim_size_flash
        and (8, 0) <= cap <= (12, 1)  # check_flash_attention_hardware_support
        and _sm86_89_120_head_dim_ok(c, cap)
        and not (c.causal and c.q.shape[-2] != c.k.shape[-2])  # non-square causal
        and _dtypes_low_precision(c, cap)
        and _batch_and_heads(c, gqa_ok=True)
        and _nonzero_lengths(c)
        and _last_dim_stride_1(c, ignore_singleton=True)
    )


def _can_efficient(c: _Call, cap: tuple[int, int]) -> bool:
    """`can_use_mem_efficient_attention` for dense inputs (grouped-query: see the module
    docstring)."""
    if not (torch.backends.cuda.mem_efficient_sdp_enabled() and _shapes_4d(c)):
        return False
    if not (5, 0) <= cap <= (12, 1):  # check_mem_efficient_hardware_support
        return False
    align = _gemm_alignment(c, cap)
    dq, dk, dv = c.q.shape[-1], c.k.shape[-1], c.v.shape[-1]
    if not (dq == dk and dq % align == 0 and dq > 0 and dv % align == 0 and dv > 0):
        return False  # check_head_dim_size_mem_efficient
    if cap >= (8, 0):  # check_data_ptr_alignment_mem_efficient
        align_bytes = align * c.q.element_size()
        for t in (c.q, c.k, c.v):
            if t.numel() and (t.storage_offset() * t.element_size()) % align_bytes:
                return False
    dtypes: tuple[torch.dtype, ...] = (torch.float16, torch.float32)
    if cap >= (8, 0):
        dtypes = (torch.float16, torch.float32, torch.bfloat16)
    return (
        _nonzero_lengths(c)
        and _last_dim_stride_1(c, ignore_singleton=False)
        and _batch_and_heads(c, gqa_ok=False)
        and _same_dtype(c, dtypes)
    )


def _can_cudnn(c: _Call, cap: tuple[int, int]) -> bool:
    """`can_use_cudnn_attention` for dense inputs, assuming a cuDNN of 9.15 or newer (the
    version is the GPU machine's; `attention="cudnn"` is where a user asserts it)."""
    if not (torch.backends.cuda.cudnn_sdp_enabled() and _shapes_4d(c)):
        return False
    if torch.are_deterministic_algorithms_enabled() and not (
        torch.is_deterministic_algorithms_warn_only_enabled()
    ):
        return False
    sm90_or_10x = cap[0] == 10 or cap == (9, 0)
    limit = 256 if sm90_or_10x else 128
    dqk, dv, sk, sq = c.q.shape[-1], c.v.shape[-1], c.k.shape[-2], c.q.shape[-2]
    bprop_ok = not c.needs_grad or not sm90_or_10x or (dqk <= 128 and dv <= 128)
    bprop_ok = bprop_ok or (dqk, dv) in ((192, 128), (256, 256))
    return (
        _dtypes_low_precision(c, cap)
        and _mask_shape_ok(c)
        and (8, 0) <= cap <= (12, 1)
        and c.dropout * 16.0 == math.floor(c.dropout * 16.0)
        and _nonzero_lengths(c)
        and _last_dim_stride_1(c, ignore_singleton=True)
        and _batch_and_heads(c, gqa_ok=True)
        and c.q.shape[0] <= 65535
        and c.q.shape[1] <= 65535
        and dqk <= limit
        and dv <= limit
        and dqk % 8 == 0
        and dv % 8 == 0
        and sk != 1
        and not (c.dropout != 0.0 and sq == 1)
        and bprop_ok
    )


def _shapes_4d(c: _Call) -> bool:
    return c.q.dim() == c.k.dim() == c.v.dim() == 4


def _batch_and_heads(c: _Call, gqa_ok: bool) -> bool:
    """`check_batch_size_and_num_heads_dense`: one batch size; one head count, or with
    `enable_gqa` key/value heads (equal) dividing the query's."""
    if not c.q.shape[0] == c.k.shape[0] == c.v.shape[0]:
        return False
    hq, hk, hv = c.q.shape[-3], c.k.shape[-3], c.v.shape[-3]
    if c.gqa and gqa_ok:
        return hk == hv and hq % hk == 0
    return hq == hk == hv


def _nonzero_lengths(c: _Call) -> bool:
    return c.q.shape[-2] != 0 and c.k.shape[-2] != 0


def _last_dim_stride_1(c: _Call, ignore_singleton: bool, cpu: bool = False) -> bool:
    ok = c.q.stride(-1) == 1 and c.k.stride(-1) == 1 and c.v.stride(-1) == 1
    if ignore_singleton:
        ok = ok or c.q.shape[-1] == 1
    mask_ok = cpu or c.mask is None or c.mask.stride(-1) == 1
    return ok and mask_ok


def _mask_shape_ok(c: _Call) -> bool:
    """`check_attn_mask_shape`."""
    m = c.mask
    if m is None:
        return True
    if m.requires_grad:
        return False
    if m.shape[-2] not in (c.q.shape[2], 1) or m.shape[-1] not in (c.k.shape[2], 1):
        return False
    if m.dim() == 2:
        return True
    return m.dim() == 4 and m.shape[0] in (1, c.q.shape[0]) and m.shape[1] in (1, c.q.shape[1])


def _same_dtype(c: _Call, allowed: tuple[torch.dtype, ...]) -> bool:
    return c.q.dtype == c.k.dtype == c.v.dtype and c.q.dtype in allowed


def _dtypes_low_precision(c: _Call, cap: tuple[int, int]) -> bool:
    """fp16 and bf16 from sm80, fp16 only below."""
    return _same_dtype(c, _HALF if cap >= (8, 0) else (torch.float16,))


def _sm86_89_120_head_dim_ok(c: _Call, cap: tuple[int, int]) -> bool:
    """Flash's backward on sm86-sm89 and sm120-121 refuses head dims in (192, 224], and in
    (224, 256] with dropout."""
    if not c.needs_grad or not ((8, 6) <= cap <= (8, 9) or (12, 0) <= cap <= (12, 1)):
        return True
    d = c.q.shape[-1]
    return d <= 192 or (c.dropout == 0.0 and d > 224)


def _gemm_alignment(c: _Call, cap: tuple[int, int]) -> int:
    """`minimum_gemm_alignment`: the head dim's required multiple for mem-efficient."""
    half = c.q.dtype in _HALF
    tensor_cores = cap[0] >= 8 or (cap[0] >= 7 and half)
    align = 4 if cap[0] >= 8 else 1
    if tensor_cores:
        align = max(align, 128 // (16 if half else 32))
    return align


# --- the kernel, as attention.cpp calls it --------------------------------------------------


def run(call: _Call, kernel: str, device_type: str) -> torch.Tensor:
    """`scaled_dot_product_attention`'s body for the chosen backend on `device_type`."""
    q, k, v = call.q, call.k, call.v
    if kernel == "cudnn":
        mask = _additive_mask(call.mask, q.dtype, -65504.0)
        out = torch.ops.aten._scaled_dot_product_cudnn_attention(
            q, k, v, mask, call.needs_grad, call.dropout, call.causal, False, scale=call.scale
        )
        return out[0]
    mask = _additive_mask(call.mask, q.dtype, -math.inf)
    if kernel == "flash" and device_type == "cuda":
        d = q.shape[-1]
        scale = call.scale if call.scale is not None else 1.0 / math.sqrt(d)
        qp, kp, vp = (_pad_last_dim(t, 8) for t in (q, k, v))
        out = torch.ops.aten._scaled_dot_product_flash_attention(
            qp, kp, vp, call.dropout, call.causal, False, scale=scale
        )[0]
        return out[..., :d] if out.shape[-1] != d else out
    if kernel == "flash":
        return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            q, k, v, call.dropout, call.causal, attn_mask=mask, scale=call.scale
        )[0]
    if kernel == "efficient":
        if mask is not None:
            mask = _preprocess_mask(mask, q, k)
        return torch.ops.aten._scaled_dot_product_efficient_attention(
            q, k, v, mask, call.needs_grad, call.dropout, call.causal, scale=call.scale
        )[0]
    if device_type == "cuda" and call.dropout > 0.0:  # its dropout is CUDA's fused kernel
        return math_attention(
            call, mask, lambda t: torch.ops.aten.native_dropout(t, call.dropout, True)[0]
        )
    return torch.ops.aten._scaled_dot_product_attention_math(
        q, k, v, mask, call.dropout, call.causal, scale=call.scale, enable_gqa=call.gqa
    )[0]


def math_attention(
    call: _Call, mask: torch.Tensor | None, dropout: Callable[[torch.Tensor], torch.Tensor]
) -> torch.Tensor:
    """`_scaled_dot_product_attention_math` (attention.cpp) op for op, with its dropout as
    `dropout`: the composite's inner `at::dropout` is CUDA's fused `native_dropout` on a GPU,
    which CPU tensors would not take."""
    q, k, v = call.q, call.k, call.v
    origin = q.dtype
    keep = torch._C._get_math_sdp_allow_fp16_bf16_reduction()
    q, k, v = (t if keep or t.dtype not in _HALF else t.to(torch.float32) for t in (q, k, v))
    negative = call.scale is not None and call.scale < 0
    scale = abs(call.scale) if negative and call.scale is not None else call.scale
    factor = math.sqrt(scale if scale is not None else 1.0 / math.sqrt(q.shape[-1]))
    mul = torch.ops.aten.mul.Scalar  # C++'s tensor * SymFloat, not Python's mul.Tensor
    query = mul(q, 0.0 - factor if negative else factor)
    if call.causal:
        ones = torch.ones(query.shape[-2], k.shape[-2], dtype=torch.bool, device=query.device)
        mask = _additive_mask(ones.tril(), query.dtype, -math.inf)
    if call.gqa and not q.shape[-3] == k.shape[-3] == v.shape[-3]:
        k = k.repeat_interleave(q.shape[-3] // k.shape[-3], -3)
        v = v.repeat_interleave(q.shape[-3] // v.shape[-3], -3)
    attn = torch.matmul(query, mul(k.transpose(-2, -1), factor))
    if mask is not None:
        attn = attn.add(mask)  # FakeTensors are subclass-like: out of place, as torch does
    attn = torch.ops.aten._safe_softmax(attn, -1)
    if call.dropout > 0.0:
        attn = dropout(attn)
    attn.to(origin)  # the composite's second result, made (first: GCC's argument order) and dropped
    return torch.matmul(attn, v).to(origin)


def _additive_mask(
    mask: torch.Tensor | None, dtype: torch.dtype, neg_inf: float
) -> torch.Tensor | None:
    """`convert_boolean_attn_mask`: a boolean mask as 0 where kept, `neg_inf` where not."""
    if mask is None or mask.dtype != torch.bool:
        return mask
    return torch.where(mask, 0.0, torch.scalar_tensor(neg_inf, dtype=dtype, device=mask.device))


def _pad_last_dim(t: torch.Tensor, alignment: int) -> torch.Tensor:
    """`pad_last_dim<alignment, false>`: zero-pad the last dim to a multiple."""
    rest = t.shape[-1] % alignment
    return t if rest == 0 else F.pad(t, (0, alignment - rest))


def _preprocess_mask(mask: torch.Tensor, q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """`preprocess_mask`: mem-efficient's bias, padded (then sliced back) unless every stride
    but the last is a multiple of 8 and the last is 1 (`aligned_tensor<8>`), expanded to
    (batch, heads, L, S)."""
    aligned = all(mask.stride(i) % 8 == 0 for i in range(mask.dim() - 1))
    if not (aligned and mask.stride(-1) == 1):
        last = mask.shape[-1]
        mask = F.pad(mask, (0, 8 - last % 8))[..., :last]  # pad_bias<8>
    return mask.expand(q.shape[0], q.shape[1], q.shape[2], k.shape[2])


# --- the hook into a trace ------------------------------------------------------------------


def attention_kernel(
    *args: Any,
    device_type: str = "cuda",
    capability: tuple[int, int] | None = (9, 0),
    attention: str = "auto",
    **kwargs: Any,
) -> str:
    """The kernel `F.scaled_dot_product_attention(*args, **kwargs)` runs on a device of
    `device_type` and compute `capability` by torch's rules, as a plan traced elsewhere for
    it assumes: "flash", "efficient", "cudnn" or "math". The tensors only lend their
    shapes, dtypes, strides and whether they need gradients (meta tensors do);
    `attention` is the kernel assumed first ("auto": torch's order)."""
    return select(_bind(*args, **kwargs), Target(device_type, capability, attention))[0]


class AttentionMode(TorchFunctionMode):
    """While active, `F.scaled_dot_product_attention` on tensors not on `target`'s device
    type runs the kernel `target` would (`select`, `run`); `choices` lists each call's."""

    def __init__(self, target: Target) -> None:
        super().__init__()
        self.target = target
        self.choices: list[Choice] = []

    def __enter__(self) -> AttentionMode:
        self.choices = []  # a step traced twice reports its calls once
        return super().__enter__()

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if func is not F.scaled_dot_product_attention:
            return func(*args, **kwargs)
        call = _bind(*args, **kwargs)
        if call.q.device.type == self.target.type:
            return func(*args, **kwargs)  # torch's own dispatcher decides
        call = _autocast(call)
        kernel, why = select(call, self.target)
        if self.target.prefer not in ("auto", kernel):
            why = f"{NAMES[self.target.prefer]} assumed, not possible here"
        d = int(call.q.shape[-1]) if call.q.dim() else 0
        seq = int(call.q.shape[-2]) if call.q.dim() > 1 else 0
        self.choices.append(Choice(kernel, str(call.q.dtype).removeprefix("torch."), d, seq, why))
        return run(call, kernel, self.target.type)


def _autocast(call: _Call) -> _Call:
    """The call as CUDA autocast passes it on (core.trace.cuda_autocast: SDPA is on its
    lower-precision list), when the trace emulates it."""

    dtype = emulated_dtype()
    if dtype is None:
        return call
    q, k, v = (cached_cast(dtype, t) for t in (call.q, call.k, call.v))
    mask = cached_cast(dtype, call.mask) if call.mask is not None else None
    return _Call(q, k, v, mask, call.dropout, call.causal, call.scale, call.gqa)


def _bind(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attn_mask: torch.Tensor | None = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
) -> _Call:
    return _Call(query, key, value, attn_mask, float(dropout_p), is_causal, scale, enable_gqa)


def describe(choices: list[Choice], device: str) -> str:
    """'flash attention (assumed for h100, bfloat16, head dim 128) in 32 calls': the
    kernels a trace holds, for the problem's note. Empty when it holds no attention call."""
    groups: dict[tuple[str, str, int, str], int] = {}
    for c in choices:
        key = (c.kernel, c.dtype, c.head_dim, c.why)
        groups[key] = groups.get(key, 0) + 1
    parts = []
    for (kernel, dtype, d, why), n in groups.items():
        extra = f"; {why}" if why else ""
        calls = f" in {n} calls" if n > 1 else ""
        parts.append(f"{NAMES[kernel]} (assumed for {device}, {dtype}, head dim {d}{extra}){calls}")
    return "; ".join(parts)
