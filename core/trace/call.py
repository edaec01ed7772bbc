"""How a step calls the model: the tensors of `model(*args, **kwargs)` (then `loss_fn(output,
*targets)`) in one flat list, and the `CallSpec` that rebuilds the call from them. The trace
records the spec; the planned module checks every call against it."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.utils._pytree as pytree
from torch._subclasses.fake_tensor import FakeTensorMode


@dataclass(frozen=True)
class CallSpec:
    """How a step calls the model: the structure of (args, kwargs), the non-tensor values in
    it (bound when traced, checked on every call), how many targets follow for `loss_fn`."""

    tree: Any  # pytree spec of (args, kwargs)
    constants: tuple[tuple[int, Any], ...]  # (leaf position, value) of non-tensor leaves
    n_targets: int = 0
    loss: bool = False  # a loss_fn(output, *targets) follows the model

    def to_data(self) -> dict[str, Any]:
        """Plain data for a plan file; `tree` is None when the call holds values a plan file
        cannot carry (custom containers, non-plain constants)."""
        try:
            tree = pytree.treespec_dumps(self.tree)
        except Exception:  # noqa: BLE001 - a custom container pytree cannot serialise
            tree = None
        if not all(isinstance(v, (type(None), bool, int, float, str)) for _, v in self.constants):
            tree = None
        constants = [[i, v] for i, v in self.constants] if tree is not None else []
        return {"tree": tree, "constants": constants, "targets": self.n_targets, "loss": self.loss}

    def describe(self) -> str:
        """'with 1 positional arguments and keywords ['attention_mask']': for error messages."""
        args, kwargs = pytree.tree_unflatten([None] * self.tree.num_leaves, self.tree)
        out = f"with {len(args)} positional arguments and keywords {sorted(kwargs)}"
        return out + (f" and {self.n_targets} targets" if self.loss else "")

    def leaf_name(self, leaf: int) -> str:
        """The argument a leaf is: 'use_cache', '#2' (position), or 'leaf 5' (nested)."""
        args, kwargs = pytree.tree_unflatten(list(range(self.tree.num_leaves)), self.tree)
        names = {v: repr(k) for k, v in kwargs.items() if isinstance(v, int)}
        names |= {v: f"#{p}" for p, v in enumerate(args) if isinstance(v, int)}
        return names.get(leaf, f"leaf {leaf}")

    @staticmethod
    def from_data(data: dict[str, Any]) -> CallSpec:
        """The spec `to_data` wrote (a plan file's "call")."""
        tree = pytree.treespec_loads(data["tree"])
        constants = tuple((int(i), v) for i, v in data["constants"])
        return CallSpec(tree, constants, int(data["targets"]), bool(data["loss"]))


def split_call(
    args: Sequence[Any],
    kwargs: dict[str, Any] | None,
    targets: Sequence[Any] = (),
    loss: bool = False,
) -> tuple[list[Any], CallSpec]:
    """The tensors of a call, in order (targets last), and what rebuilds the call from them."""
    leaves, tree = pytree.tree_flatten((tuple(args), dict(kwargs or {})))
    tensors = [x for x in leaves if isinstance(x, torch.Tensor)]
    constants = tuple((i, x) for i, x in enumerate(leaves) if not isinstance(x, torch.Tensor))
    return tensors + list(targets), CallSpec(tree, constants, len(targets), loss)


def join_call(tensors: Sequence[Any], call: CallSpec) -> tuple[tuple, dict, tuple]:
    """(args, kwargs, targets) from the tensors `split_call` gave."""
    n = len(tensors) - call.n_targets
    fixed = dict(call.constants)
    it = iter(tensors[:n])
    leaves = [fixed[i] if i in fixed else next(it) for i in range(call.tree.num_leaves)]
    args, kwargs = pytree.tree_unflatten(leaves, call.tree)
    return args, kwargs, tuple(tensors[n:])


def fake_call(
    inputs: Sequence[tuple[Sequence[int], str | torch.dtype, bool]],
    call: CallSpec,
    device: torch.device | str,
    mode: FakeTensorMode | None = None,
    values: Mapping[int, Sequence[int]] | None = None,
) -> tuple[tuple, dict, tuple]:
    """(args, kwargs, targets) of `call` on fake tensors shaped as `inputs` records (shape,
    dtype, requires grad): the call a recorded step is traced again with, nothing allocated
    however large the shapes. `mode` is the fake mode they belong to (a new one by default).
    `values`: the recorded values of small integer inputs (token ids, masks), made real on a
    CPU device so the model's Python branches on them go as they went (`eager_branches`)."""
    dtypes = [getattr(torch, d) if isinstance(d, str) else d for _, d, _ in inputs]
    with mode or FakeTensorMode():
        example = [
            torch.empty(tuple(shape), dtype=dtype, device=device).requires_grad_(grad)
            for (shape, _, grad), dtype in zip(inputs, dtypes, strict=True)
        ]
    if torch.device(device).type == "cpu":
        for i, vals in (values or {}).items():
            example[i] = torch.tensor(list(vals), dtype=dtypes[i]).reshape(tuple(inputs[i][0]))
    return join_call(example, call)


def small_int_values(tensors: Sequence[Any], cap: int = 1 << 16) -> dict[int, list[int]]:
    """The values of a call's small integer and boolean CPU tensors (token ids, masks; at
    most `cap` elements each), by position: what a plan records so that a trace on fake
    inputs branches as the example did."""
    out = {}
    for i, t in enumerate(tensors):
        if (
            isinstance(t, torch.Tensor)
            and type(t) is torch.Tensor
            and t.device.type == "cpu"
            and (t.dtype == torch.bool or not (t.is_floating_point() or t.is_complex()))
            and t.numel() <= cap
        ):
            out[i] = [int(v) for v in t.flatten().tolist()]
    return out


def unflatten_output(leaves: list[Any], spec: Any) -> Any:
    """Rebuild the model's output structure (tuple, dict, dataclass...) from flat leaves."""
    return pytree.tree_unflatten(leaves, spec)
