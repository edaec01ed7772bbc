"""Measure the real peak of a step on any device: count each new storage once while it lives.

A `TorchDispatchMode` sees every ATen op; each output storage not seen before is added to the
live total and removed when PyTorch frees it (`weakref.finalize`), unless it is one of the
pre-existing tensors (parameters, inputs) or one of the op's own inputs' storages: an
in-place result or a view of a tensor the step did not make (a plan's scratch buffer) existed
before the op, so it is not an allocation. On CPU this matched `torch.profiler`'s memory profile
exactly for a GPT; on CUDA, `torch.cuda.max_memory_allocated` is the reference instead.

Host memory is not device memory: an offloading plan parks storages in a host pool that
`host_pool` allocates and `copy_bytes` copies into and out of, outside every dispatch mode, so
the tracker never sees the pool (nor `host_copy`'s copies). On CPU, where host and device are
one memory, this is what keeps the pool out of the device peak, deliberately. The copy back
lands in a device storage the caller allocates inside the modes, so that one is counted.
A planned module meeting a new input shape traces it inside the step, under a fake mode of
its own: those fake tensors are no memory and are not counted, while a step measured under
fake tensors (the tracker entered inside a fake mode) counts its own.
Uses private PyTorch APIs: `TorchDispatchMode`, `_disable_current_modes`, the mode stack,
pytree's `tree_leaves` and storage `_cdata`.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable
from typing import Self

import torch
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
from torch.utils._python_dispatch import (
    TorchDispatchMode,
    _disable_current_modes,
    _get_current_dispatch_mode_stack,
)
from torch.utils._pytree import tree_leaves


class StorageTracker(TorchDispatchMode):
    """`with StorageTracker(existing) as t: step()`; then `t.peak` is the step's peak in bytes
    beyond the storages of `existing` (parameters, buffers, inputs, grads already there).
    It counts the outputs of ops dispatched while it is active, so never the host pool."""

    def __init__(self, existing: Iterable[torch.Tensor] = ()) -> None:
        super().__init__()
        self._known: set[int] = {t.untyped_storage()._cdata for t in existing}
        self.live = 0
        self.peak = 0
        self._fake: FakeTensorMode | None = None

    def __enter__(self) -> Self:
        # a step measured under fake tensors counts them; the fake tensors of a fake mode
        # entered inside the step (a planned module tracing a new input shape) are no memory
        self._fake = next(
            (m for m in _get_current_dispatch_mode_stack() if isinstance(m, FakeTensorMode)),
            None,
        )
        super().__enter__()
        return self

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        new = [s for s in self._storages(out) if s._cdata not in self._known]
        if new:
            given = {s._cdata for s in self._storages((args, kwargs))}
            for storage in new:
                self._track(storage, given)
        return out

    def _storages(self, tree: object) -> list[torch.UntypedStorage]:
        """The storages of the tensors in `tree` (meta tensors have none)."""
        return [
            self._local(t).untyped_storage()
            for t in tree_leaves(tree)
            if isinstance(t, torch.Tensor)
            and t.device.type != "meta"
            and not (isinstance(t, FakeTensor) and t.fake_mode is not self._fake)
        ]

    def _local(self, t: torch.Tensor) -> torch.Tensor:
        """The tensor whose storage counts: `t` itself (a subclass may say otherwise)."""
        return t

    def _track(self, storage: torch.UntypedStorage, given: set[int]) -> None:
        key = storage._cdata
        if key in self._known:
            return
        self._known.add(key)
        if key in given:  # an in-place result or a view of a tensor made before the step
            weakref.finalize(storage, self._known.discard, key)
            return
        nbytes = storage.nbytes()
        self.live += nbytes
        self.peak = max(self.peak, self.live)
        weakref.finalize(storage, self._freed, key, nbytes)

    def _freed(self, key: int, nbytes: int) -> None:
        self._known.discard(key)
        self.live -= nbytes


def step_tensors(model: torch.nn.Module, inputs: Iterable[torch.Tensor]) -> list[torch.Tensor]:
    """Parameters, buffers, existing grads and inputs: what a step's peak does not count."""
    out = list(model.parameters()) + list(model.buffers()) + list(inputs)
    out += [p.grad for p in model.parameters() if p.grad is not None]
    return out


def host_pool(nbytes: int, pinned: bool = False) -> torch.Tensor:
    """A host buffer of `nbytes` (uint8), allocated where no tracker sees it: host memory.
    `pinned` page-locks it, as CUDA needs for copies that overlap compute."""
    with _disable_current_modes():
        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=pinned)


def pool_bytes(pool: torch.Tensor, offset: int, nbytes: int) -> torch.Tensor:
    """Bytes `offset` to `offset + nbytes` of a host pool: a view the tracker does not see."""
    with _disable_current_modes():
        return pool[offset : offset + nbytes]


def storage_bytes(storage: torch.UntypedStorage) -> torch.Tensor:
    """Every byte of `storage`, as a uint8 tensor on its device (a view: nothing is copied)."""
    with _disable_current_modes():
        return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)


def copy_bytes(dst: torch.Tensor, src: torch.Tensor, non_blocking: bool = False) -> None:
    """`dst.copy_(src)` unseen by any tracker: a copy into or out of the host pool."""
    with _disable_current_modes():
        dst.copy_(src, non_blocking=non_blocking)


def host_copy(t: torch.Tensor) -> torch.Tensor:
    """A copy of `t`'s values in host memory, unseen by any tracker (`save_on_cpu`'s pack)."""
    with _disable_current_modes():
        return t.detach().to("cpu", copy=True)
