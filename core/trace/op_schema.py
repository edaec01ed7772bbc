"""What an ATen op's schema says, and what it leaves out: the arguments it writes in place
(declared, and batch-norm's undeclared running statistics), the C++ callable behind it, and the
model's own source line behind a traced op (for people reading the graph)."""

from __future__ import annotations

import os
import re
from collections.abc import Sequence
from typing import Any

import torch

_TORCH_DIR = os.path.dirname(torch.__file__)
_TRACE_DIR = os.path.dirname(__file__)  # this package: the capture's own frames are not the model's

# Ops whose schema does not declare the running statistics they update in training mode.
_UNDECLARED_WRITES = {
    torch.ops.aten.native_batch_norm.default: ((3, "running_mean"), (4, "running_var")),
    torch.ops.aten.cudnn_batch_norm.default: ((3, "running_mean"), (4, "running_var")),
    torch.ops.aten.miopen_batch_norm.default: ((3, "running_mean"), (4, "running_var")),
}


def fast_callable(target: Any) -> Any:
    """The C++ callable behind an ATen OpOverload (skips one Python frame per call)."""
    return getattr(target, "_op", target)


def aliases_schema_write(target: Any) -> list[tuple[int, str]]:
    """(position, name) of every argument an op writes in place, from its schema."""
    schema = getattr(target, "_schema", None)
    if schema is None:
        return []
    return [
        (i, a.name)
        for i, a in enumerate(schema.arguments)
        if a.alias_info is not None and a.alias_info.is_write
    ]


def undeclared_writes(target: Any, args: Sequence[Any]) -> list[tuple[int, str]]:
    """Arguments an op writes although its schema does not say so: batch-norm's running
    statistics in training mode, which it updates but does not read (passing None computes
    the same outputs without updating anything)."""
    training = len(args) > 5 and args[5] is True
    return list(_UNDECLARED_WRITES.get(target, ())) if training else []


def written_args(fx_node: torch.fx.Node, index: dict[torch.fx.Node, int]) -> tuple[int, ...]:
    """The nodes (by `index`) an fx op node writes in place, declared or not."""
    writes = aliases_schema_write(fx_node.target) + undeclared_writes(fx_node.target, fx_node.args)
    written = []
    for pos, name in writes:
        arg = fx_node.args[pos] if pos < len(fx_node.args) else fx_node.kwargs.get(name)
        if isinstance(arg, torch.fx.Node):
            written.append(index[arg])
    return tuple(written)


def user_frame(stack_trace: str | None) -> str | None:
    """The innermost frame of `stack_trace` outside torch and this package, as
    "file.py:12 in forward: y = self.lin(x)" (None when there is none)."""
    if not stack_trace:
        return None
    frames = re.findall(r'File "([^"]+)", line (\d+), in (\S+)\n\s*(.*)', stack_trace)
    for path, line, func, code in reversed(frames):
        if not path.startswith(_TORCH_DIR) and os.path.dirname(path) != _TRACE_DIR:
            return f"{os.path.basename(path)}:{line} in {func}: {code.strip()}"
    return None
