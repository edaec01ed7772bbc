"""A plan's offloads under native execution: saved-tensor hooks that move the plan's
offloaded values to the host, as torchtune's OffloadActivations does.

`torch.autograd.graph.saved_tensors_hooks` is entered around the step's forward: when
autograd saves a tensor whose storage is one of the plan's offloaded values, the pack hook
copies that storage into host memory and autograd keeps the host copy (the device storage
then lives only as long as Python holds it); the unpack hook, in the backward, copies it
back into a fresh device storage and rebuilds the saved view. Copies run on the lane of
`core.runtime.transfers`: on CPU a host pool unseen by the storage tracker; on CUDA a side
stream and a pinned pool, compute waiting for each copy back before the node reads it.
(torch 2.13's `CheckpointPolicy.MUST_CPU_OFFLOAD` is honoured only by torch.compile's
partitioner: eager selective checkpoint treats it as a recompute.)

Which storage is which value: while the forward runs, a dispatch mode walks the trace's
forward ops in step with eager's (ops the trace lacks, such as checkpoint's empty
placeholders, are passed over: same op and output shapes, or not the traced node) and
notes the storage each offloaded value's node makes. Inside a checkpointed layer
checkpoint's own hooks pack the saved tensors, so only values made and read outside every
region are offloaded (`core.native.lowering`).
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves
from torch.utils.checkpoint import SAC_IGNORED_OPS

from core.memory import pool_bytes, storage_bytes
from core.native.lowering import Lowering
from core.native.match import traced_as
from core.plan import Plan
from core.runtime.transfers import HostLane, lane_for


class _Finder(TorchDispatchMode):
    """The forward's ATen ops matched to the trace's, in order: the storage each offloaded
    value's node makes -> that value."""

    def __init__(self, expected: list[tuple[Any, tuple, int]]) -> None:
        super().__init__()
        self.expected = expected  # (target, output shapes, value or -1) per traced node
        self.next = 0
        self.found: dict[int, int] = {}  # storage key -> value

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
        out = func(*args, **(kwargs or {}))
        if func in SAC_IGNORED_OPS or self.next >= len(self.expected):
            return out
        target, shapes, value = self.expected[self.next]
        tensors = [t for t in tree_leaves(out) if isinstance(t, torch.Tensor)]
        if traced_as(func) == target and tuple(tuple(t.shape) for t in tensors) == shapes:
            self.next += 1
            if value >= 0:
                storage = tensors[0].untyped_storage()
                self.found[storage._cdata] = value  # forgotten when it dies (keys are reused)
                weakref.finalize(storage, self.found.pop, storage._cdata, None)
        return out


@dataclass
class _Parked:
    """One offloaded storage's host copy, shared by every saved view of it."""

    host: torch.Tensor
    nbytes: int
    device: torch.device
    lane: HostLane
    restored: Any = None  # weakref to the device storage copied back, while it lives


@dataclass(frozen=True)
class _Packed:
    """What autograd keeps for an offloaded saved tensor: its host copy and its view."""

    parked: _Parked
    dtype: torch.dtype
    offset: int
    shape: tuple[int, ...]
    stride: tuple[int, ...]


class NativeOffload:
    """The saved-tensor hooks of one lowered plan; `with offload.active(): forward()`."""

    def __init__(self, plan: Plan, lowering: Lowering) -> None:
        trace = plan.problem.graph.trace
        making = {node: v for v, node in lowering.offloads}
        self.expected = [
            (n.target, tuple(tuple(s.shape) for s in n.specs), making.get(n.index, -1))
            for n in trace.nodes
            if n.role == "op"
            and n.module is not None
            and isinstance(n.target, torch._ops.OpOverload)
            and n.target not in SAC_IGNORED_OPS
        ]
        self.values = frozenset(making.values())
        self._lanes: dict[torch.device, HostLane] = {}
        self._finder: _Finder | None = None

    @contextlib.contextmanager
    def active(self) -> Iterator[None]:
        """Offload while the block runs (a forward with autograd recording); re-entered by
        a nested call, it does nothing more."""
        if self._finder is not None or not torch.is_grad_enabled():
            yield
            return
        finder = _Finder(self.expected)
        self._finder = finder
        parked: dict[int, _Parked] = {}  # storage key -> host copy, this forward's
        try:
            with (
                finder,
                torch.autograd.graph.saved_tensors_hooks(
                    lambda x: self._pack(x, finder, parked), self._unpack
                ),
            ):
                yield
        finally:
            self._finder = None

    def wrap(self, forward: Callable[..., Any]) -> Callable[..., Any]:
        """`forward` run with the hooks active."""

        def run(*args: Any, **kwargs: Any) -> Any:
            with self.active():
                return forward(*args, **kwargs)

        return run

    def _pack(self, x: torch.Tensor, finder: _Finder, parked: dict[int, _Parked]) -> Any:
        storage = x.untyped_storage()
        key = storage._cdata
        if finder.found.get(key) is None:
            return x
        if key not in parked:
            lane = self._lane(x.device)
            nbytes = storage.nbytes()
            pool = lane.take(nbytes)
            host = pool_bytes(pool, 0, nbytes)
            lane.copy(host, storage_bytes(storage), True)  # record_stream keeps it on CUDA
            parked[key] = _Parked(host, nbytes, x.device, lane)
            weakref.finalize(parked[key], lane.give, pool)  # back once no node keeps it
            # the key is an address: once this storage dies, a later storage may get it
            weakref.finalize(storage, parked.pop, key, None)
        return _Packed(parked[key], x.dtype, int(x.storage_offset()), tuple(x.shape), x.stride())

    @staticmethod
    def _unpack(packed: Any) -> torch.Tensor:
        if not isinstance(packed, _Packed):
            return packed
        p = packed.parked
        storage = p.restored() if p.restored is not None else None
        if storage is None:
            data = torch.empty(p.nbytes, dtype=torch.uint8, device=p.device)  # counted
            p.lane.wait(p.lane.copy(p.host, data, False))
            storage = data.untyped_storage()
            p.restored = weakref.ref(storage)
        out = torch.empty(0, dtype=packed.dtype, device=p.device)
        return out.set_(storage, packed.offset, packed.shape, packed.stride)

    def _lane(self, device: torch.device) -> HostLane:
        if device not in self._lanes:
            self._lanes[device] = lane_for(device)
        return self._lanes[device]
