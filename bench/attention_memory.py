"""What CUDA's attention kernels allocate that no op returns: for each kernel (memory-efficient
in float32 and bfloat16, flash and cuDNN in bfloat16) and each shape, dropout, causal flag and
mask, the peak of `torch.cuda.max_memory_allocated()` beyond the live memory after the
forward and after the backward (`torch.autograd.grad` of the output, the graph kept, the
cache emptied between calls). The backward's excess is the kernel's scratch (a float32
accumulator of the query's gradient, a log-sum-exp-sized `delta`), the term the simulation
does not yet have (docs/validate.md). Run on a GPU:
`python -m bench.attention_memory --out rows.json`."""

from __future__ import annotations

import argparse
import itertools
import json
from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

KERNELS = [
    (SDPBackend.EFFICIENT_ATTENTION, torch.float32),
    (SDPBackend.EFFICIENT_ATTENTION, torch.bfloat16),
    (SDPBackend.FLASH_ATTENTION, torch.bfloat16),
    (SDPBackend.CUDNN_ATTENTION, torch.bfloat16),
]


def measure(
    backend: SDPBackend,
    dtype: torch.dtype,
    shape: tuple[int, int, int, int],
    p: float,
    causal: bool,
    mask: bool,
) -> dict[str, Any]:
    """One call's forward and backward excess, in bytes."""
    batch, heads, seq, dim = shape
    q, k, v = (
        torch.randn(batch, heads, seq, dim, device="cuda", dtype=dtype, requires_grad=True)
        for _ in range(3)
    )
    bias = torch.zeros(batch, 1, seq, seq, device="cuda", dtype=dtype) if mask else None
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    with sdpa_kernel([backend]):
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=bias, dropout_p=p, is_causal=causal)
    torch.cuda.synchronize()
    forward = torch.cuda.max_memory_allocated() - torch.cuda.memory_allocated()
    made = torch.cuda.memory_allocated() - base
    grad = torch.randn_like(out)
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    torch.autograd.grad(out, (q, k, v), grad, retain_graph=True)
    torch.cuda.synchronize()
    backward = torch.cuda.max_memory_allocated() - torch.cuda.memory_allocated()
    return {"forward_made": made, "forward_excess": forward, "backward_excess": backward}


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.attention_memory", description=__doc__)
    parser.add_argument("--out", required=True, help="JSON file for the rows")
    args = parser.parse_args(argv)
    rows = []
    grid = itertools.product([1, 4], [8, 12], [128, 256, 512, 1000, 2048], [64, 128])
    for shape in grid:
        for (backend, dtype), p, causal, mask in itertools.product(
            KERNELS, [0.0, 0.1], [False, True], [False, True]
        ):
            if mask and causal:
                continue
            row: dict[str, Any] = {
                "kernel": backend.name,
                "dtype": str(dtype),
                "shape": shape,
                "dropout": p,
                "causal": causal,
                "mask": mask,
            }
            try:
                row.update(measure(backend, dtype, shape, p, causal, mask))
            except RuntimeError as e:  # the kernel refuses this call (flash takes no mask)
                row["error"] = str(e).splitlines()[0][:200]
            rows.append(row)
            torch.cuda.empty_cache()
    with open(args.out, "w") as f:
        json.dump(rows, f)
    print(f"{len(rows)} calls, {sum('error' not in r for r in rows)} ran: {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
