"""What a device's allocator hands out for each storage: the bytes the prediction counts.

On CPU the step's storages are counted as they are (glibc's bookkeeping is not in the
measured figure): measured peak = predicted + 4 B, the seed of `loss.backward()`.

On a CUDA GPU every storage comes from PyTorch's caching allocator, which rounds each
request up to a multiple of 512 B (`round_size` in c10/cuda/CUDACachingAllocator.cpp:
`kMinBlockSize` = 512; a request of 0 B allocates nothing) unless `roundup_power2_divisions`
is configured in `PYTORCH_CUDA_ALLOC_CONF`, and `torch.cuda.max_memory_allocated` counts the
block handed out. So a GPU plan's peak is predicted over rounded storages, and the bound
stated is

    measured max_memory_allocated - allocated at the step's start >= predicted peak,

equal when every request is served by a block of its rounded size. It can be more, by the
allocator's history, where a cached block larger than the request is handed out whole: the
large pool (requests over 1 MiB) does not split off a remainder of 1 MiB or less
(`should_split`), so each such block live at the peak can count up to 1 MiB more; and by
what kernels allocate through the allocator outside the traced ops (the cuBLAS workspace on
a step's first matmul: warm up before measuring; cuDNN and mem-efficient attention
workspaces). `roundup_power2_divisions` or `expandable_segments` change the rounding and
are not modelled.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol


@dataclass(frozen=True)
class Allocator:
    """How one device type's allocator sizes a request: rounded up to a multiple of `unit`."""

    name: str
    unit: int  # bytes; 1: exact

    def rounded(self, nbytes: int) -> int:
        """The bytes a request of `nbytes` takes (0 stays 0: nothing is allocated)."""
        return -(-nbytes // self.unit) * self.unit

    def bound(self) -> str:
        """What the prediction promises on this device, in words."""
        if self.unit == 1:
            return "exact: measured peak = predicted + 4 B (the seed of loss.backward())"
        return (
            f"every storage rounded up to {self.unit} B ({self.name}); measured "
            "max_memory_allocated minus the step's starting allocation >= predicted, more "
            "where a cached block is handed out whole (up to 1 MiB per large block) or a "
            "kernel allocates a workspace"
        )


EXACT = Allocator("exact", 1)
CUDA_CACHING = Allocator("CUDA caching allocator, round_size", 512)
_BY_TYPE = {"cpu": EXACT, "meta": EXACT, "cuda": CUDA_CACHING}


def for_device_type(device_type: str) -> Allocator:
    """The allocator of a device type ("cpu", "cuda")."""
    if device_type not in _BY_TYPE:
        raise ValueError(f"no allocator model for device type {device_type!r}: cpu or cuda")
    return _BY_TYPE[device_type]


class _Sized(Protocol):
    nbytes: int


class _Values(Protocol):
    @property
    def values(self) -> Sequence[_Sized]: ...


def round_values(graph: _Values, allocator: Allocator) -> None:
    """Each value's bytes as `allocator` hands them out: the one place the simulation's
    byte accounting (every peak, floor and plan) takes the device's rounding from."""
    if allocator.unit == 1:
        return
    for value in graph.values:
        value.nbytes = allocator.rounded(value.nbytes)
