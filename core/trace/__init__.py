"""Trace one training step (forward and backward) to a graph of ATen ops, on fake tensors.

The parts, in the order they import each other:
- `autocast`: the mixed-precision state a step runs under (`Autocast`, `autocast_off`);
- `module_state`: the submodules' plain attributes a trace bakes in (`ModuleState`, `Watch`);
- `call`: how a step calls the model (`CallSpec`, `split_call`, `join_call`, `unflatten_output`);
- `nodes`: the traced step as data (`Ref`, `TensorSpec`, `AtenNode`, `Trace`);
- `op_schema`: what an op's schema says it writes, and what it leaves out (`aliases_schema_write`,
  `undeclared_writes`, `fast_callable`, `user_frame`);
- `identity`: what a plan file records about its graph (`graph_meta`, `fingerprint`,
  `describe_difference`, `op_sequence`,
  `model_libraries`);
- `functionalize`: in-place ops on tensors already read, rewritten out of place;
- `scope`: which submodule runs while tracing; failures as `UnsupportedModel`;
- `attention`: the kernel `scaled_dot_product_attention` runs on a device, by torch's rules,
  and that kernel in a trace for another device (`AttentionMode`, `select`);
- `cuda_autocast`: CUDA's autocast cast lists on CPU tensors (a GPU step traced here);
- `device`: the device a step is traced for (`DeviceModel`) and its dispatch (`DeviceDispatch`:
  attention, CUDA's fused dropout);
- `convert`: the fx graph as `AtenNode`s with numbered storages;
- `capture`: the joint forward+backward graph (`capture`), built from the parts above.

Capture's private PyTorch APIs (fake tensors, op schemas, pytree internals) live in this
package. Three other modules use private APIs too, each for one purpose: `core.interpret` (the
generated `torch._C` bindings it calls ops through, `TorchDispatchMode`), `core.memory`
(`TorchDispatchMode`, pytree, storage `_cdata` ids) and `core.runtime` (autograd's keep-graph
flag). A torch upgrade should touch this package and those three files, no other.
"""

from core.trace.autocast import Autocast, autocast_off
from core.trace.call import CallSpec, fake_call, join_call, split_call, unflatten_output
from core.trace.capture import capture
from core.trace.identity import (
    describe_difference,
    fingerprint,
    graph_meta,
    model_libraries,
    op_sequence,
    other_libraries,
)
from core.trace.module_state import ModuleState, Watch
from core.trace.nodes import ROLES, AtenNode, Ref, TensorSpec, Trace
from core.trace.op_schema import aliases_schema_write, fast_callable, undeclared_writes, user_frame

__all__ = [
    "ROLES",
    "AtenNode",
    "Autocast",
    "CallSpec",
    "Ref",
    "TensorSpec",
    "ModuleState",
    "Trace",
    "Watch",
    "aliases_schema_write",
    "autocast_off",
    "capture",
    "describe_difference",
    "fast_callable",
    "fingerprint",
    "model_libraries",
    "op_sequence",
    "other_libraries",
    "graph_meta",
    "fake_call",
    "join_call",
    "split_call",
    "undeclared_writes",
    "unflatten_output",
    "user_frame",
]
