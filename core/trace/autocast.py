"""The mixed-precision state a step runs under, recorded with its trace.

Under `torch.autocast` the forward's casts are ops of the traced graph (`_to_copy` to bf16
before a matmul, back to fp32 before a softmax), so a planned step replays them as plain ops
with autocast itself switched off: dispatching them through autocast again would cast twice.
The backward is traced as eager runs it, outside autocast (`loss.backward()` is called after
the `with torch.autocast(...)` block), and a call whose autocast state is not the plan's is
refused, since its graph would hold other ops.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch

from core.trace.cuda_autocast import cuda_autocast

# the device types whose autocast state is read and recorded
DEVICE_TYPES = ("cpu", "cuda")


@dataclass(frozen=True)
class Autocast:
    """Which device types autocast is on for, and to which dtype: `(("cpu", "bfloat16"),)`;
    empty when the step runs in the tensors' own dtypes."""

    enabled: tuple[tuple[str, str], ...] = ()

    @classmethod
    def current(cls) -> Autocast:
        """The caller's autocast state (the innermost `torch.autocast` in force)."""
        return cls(
            tuple(
                (d, str(torch.get_autocast_dtype(d)).removeprefix("torch."))
                for d in DEVICE_TYPES
                if torch.is_autocast_enabled(d)
            )
        )

    @classmethod
    def of(cls, context: torch.autocast | None) -> Autocast:
        """The state a `torch.autocast(...)` object sets; `None` is the caller's state. On a
        machine without CUDA, torch switches a CUDA autocast off as it is made (an explicit
        `enabled=False` cannot be told apart): it is read as on, since planning a GPU step
        is its only use there."""
        if context is None:
            return cls.current()
        if not context._enabled and not (context.device == "cuda" and _no_cuda()):
            return cls()
        return cls(((context.device, str(context.fast_dtype).removeprefix("torch.")),))

    @contextlib.contextmanager
    def entered(self, emulate_cuda: bool = False) -> Iterator[None]:
        """Run under exactly this state: autocast on where it records it, off elsewhere.
        `emulate_cuda`: the tensors stand for CUDA ones (a GPU step traced on CPU or meta
        tensors), so CUDA's autocast runs with CUDA's cast lists on them
        (core.trace.cuda_autocast)."""

        with contextlib.ExitStack() as stack:
            stack.enter_context(autocast_off())
            for device, dtype in self.enabled:
                if device == "cuda" and emulate_cuda:
                    stack.enter_context(cuda_autocast(getattr(torch, dtype)))
                else:
                    stack.enter_context(torch.autocast(device, getattr(torch, dtype)))
            yield

    def describe(self) -> str:
        """'autocast off' or 'autocast(cpu, bfloat16)': for error messages."""
        if not self.enabled:
            return "autocast off"
        return " and ".join(f"autocast({d}, {t})" for d, t in self.enabled)

    def to_data(self) -> list[list[str]]:
        return [[d, t] for d, t in self.enabled]

    @classmethod
    def from_data(cls, data: Any) -> Autocast:
        """The state `to_data` wrote (a plan file's, already checked by core.plan_io)."""
        return cls(tuple((str(d), str(t)) for d, t in data))


OFF = Autocast()


def _no_cuda() -> bool:
    return not torch.cuda.is_available()


@contextlib.contextmanager
def autocast_off() -> Iterator[None]:
    """Switch off every autocast in force (only those: entering a device type's autocast
    that is off would warn on a machine without that device)."""
    with contextlib.ExitStack() as stack:
        for device in DEVICE_TYPES:
            if torch.is_autocast_enabled(device):
                stack.enter_context(torch.autocast(device, enabled=False))
        yield
