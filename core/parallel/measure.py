"""One rank's measured peak when parameters and activations may be DTensors: the storage
tracker counting each DTensor's local shard (a DTensor's own storage is not its memory)."""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch.distributed.tensor import DTensor

from core.memory import StorageTracker


def local(t: torch.Tensor) -> torch.Tensor:
    """The tensor a rank holds: a DTensor's local shard, any other tensor itself."""
    return t.to_local() if isinstance(t, DTensor) else t


class RankTracker(StorageTracker):
    """`StorageTracker` over local shards: `with RankTracker(rank_tensors(model, inputs))`.

    It sees the ops dispatched while active; a DTensor op's own local ops (inside DTensor's
    dispatch, collectives included) run below it, so a DTensor op is counted by the local
    shards of its outputs."""

    def __init__(self, existing: Iterable[torch.Tensor] = ()) -> None:
        super().__init__(local(t) for t in existing)

    def _local(self, t: torch.Tensor) -> torch.Tensor:
        """A DTensor counts by its local shard."""
        return local(t)


def rank_tensors(model: torch.nn.Module, inputs: Iterable[torch.Tensor]) -> list[torch.Tensor]:
    """Parameters, buffers, existing gradients and inputs, as local shards."""
    out = [*model.parameters(), *model.buffers(), *inputs]
    out += [p.grad for p in model.parameters() if p.grad is not None]
    return [local(t) for t in out]
