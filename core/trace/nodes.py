"""The traced step as data: `AtenNode`s in execution order (placeholders, then ops), each op's
arguments with `Ref`s to earlier nodes, the shapes (`TensorSpec`) and storages it returns, and
the `Trace` that ties them to the model's parameters, inputs, outputs and gradients."""

from __future__ import annotations

import operator
from dataclasses import dataclass, field
from typing import Any

import torch

from core.trace.autocast import Autocast
from core.trace.call import CallSpec
from core.trace.module_state import ModuleState

ROLES = ("param", "state", "input", "tangent", "constant", "op")


@dataclass(frozen=True)
class Ref:
    """A reference to another node's result inside an op's arguments."""

    index: int


@dataclass(frozen=True)
class TensorSpec:
    """Shape and dtype of one tensor: what the fingerprint and error messages compare."""

    shape: tuple[int, ...]
    dtype: str

    @staticmethod
    def of(t: torch.Tensor) -> TensorSpec:
        """The spec of a (real or fake) tensor."""
        return TensorSpec(tuple(int(s) for s in t.shape), str(t.dtype).removeprefix("torch."))

    def __str__(self) -> str:
        return f"{self.dtype}{list(self.shape)}"


@dataclass
class AtenNode:
    """One node of the traced graph: a placeholder (role param/state/input/tangent) or an op."""

    index: int
    name: str
    role: str
    target: Any = None  # the ATen OpOverload, or operator.getitem
    args: tuple = ()
    kwargs: dict = field(default_factory=dict)
    reads: tuple[int, ...] = ()  # nodes whose results this node reads
    specs: tuple[TensorSpec, ...] = ()  # tensors it returns
    storages: tuple[int, ...] = ()  # storage of each returned tensor (aliases share one)
    strides: tuple[tuple[int, ...], ...] = ()  # stride of each returned tensor
    writes: tuple[int, ...] = ()  # nodes it mutates in place
    random: bool = False  # draws from the random generator
    module: str | None = None  # module path that ran it (forward ops only)
    source: str | None = None  # the model's Python line that made it: "file.py:12 in forward: ..."
    seq_nr: int = -1  # autograd sequence number: a backward node shares its forward op's

    @property
    def label(self) -> str:
        """Short op name for people: 'aten.mm', 'getitem', or the placeholder role."""
        if self.target is None:
            return self.role
        if self.target is operator.getitem:
            return "getitem"
        return f"aten.{self.target._opname}"


@dataclass
class Trace:
    """The captured step: nodes in execution order and how they map to the model."""

    nodes: list[AtenNode]
    storage_bytes: dict[int, int]
    param_names: list[str]  # trainable parameters, in placeholder order
    param_specs: list[TensorSpec]
    state_names: list[str]  # buffers and frozen parameters
    input_specs: list[TensorSpec]
    grad_inputs: list[int]  # positions of inputs that require grad
    outputs: list[int]  # node of each flattened model output
    output_spec: Any  # pytree spec rebuilding the model's output structure
    diff_outputs: list[int]  # positions in `outputs` that receive a tangent
    tangents: list[int]  # tangent placeholder for each of diff_outputs
    grads: list[int | None]  # gradient node per param, then per grad input (None: unused)
    call: CallSpec  # how the model is called: what the planned module checks
    # tensors the model creates from Python data (`torch.tensor(0)`, a scalar written into a
    # slice): make_fx lifts them into constants; node -> its value, on the traced device
    constants: dict[int, torch.Tensor] = field(default_factory=dict)
    autocast: Autocast = Autocast()  # the mixed-precision state the forward was traced under
    module_state: ModuleState = ModuleState()  # the submodules' plain attributes it baked in
