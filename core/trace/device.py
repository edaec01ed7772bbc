"""The device a step is traced for, when it is not the device the tensors are on.

A plan for a GPU is mostly made on a CPU, from a model on the CPU or the meta device. The
ATen ops such a step runs differ from CPU's where a composite op picks its kernel by device:
`scaled_dot_product_attention` (flash, mem-efficient, cuDNN or math: `core.trace.attention`)
and `dropout` (CUDA runs the fused `native_dropout`, keeping a boolean mask; CPU draws a
float mask with `bernoulli_`: `dropout` in aten/src/ATen/native/Dropout.cpp, whose
`is_fused_kernel_acceptable` asks for a CUDA tensor, 0 < p < 1 and a non-empty input).
`DeviceDispatch` runs both as the target would while a step is traced; everything else
dispatches as torch does. On tensors already on the target's device type it does nothing.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from core.trace.attention import KERNELS, AttentionMode, Target
from core.trace.autocast import Autocast


@dataclass(frozen=True)
class DeviceModel:
    """What a trace is made for: a device preset's name ("h100", "cpu"), its device type,
    its compute capability (GPUs) and the attention kernel assumed first ("auto": torch's
    own order)."""

    name: str = "cpu"
    type: str = "cpu"
    capability: tuple[int, int] | None = None
    attention: str = "auto"

    def __post_init__(self) -> None:
        if self.attention not in ("auto", *KERNELS):
            raise ValueError(
                f"unknown attention {self.attention!r}: use 'auto' (torch's rules), "
                + ", ".join(repr(k) for k in KERNELS)
            )

    @property
    def target(self) -> Target:
        return Target(self.type, self.capability, self.attention)

    def describe(self) -> str:
        """'h100 (cuda, sm 9.0)' or 'cpu': for notes and error messages."""
        if self.capability is None:
            return self.name
        major, minor = self.capability
        return f"{self.name} ({self.type}, sm {major}.{minor})"

    def to_data(self) -> dict[str, Any]:
        cap = list(self.capability) if self.capability is not None else None
        return {
            "name": self.name,
            "type": self.type,
            "capability": cap,
            "attention": self.attention,
        }

    @classmethod
    def from_data(cls, data: Any) -> DeviceModel:
        """The model `to_data` wrote; plans from before device models were recorded: CPU."""
        if not data:
            return CPU
        cap = data.get("capability")
        return cls(
            str(data["name"]),
            str(data["type"]),
            (int(cap[0]), int(cap[1])) if cap else None,
            str(data.get("attention", "auto")),
        )


CPU = DeviceModel()


class DeviceDispatch(AttentionMode):
    """While active, attention (`AttentionMode`) and dropout run as on `model`'s device,
    for tensors not on its device type."""

    def __init__(self, model: DeviceModel) -> None:
        super().__init__(model.target)
        self.model = model

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if func is F.dropout and self.target.type == "cuda":
            return _cuda_dropout(func, *args, **(kwargs or {}))
        return super().__torch_function__(func, types, args, kwargs)


def _cuda_dropout(
    func: Any, input: torch.Tensor, p: float = 0.5, training: bool = True, inplace: bool = False
) -> torch.Tensor:
    """`F.dropout` as on CUDA: the fused `native_dropout` where `is_fused_kernel_acceptable`
    holds (out of place, training, 0 < p < 1, a non-empty input), torch's own path else."""
    if input.device.type == "cuda" or inplace or not training:
        return func(input, p, training, inplace)
    if not 0.0 < p < 1.0 or input.numel() == 0:
        return func(input, p, training, inplace)
    return torch.ops.aten.native_dropout(input, p, True)[0]


@contextlib.contextmanager
def running_as(device: DeviceModel, model: nn.Module, autocast: Autocast) -> Iterator[None]:
    """Run `model`'s ops as the step traced for `device` ran them: under `autocast`, with
    CUDA's cast lists where a GPU step is traced on CPU tensors, and with the device's
    attention and dropout kernels (`DeviceDispatch`). The probes that run a model again after
    its trace (core.native.boundaries, core.native.lifetimes) align their ops with the
    trace's, so they must dispatch the same ops."""
    held = next((p.device.type for p in model.parameters()), "cpu")
    dispatch = DeviceDispatch(device) if held != device.type else None
    emulate = dispatch is not None and device.type == "cuda"
    with autocast.entered(emulate_cuda=emulate), dispatch or contextlib.nullcontext():
        yield
