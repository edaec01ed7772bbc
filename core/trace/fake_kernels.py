"""Fake (shape) kernels for ATen ops whose meta kernel in this torch refuses what the device's
own kernel runs, so that a model that trains eagerly can also be traced under fake tensors.

`aten._grouped_mm` (transformers' default `grouped_mm` mixture-of-experts experts): its meta
kernel copies the CUDA fast path's checks and refuses anything but bfloat16, while the CPU
kernel (`_grouped_mm_fallback`, a loop of `mm` over the groups) takes float32, bfloat16 and
float16. On CPU the fake kernel here checks what that kernel checks
(ATen/native/GroupedMMUtils.h `_grouped_mm_validate_inputs`) and makes the output as
`create_grouped_gemm_output_tensor` does: rows padded to 16 bytes, so the storage, and so the
planned bytes, are the kernel's. Other devices keep torch's meta kernel.

`register()` is idempotent; `core.trace.capture` calls it before tracing.
"""

from __future__ import annotations

import threading

import torch

_lock = threading.Lock()
_registered = False

# the dtypes the CPU kernel of aten._grouped_mm takes
GROUPED_MM_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def register() -> None:
    """Register this module's fake kernels with torch, once per process."""
    global _registered
    with _lock:
        if _registered:
            return
        try:
            torch.library.register_fake("aten::_grouped_mm")(_grouped_mm)
        except RuntimeError:
            pass  # torchs whose C++ registers a meta kernel for it (2.11) keep their own
        _registered = True


def _grouped_mm(
    mat_a: torch.Tensor,
    mat_b: torch.Tensor,
    offs: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """The output of `aten._grouped_mm` on fake tensors: the CPU kernel's checks and
    output layout on CPU, torch's own meta kernel elsewhere."""
    if mat_a.device.type != "cpu":
        from torch._meta_registrations import _meta_grouped_mm_common

        return _meta_grouped_mm_common(
            mat_a, mat_b, scale_a=None, scale_b=None, offs=offs, bias=bias, out_dtype=out_dtype
        )
    _check_matrix("mat_a", mat_a)
    _check_matrix("mat_b", mat_b)
    torch._check(  # the kernel's mm_out, group by group, takes one dtype
        mat_a.dtype == mat_b.dtype,
        lambda: (
            f"expected mat_a and mat_b to have the same dtype, got {mat_a.dtype} and {mat_b.dtype}"
        ),
    )
    a_2d, b_2d = mat_a.dim() == 2, mat_b.dim() == 2
    if not (a_2d and b_2d):
        torch._check(
            mat_a.size(-1) == mat_b.size(-2),
            lambda: "contraction dimension of mat_a and mat_b must match",
        )
    torch._check(
        (offs is not None) == (a_2d or b_2d),
        lambda: (
            "Have to provide offsets if there is a 2d matrix, or no offset if both matrices are 3d"
        ),
    )
    if offs is not None:
        torch._check(offs.dim() == 1, lambda: "offs has to be 1D")
        torch._check(offs.dtype == torch.int32, lambda: "Offsets have to be int32")
    torch._check(bias is None, lambda: "Bias not supported yet")
    dtype = out_dtype or mat_a.dtype
    torch._check(dtype == mat_a.dtype, lambda: "Grouped gemm output dtype must match `mat_a` dtype")
    return _output(mat_a, mat_b, offs, dtype)


def _check_matrix(name: str, mat: torch.Tensor) -> None:
    """The kernel's checks of one operand: its dtype, rank and layout."""
    torch._check(
        mat.dtype in GROUPED_MM_DTYPES,
        lambda: f"Expected {name} to be Float32, BFloat16 or Float16 matrix, got {mat.dtype}",
    )
    torch._check(mat.dim() in (2, 3), lambda: f"{name} has to be 2 or 3d")
    _check_strides(mat)


def _check_strides(mat: torch.Tensor) -> None:
    """The kernel's layout check: row or column major in the last two dimensions, the leading
    stride a multiple of 16 bytes."""
    rows, cols = mat.stride()[-2:]
    n_rows, n_cols = mat.shape[-2:]
    alignment = 16 // mat.element_size()
    if rows == 1 and cols >= max(1, n_rows):
        torch._check(cols % alignment == 0, lambda: "strides should be multiple of 16 bytes")
    elif cols == 1 and rows >= max(1, n_cols):
        torch._check(rows % alignment == 0, lambda: "strides should be multiple of 16 bytes")
    else:
        torch._check(
            False,
            lambda: (
                f"Invalid strides/sizes, got {mat.stride()} for strides and "
                f"{tuple(mat.shape)} for sizes"
            ),
        )


def _output(
    mat_a: torch.Tensor, mat_b: torch.Tensor, offs: torch.Tensor | None, dtype: torch.dtype
) -> torch.Tensor:
    """`create_grouped_gemm_output_tensor`: the result's shape, rows padded to 16 bytes
    (ROCm builds allocate it contiguous)."""
    a_2d, b_2d = mat_a.dim() == 2, mat_b.dim() == 2
    groups = offs.size(0) if offs is not None else 0
    if a_2d and b_2d:
        size = [groups, mat_a.size(0), mat_b.size(1)]
    elif a_2d:
        torch._check(groups == mat_b.size(0), lambda: "matrix batch sizes have to match")
        size = [mat_a.size(0), mat_b.size(-1)]
    elif b_2d:
        torch._check(groups == mat_a.size(0), lambda: "matrix batch sizes have to match")
        size = [mat_a.size(1), mat_b.size(1)]
    else:
        torch._check(mat_a.size(0) == mat_b.size(0), lambda: "batched dimension has to match")
        size = [mat_a.size(0), mat_a.size(1), mat_b.size(-1)]
    if torch.version.hip:
        return mat_a.new_empty(size, dtype=dtype)
    alignment = 16 // dtype.itemsize
    padded = (size[-1] + alignment - 1) // alignment * alignment
    stride = [padded, 1] if len(size) == 2 else [size[1] * padded, padded, 1]
    return mat_a.new_empty_strided(size, stride, dtype=dtype)
