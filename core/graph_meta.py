"""What a plan records about the step it was made for, so that a plan file means the same on
every machine: the traced graph's identity (parameters, buffers, inputs, how the model was
called, autocast, loss head, optimizer) and the cost model its figures were computed under,
with the op times and host link themselves (measured times cannot be measured again to the
same value). `core.bind` traces a model back from it (`core.bind.retrace`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from core.simulator import Link
from core.trace import Autocast, CallSpec
from core.trace.device import CPU, DeviceModel
from core.trace.loss_head import PLAIN, LossHead

InputRecord = tuple[tuple[int, ...], str, bool]  # shape, dtype name, requires grad


@dataclass(frozen=True)
class CostRecord:
    """The cost model a problem was timed under: its name ("estimated:cpu",
    "measured:cuda:0"), each op's seconds in graph order, and the host link's bytes/s."""

    model: str
    times: tuple[float, ...]
    link: Link

    def to_data(self) -> dict[str, Any]:
        return {
            "model": self.model,
            "times": [float(t) for t in self.times],
            "link": [float(self.link.d2h), float(self.link.h2d)],
        }

    @staticmethod
    def from_data(data: dict[str, Any]) -> CostRecord:
        """The record `to_data` wrote (checked by `core.plan_io.check_graph_meta`)."""
        d2h, h2d = data["link"]
        return CostRecord(str(data["model"]), tuple(map(float, data["times"])), Link(d2h, h2d))


@dataclass(frozen=True)
class GraphMeta:
    """A traced step's record: enough to trace the model again on fake inputs, to say what
    differs when the trace is not the plan's, and to figure the plan under its own costs."""

    params: tuple[tuple[str, str], ...]  # (name, spec) of each trainable parameter
    state: tuple[str, ...]  # buffer names
    inputs: tuple[InputRecord, ...]
    n_nodes: int
    call: dict[str, Any] | None = None  # CallSpec.to_data(); None for positional-only plans
    autocast: Autocast = field(default_factory=Autocast)
    loss_head: LossHead = PLAIN
    optimizer: dict[str, Any] | None = None  # core.optimizer_step.optimizer_data
    costs: CostRecord | None = None  # None only in plan files written before version 2
    # the device the step was traced for (core.trace.device): its preset, the attention
    # kernel assumed first; a plan binds only to a model on that device
    device: DeviceModel = CPU
    # the values of the example's small integer inputs (ids, masks) by input position: the
    # model's Python branches on them (HF's mask code) go as they went when traced again
    values: tuple[tuple[int, tuple[int, ...]], ...] = ()
    # the torch the step was traced with ("" in files from before it was recorded): another
    # torch can dispatch other ops (autocast's casts, attention kernels), and a plan's
    # mismatch says so
    torch_version: str = ""
    # each ATen op of the trace as "label@module" (`core.trace.op_sequence`): a mismatch
    # names the first ops that differ ("" module: outside the model's forward)
    ops: tuple[str, ...] = ()
    # the packages the model's modules come from, with versions (`core.trace.model_libraries`)
    libraries: tuple[str, ...] = ()

    @property
    def call_spec(self) -> CallSpec | None:
        """How the model was called; None when the plan records none or a file cannot carry
        it (`call["tree"]` is None)."""
        if self.call is None or self.call["tree"] is None:
            return None
        return CallSpec.from_data(self.call)

    def trace_data(self) -> dict[str, Any]:
        """The trace's identity as plain data (`core.trace.describe_difference` compares it)."""
        data: dict[str, Any] = {
            "params": [[n, s] for n, s in self.params],
            "state": list(self.state),
            "inputs": [[list(s), d, g] for s, d, g in self.inputs],
            "n_nodes": self.n_nodes,
            "autocast": self.autocast.to_data(),
        }
        if self.call is not None:
            data["call"] = self.call
        if self.ops:
            data["ops"] = list(self.ops)
        return data

    def to_data(self) -> dict[str, Any]:
        """What a plan file holds (`core.plan_io.check_graph_meta` checks it back)."""
        data = self.trace_data()
        if self.loss_head.to_data() is not None:
            data["loss_head"] = self.loss_head.to_data()
        if self.optimizer is not None:
            data["optimizer"] = self.optimizer
        if self.costs is not None:
            data["costs"] = self.costs.to_data()
        if self.device != CPU:
            data["device"] = self.device.to_data()
        if self.values:
            data["values"] = [[i, list(v)] for i, v in self.values]
        if self.torch_version:
            data["torch"] = self.torch_version
        if self.libraries:
            data["libraries"] = list(self.libraries)
        return data

    @staticmethod
    def from_data(data: dict[str, Any]) -> GraphMeta:
        """The record `to_data` (or `core.trace.graph_meta`) wrote, already checked."""
        return GraphMeta(
            params=tuple((str(n), str(s)) for n, s in data["params"]),
            state=tuple(map(str, data["state"])),
            inputs=tuple((tuple(s), str(d), bool(g)) for s, d, g in data["inputs"]),
            n_nodes=int(data["n_nodes"]),
            call=data.get("call"),
            autocast=Autocast.from_data(data.get("autocast", [])),
            loss_head=LossHead.from_data(data.get("loss_head")),
            optimizer=data.get("optimizer"),
            costs=CostRecord.from_data(data["costs"]) if "costs" in data else None,
            device=DeviceModel.from_data(data.get("device")),
            values=tuple((int(i), tuple(map(int, v))) for i, v in data.get("values", [])),
            torch_version=str(data.get("torch", "")),
            ops=tuple(map(str, data.get("ops", []))),
            libraries=tuple(map(str, data.get("libraries", []))),
        )
