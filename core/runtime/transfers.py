"""Host transfers during a training step: the host pool, each `offload` and `prefetch` of an
offloading plan, and when compute waits for a copy.

A lane issues the copies, in program order, and tells compute when to wait:
- `HostLane` (CPU): host and device are one memory, so each copy runs when it is issued and
  nothing is waited for. The pool is hidden from the storage tracker (`core.memory`), so the
  device peak the tests measure is the one the simulator predicts.
- `CudaLane`: copies run on one side stream (the simulator's one transfer lane: copies finish
  in the order they were issued), into and out of a pinned pool (copies from pageable memory
  do not overlap compute). The rules that keep it free of the known races:
  1. a copy starts after the compute work issued before it (its source is written; its
     destination's memory, just allocated, is no longer read by earlier kernels);
  2. an offloaded device storage is dropped only after compute waits for its copy out, at the
     step where the simulator says the copy is done: the caching allocator hands freed memory
     to the compute stream at once, and this also keeps the device peak the predicted one;
  3. a prefetched value is read, offloaded again or freed only after compute waits for its
     copy back (`HostWork.ready`, placed by the runtime);
  4. every device storage a copy touches is `record_stream`-ed on the side stream, so that a
     step abandoned before its backward (its storages freed with copies in flight) cannot hand
     their memory out early; with 2 and 3 the record costs nothing in a normal step;
  5. the step ends with compute waiting for the side stream, so the pool can serve a next step.
Pools are allocated once per lane (one lane per module and device) and reused by later steps;
steps alive at once (two forwards before their backwards) each take their own.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from core.memory import copy_bytes, host_pool, pool_bytes, storage_bytes
from core.simulator import OFFLOAD, PREFETCH


class HostLane:
    """CPU: each copy runs when issued; also the pools' free list every lane keeps."""

    def __init__(self) -> None:
        self._free: list[torch.Tensor] = []

    def take(self, nbytes: int) -> torch.Tensor:
        """A pool of at least `nbytes`: a free one, else a new one."""
        for i, pool in enumerate(self._free):
            if pool.numel() >= nbytes:
                return self._free.pop(i)
        return self.new_pool(nbytes)

    def give(self, pool: torch.Tensor) -> None:
        """`pool` back to the free list: its step is over and its copies are done."""
        self._free.append(pool)

    def new_pool(self, nbytes: int) -> torch.Tensor:
        return host_pool(nbytes)

    def copy(self, host: torch.Tensor, device: torch.Tensor, to_host: bool) -> Any:
        """Start copying `device` bytes into `host` bytes (`to_host`) or back (uint8 tensors of
        one size); returns what `wait` takes."""
        copy_bytes(*((host, device) if to_host else (device, host)))
        return None

    def wait(self, token: Any) -> None:
        """Make compute wait until the copy that returned `token` is done."""

    def drain(self) -> None:
        """Make compute wait until every copy issued is done."""


class CudaLane(HostLane):
    """CUDA: copies on a side stream, into and out of a pinned pool (the module's rules)."""

    def __init__(self, device: torch.device) -> None:
        super().__init__()
        self.device = device
        self.side = torch.cuda.Stream(device)

    def new_pool(self, nbytes: int) -> torch.Tensor:
        return host_pool(nbytes, pinned=True)

    def copy(self, host: torch.Tensor, device: torch.Tensor, to_host: bool) -> torch.cuda.Event:
        self.side.wait_stream(torch.cuda.current_stream(self.device))  # rule 1
        with torch.cuda.stream(self.side):
            copy_bytes(*((host, device) if to_host else (device, host)), non_blocking=True)
        device.record_stream(self.side)  # rule 4
        done = torch.cuda.Event()
        done.record(self.side)
        return done

    def wait(self, token: torch.cuda.Event) -> None:
        torch.cuda.current_stream(self.device).wait_event(token)

    def drain(self) -> None:
        torch.cuda.current_stream(self.device).wait_stream(self.side)


def lane_for(device: torch.device) -> HostLane:
    """The lane that runs an offloading plan's copies on `device`."""
    if device.type == "cpu":
        return HostLane()
    if device.type == "cuda":
        return CudaLane(device)
    raise NotImplementedError(
        f"offloading plans run on CPU and CUDA, not on {device.type}: plan without offloading "
        "(a method other than offload or pofo)"
    )


@dataclass(frozen=True)
class HostWork:
    """What an instruction does with host memory before its ops run, in this order: drop the
    offloaded device storages whose copy out is done (`release`) and the host copies no longer
    needed (`unpark`); start one transfer; wait for the prefetched values it touches (`ready`)."""

    release: tuple[int, ...] = ()
    unpark: tuple[int, ...] = ()
    transfer: str = ""  # offload | prefetch | ""
    value: int = -1
    nodes: tuple[int, ...] = ()  # env keys bound to the value's storage
    slot: int = 0  # offset in the host pool
    ready: tuple[int, ...] = ()


class HostStep:
    """One step's host memory: its pool, the device storages whose copy out is not done, the
    parked values' views (to rebuild them on the device), and the copies back in flight."""

    def __init__(self, lane: HostLane, nbytes: int) -> None:
        self.lane = lane
        self.nbytes = nbytes
        self.pool = lane.take(nbytes)
        # per value, oldest first: (copy token, the device tensors going out)
        self.leaving: dict[int, list[tuple[Any, list[torch.Tensor]]]] = {}
        self.views: dict[int, list[tuple[int, torch.device, list[tuple]]]] = {}  # parked
        self.arriving: dict[int, Any] = {}  # value -> copy token of its prefetch
        self.parked = 0  # bytes parked now
        self.peak = 0

    def copy(self) -> HostStep:
        """An independent copy, for a backward that may run again (retain_graph)."""
        self.lane.drain()
        other = HostStep(self.lane, self.nbytes)
        copy_bytes(pool_bytes(other.pool, 0, self.nbytes), pool_bytes(self.pool, 0, self.nbytes))
        other.leaving = {v: [(t, list(ts)) for t, ts in out] for v, out in self.leaving.items()}
        other.views = {v: list(parked) for v, parked in self.views.items()}
        other.arriving = dict(self.arriving)
        other.parked, other.peak = self.parked, self.peak
        return other

    def work(self, w: HostWork, env: dict[int, Any]) -> None:
        for v in w.release:
            token, _tensors = self.leaving[v].pop(0)
            self.lane.wait(token)  # rule 2; the storage goes with its last reference
        for v in w.unpark:
            self.parked -= self.views[v].pop(0)[0]
        if w.transfer == OFFLOAD:
            self._offload(w, env)
        elif w.transfer == PREFETCH:
            self._prefetch(w, env)
        for v in w.ready:
            self.lane.wait(self.arriving.pop(v))  # rule 3

    def _offload(self, w: HostWork, env: dict[int, Any]) -> None:
        nodes = [n for n in w.nodes if n in env]
        if not nodes:  # the simulator checked the program: a runtime bug if it happens
            raise RuntimeError(f"offload of value {w.value}: no tensor holds it")
        storage = env[nodes[0]].untyped_storage()
        nbytes = storage.nbytes()
        token = self.lane.copy(pool_bytes(self.pool, w.slot, nbytes), storage_bytes(storage), True)
        views = [
            (n, t.dtype, t.storage_offset(), t.shape, t.stride()) for n in nodes for t in [env[n]]
        ]
        self.views.setdefault(w.value, []).append((nbytes, storage.device, views))
        self.leaving.setdefault(w.value, []).append((token, [env.pop(n) for n in nodes]))
        self.parked += nbytes
        self.peak = max(self.peak, self.parked)

    def _prefetch(self, w: HostWork, env: dict[int, Any]) -> None:
        nbytes, device, views = self.views[w.value][-1]  # its latest offload
        data = torch.empty(nbytes, dtype=torch.uint8, device=device)  # device memory, counted
        self.arriving[w.value] = self.lane.copy(pool_bytes(self.pool, w.slot, nbytes), data, False)
        storage = data.untyped_storage()
        for n, dtype, offset, shape, stride in views:
            env[n] = torch.empty(0, dtype=dtype, device=device).set_(storage, offset, shape, stride)

    def finish(self) -> None:
        """The step is over: wait for every copy (rule 5) and give the pool back."""
        self.lane.drain()
        self.arriving.clear()
        self.lane.give(self.pool)
