"""The whole training footprint of a plan against a device's memory: will it fit?

A plan's budget counts what one forward+backward holds beyond parameters and inputs:
activations, temporaries and the gradients made so far. Training also holds the parameters
and buffers, the batch, and the optimizer's state. `footprint` adds them up at the plan's
peak step, assuming AdamW (two moments, each the size of the trainable parameters: fp32
moments for fp32 parameters). `CAPACITY` is each device preset's memory as the device
reports it (`torch.cuda.get_device_properties().total_memory`, nvidia-smi's total): H100
80GB HBM3 81,559 MiB and A100 80GB 81,920 MiB, as nvidia-smi prints them (e.g.
modal-labs/modal-client#2797); V100 SXM2 32 GB and RTX 4090 24 GB from their datasheets, in
GiB; for "cpu" and costs measured here, this machine's physical memory.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

MIB, GIB = 1 << 20, 1 << 30
CAPACITY: dict[str, int] = {
    "a100": 81_920 * MIB,
    "h100": 81_559 * MIB,
    "v100": 32 * GIB,
    "rtx4090": 24 * GIB,
}
# optimizer states per trainable parameter, each its size: AdamW/Adam's exp_avg and
# exp_avg_sq, SGD's momentum buffer
OPTIMIZER_STATES: dict[str, int] = {"adamw": 2, "adam": 2, "sgd": 1, "none": 0}
OPTIMIZER = "AdamW (two moments per parameter, in the parameters' dtype)"


@dataclass(frozen=True)
class Footprint:
    """Bytes held at the plan's peak step, by what holds them, and the device's memory."""

    parameters: int  # trainable parameters and buffers (batch-norm statistics)
    optimizer: int  # AdamW's moments
    inputs: int  # the batch
    activations: int  # at the peak step
    temporaries: int
    gradients: int  # made by the peak step
    capacity: int  # bytes of the device preset (this machine's memory for "cpu")
    device: str

    @property
    def total(self) -> int:
        return (
            self.parameters
            + self.optimizer
            + self.inputs
            + self.activations
            + self.temporaries
            + self.gradients
        )

    @property
    def fits(self) -> bool:
        return self.total <= self.capacity

    def parts(self) -> list[tuple[str, int]]:
        """(what, bytes), in stacking order: what training holds anyway, then the step's."""
        return [
            ("parameters and buffers", self.parameters),
            ("optimizer state (AdamW)", self.optimizer),
            ("inputs", self.inputs),
            ("activations", self.activations),
            ("temporaries", self.temporaries),
            ("gradients", self.gradients),
        ]


def device_memory(device: str) -> int:
    """Bytes of memory of a device preset; this machine's physical memory for "cpu"/"here"."""
    if device in CAPACITY:
        return CAPACITY[device]
    if device in ("cpu", "here"):
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    raise ValueError(
        f"no memory size for device {device!r}: choose one of {', '.join([*CAPACITY, 'cpu'])}"
    )


def optimizer_bytes(problem: Any, optimizer: str = "adamw") -> int:
    """Bytes of `optimizer`'s state for the problem's trainable parameters."""
    trainable = sum(v.nbytes for v in problem.graph.values if v.kind == "param")
    return OPTIMIZER_STATES[optimizer] * trainable


def footprint(problem: Any, plan: Any, device: str) -> Footprint:
    """What training with `plan` holds at its peak step on `device` (a `core.costs` preset
    name, or "here"), optimizer state for AdamW."""
    values = problem.graph.values
    trainable = sum(v.nbytes for v in values if v.kind == "param")
    buffers = sum(v.nbytes for v in values if v.kind == "state")
    steps = plan.timeline
    peak = max(steps, key=lambda s: s.activations + s.temporaries + s.gradients)
    return Footprint(
        parameters=trainable + buffers,
        optimizer=optimizer_bytes(problem, "adamw"),
        inputs=problem.input_bytes,
        activations=peak.activations,
        temporaries=peak.temporaries,
        gradients=peak.gradients,
        capacity=device_memory(device),
        device=device,
    )
