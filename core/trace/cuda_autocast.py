"""CUDA's autocast policy, applied to CPU or meta tensors while a step is traced for a GPU.

`torch.autocast("cuda")` casts only CUDA tensors (`is_autocast_eligible` in
ATen/autocast_mode.h) and is disabled on a build without CUDA, and CPU's autocast has other
lists: it runs softmax, layer norm, `exp` or `sum` in bf16 where CUDA's runs them in fp32.
So a GPU step traced on this machine under autocast is traced here with CUDA's lists, as
torch 2.13's ATen/autocast_mode.h defines them (`AT_FORALL_LOWER_PRECISION_FP`,
`AT_FORALL_FP32`, `AT_FORALL_FP32_SET_OPT_DTYPE`, `AT_FORALL_DIFFERENT_REDISPATCH_SIGNATURE`,
`AT_FORALL_PROMOTE`; `binary_cross_entropy` refused) and its wrappers' rules (autocast_mode.h
`WrapFunction_`, autocast_mode.cpp `cached_cast`: every floating, non-double tensor argument
is eligible; fp32 weights that are leaves needing grad are cast once per forward).

How: the AutocastCPU dispatch key is switched on (in this thread's included keys) and given
a kernel per listed op: through the Python dispatcher (this thread
only) where CPU's autocast has a C++ kernel of its own, and through a `torch.library` kernel
(registered while a trace runs; outside this thread's trace it only passes through, as
CPU's fallthrough would) where it has none. CPU's own list entries that CUDA lacks pass
through. With the Python dispatcher on, torch's Python decompositions of a few composite ops
run in place of their C++ ones. On meta tensors those decompositions (nll_loss's) cut the
loss's backward, so `core.trace.capture` applies this to CPU tensors only and refuses a meta
model under CUDA autocast by name.
"""

from __future__ import annotations

import contextlib
import threading
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch._C import DispatchKey, DispatchKeySet
from torch._dispatch.python import enable_python_dispatcher
from torch.utils._pytree import tree_map

_KEY = DispatchKey.AutocastCPU
# ATen/autocast_mode.h, torch 2.13: (op, overload) per policy; "" is the default overload
LOWER_PRECISION_FP = (
    ("_convolution", "deprecated"),
    ("_convolution", ""),
    ("conv1d", ""),
    ("conv2d", ""),
    ("conv3d", ""),
    ("conv_tbc", ""),
    ("conv_transpose1d", ""),
    ("conv_transpose2d", "input"),
    ("conv_transpose3d", "input"),
    ("convolution", ""),
    ("prelu", ""),
    ("addmm", ""),
    ("addmv", ""),
    ("addr", ""),
    ("matmul", ""),
    ("einsum", ""),
    ("mm", ""),
    ("mv", ""),
    ("linalg_vecdot", ""),
    ("linear", ""),
    ("addbmm", ""),
    ("baddbmm", ""),
    ("bmm", ""),
    ("chain_matmul", ""),
    ("linalg_multi_dot", ""),
    ("_thnn_fused_lstm_cell", ""),
    ("_thnn_fused_gru_cell", ""),
    ("lstm_cell", ""),
    ("gru_cell", ""),
    ("rnn_tanh_cell", ""),
    ("rnn_relu_cell", ""),
    ("_scaled_dot_product_flash_attention", ""),
    ("scaled_dot_product_attention", ""),
    ("cudnn_convolution", ""),
    ("cudnn_convolution_transpose", ""),
)
FP32 = tuple(
    (name, overload)
    for entry in (
        "acos asin cosh erfinv exp expm1 log log10 log2 log1p reciprocal rsqrt sinh tan "
        "pow.Tensor_Scalar pow.Tensor_Tensor pow.Scalar softplus layer_norm native_layer_norm "
        "rms_norm group_norm frobenius_norm.dim nuclear_norm nuclear_norm.dim cosine_similarity "
        "poisson_nll_loss cosine_embedding_loss nll_loss nll_loss2d hinge_embedding_loss kl_div "
        "l1_loss smooth_l1_loss huber_loss mse_loss margin_ranking_loss multilabel_margin_loss "
        "soft_margin_loss triplet_margin_loss multi_margin_loss "
        "binary_cross_entropy_with_logits dist pdist cdist renorm logsumexp upsample_nearest1d "
        "_upsample_nearest_exact1d upsample_nearest2d _upsample_nearest_exact2d "
        "upsample_nearest3d _upsample_nearest_exact3d upsample_linear1d upsample_bilinear2d "
        "_upsample_bilinear2d_aa upsample_trilinear3d upsample_bicubic2d _upsample_bicubic2d_aa"
    ).split()
    for name, _, overload in [entry.partition(".")]
)
FP32_SET_OPT_DTYPE = (
    ("prod", ""),
    ("prod", "dim_int"),
    ("softmax", "int"),
    ("log_softmax", "int"),
    ("cumprod", ""),
    ("cumsum", ""),
    ("linalg_vector_norm", ""),
    ("linalg_matrix_norm", ""),
    ("linalg_matrix_norm", "str_ord"),
    ("sum", ""),
    ("sum", "dim_IntList"),
)
FP32_APPEND_DTYPE = {
    ("norm", "Scalar"): "ScalarOpt_dtype",
    ("norm", "ScalarOpt_dim"): "ScalarOpt_dim_dtype",
}
PROMOTE = tuple(
    (n, "")
    for n in "addcdiv addcmul atan2 bilinear cross dot vdot grid_sampler index_put tensordot "
    "scatter_add".split()
)
BANNED = (("binary_cross_entropy", ""),)


class _State(threading.local):
    dtype: torch.dtype | None = None  # the autocast dtype while this thread emulates
    cache: dict[int, tuple[weakref.ref, torch.Tensor]]


_STATE = _State()
_LOCK = threading.Lock()
_installed = False
_HAS_CPU_KERNEL: set[torch._ops.OpOverload] = set()  # CPU autocast's own C++ kernels


def emulated_dtype() -> torch.dtype | None:
    """The dtype CUDA autocast casts to in this thread's trace, or None."""
    return _STATE.dtype


@contextlib.contextmanager
def cuda_autocast(dtype: torch.dtype) -> Iterator[None]:
    """Trace under CUDA autocast to `dtype` on tensors of any device (this thread)."""
    _install()
    library = _fallthrough_kernels()
    _STATE.dtype, _STATE.cache = dtype, {}
    included = torch._C._dispatch_tls_is_dispatch_key_included(_KEY)
    excluded = torch._C._dispatch_tls_is_dispatch_key_excluded(_KEY)
    try:
        with enable_python_dispatcher():
            torch._C._dispatch_tls_set_dispatch_key_included(_KEY, True)
            torch._C._dispatch_tls_set_dispatch_key_excluded(_KEY, False)
            yield
    finally:
        torch._C._dispatch_tls_set_dispatch_key_included(_KEY, included)
        torch._C._dispatch_tls_set_dispatch_key_excluded(_KEY, excluded)
        _STATE.dtype, _STATE.cache = None, {}
        library._destroy()


def eligible(t: Any) -> bool:
    """`is_eligible` for a tensor standing for a CUDA one: floating, not double."""
    return isinstance(t, torch.Tensor) and t.is_floating_point() and t.dtype != torch.float64


def cached_cast(to: torch.dtype, arg: Any) -> Any:
    """`cached_cast`: an eligible tensor in `to`; an fp32 leaf needing grad cast once while
    autocast's cache is enabled (`can_try_cache` in ATen/autocast_mode.cpp), until
    `clear_cache` (the outermost autocast's exit)."""
    if not eligible(arg) or arg.dtype == to:
        return arg
    cache = _STATE.cache
    if (
        to == _STATE.dtype
        and arg.dtype == torch.float32
        and arg.requires_grad
        and arg.is_leaf
        and not arg._is_view()
        and torch.is_autocast_cache_enabled()
    ):
        hit = cache.get(id(arg))
        if hit is not None and hit[0]() is arg:
            return hit[1]
        cast = arg.to(to)
        cache[id(arg)] = (weakref.ref(arg), cast)
        return cast
    return arg.to(to)


def clear_cache() -> None:
    """Forget this thread's cached casts, as `torch.clear_autocast_cache()` does torch's own:
    a cast made in one run of the forward (another trace's, or an untraced run) is never a
    cast of the next. Without this a traced forward reused the casts of the run before it,
    which the trace then held as constants made outside the step: the lower-precision copy
    of every weight (BERT-large in fp16: 0.6 GB held into the backward) went uncounted."""
    _STATE.cache = {}


def _op(name: str, overload: str) -> torch._ops.OpOverload | None:
    packet = getattr(torch.ops.aten, name, None)
    return getattr(packet, overload or "default", None) if packet is not None else None


def _excluded() -> Any:
    return torch._C._ExcludeDispatchKeyGuard(DispatchKeySet(_KEY))


def _policy_kernel(op: torch._ops.OpOverload, policy: str, other: Any = None) -> Callable:
    """The kernel of `op` under one of CUDA's policies (ATen/autocast_mode.h WrapFunction_)."""

    def kernel(*args: Any, **kwargs: Any) -> Any:
        dtype = _STATE.dtype
        if dtype is None:  # another thread's Python dispatcher: CPU's own behaviour
            return _passthrough(op)(*args, **kwargs)
        with _excluded():
            if policy == "lower":
                cast = lambda a: cached_cast(dtype, a)  # noqa: E731
                return op(*tree_map(cast, args), **tree_map(cast, kwargs))
            if policy == "fp32":
                cast = lambda a: cached_cast(torch.float32, a)  # noqa: E731
                return op(*tree_map(cast, args), **tree_map(cast, kwargs))
            if policy == "promote":
                to = dtype
                for a in torch.utils._pytree.tree_leaves((args, kwargs)):
                    if eligible(a):
                        to = torch.promote_types(to, a.dtype)
                cast = lambda a: cached_cast(to, a)  # noqa: E731
                return op(*tree_map(cast, args), **tree_map(cast, kwargs))
            first = args[0] if args else None
            if not eligible(first):
                return op(*args, **kwargs)
            if policy == "set_opt_dtype":
                if kwargs.get("dtype") is None:
                    kwargs = {**kwargs, "dtype": torch.float32}
                return op(*args, **kwargs)
            if policy == "append_dtype":
                return other(*args, dtype=torch.float32, **kwargs)
            raise RuntimeError(  # banned
                "torch.nn.functional.binary_cross_entropy and torch.nn.BCELoss are unsafe to "
                "autocast: use binary_cross_entropy_with_logits (CUDA autocast refuses it)"
            )

    return kernel


def _passthrough(op: torch._ops.OpOverload) -> Callable:
    def kernel(*args: Any, **kwargs: Any) -> Any:
        if _STATE.dtype is None and op in _HAS_CPU_KERNEL:
            return op._op_dk(_KEY, *args, **kwargs)  # CPU autocast's own C++ kernel
        with _excluded():
            return op(*args, **kwargs)

    return kernel


def _table() -> dict[torch._ops.OpOverload, Callable]:
    """Every op CUDA's lists name, with its policy's kernel; CPU-only entries pass through."""
    table: dict[torch._ops.OpOverload, Callable] = {}
    for policy, entries in (
        ("lower", LOWER_PRECISION_FP),
        ("fp32", FP32),
        ("set_opt_dtype", FP32_SET_OPT_DTYPE),
        ("promote", PROMOTE),
        ("banned", BANNED),
    ):
        for name, overload in entries:
            op = _op(name, overload)
            if op is not None:
                table[op] = _policy_kernel(op, policy)
    for (name, overload), target in FP32_APPEND_DTYPE.items():
        op, other = _op(name, overload), _op(name, target)
        if op is not None and other is not None:
            table[op] = _policy_kernel(op, "append_dtype", other)
    for name in torch._C._dispatch_get_all_op_names():
        if name.startswith("aten::") and torch._C._dispatch_has_kernel_for_dispatch_key(name, _KEY):
            base, _, overload = name.removeprefix("aten::").partition(".")
            op = _op(base, overload)
            if op is not None and op not in table:
                table[op] = _passthrough(op)
    return table


_TABLE: dict[torch._ops.OpOverload, Callable] = {}


def _install() -> None:
    """Python-dispatcher kernels for the ops CPU's autocast has C++ kernels for, once."""
    global _installed
    with _LOCK:
        if _installed:
            return
        _TABLE.update(_table())
        for op, kernel in _TABLE.items():
            if torch._C._dispatch_has_kernel_for_dispatch_key(op.name(), _KEY):
                _HAS_CPU_KERNEL.add(op)
                op.py_impl(_KEY)(kernel)
        _installed = True


def _fallthrough_kernels() -> torch.library.Library:
    """`torch.library` kernels, for this trace, for the listed ops that CPU's autocast lets
    fall through (no C++ kernel to take over from the Python dispatcher)."""
    library = torch.library.Library("aten", "IMPL")
    for op, kernel in _TABLE.items():
        if op not in _HAS_CPU_KERNEL:
            name = op.name().removeprefix("aten::")
            library.impl(name, kernel, "AutocastCPU")
    return library
