"""The model's Python branches on tensor values, taken under fake tensors as eager takes them.

A model may read a tensor's value and branch on it. Hugging Face's mask creation does: on
eager tensors it reads the position ids (one sequence per row, or packed?) and the padding
mask (any padding?) and, when neither calls for a mask, returns none and lets SDPA run its
causal path (`is_causal=True`). Under fake tensors those values are unknown, so transformers
asks `is_tracing(tensor)` first, which is true of a fake tensor, and then always builds the
mask: the trace would run another attention than eager (a mask made at the root, SDPA's
`where` on it, and no `ones`/`tril` inside the layer), and a native plan matched against it
refuses at the first op that differs.

`eager_branches(known)` gives the fake step the values eager would read: each small tensor
whose value follows from the step's constants (an `arange`, a tensor made from Python data)
or from the example's integer and boolean inputs (token ids, masks, position ids) is
computed for real on the CPU beside its fake twin; a scalar read of such a tensor (`bool`,
`.item()`, `torch.equal`) answers with the real value, and transformers' `is_fake_tensor`
answers False for it, so `is_tracing` lets the model branch as eager does. Random ops,
parameters and activations are never computed (they stay unknown, and a read of them fails
as before). The reads themselves run no ATen op in the trace; the ops computing the value
read (`diff`, `cumsum`, `eq`, `all`) are traced, as eager runs them.
"""

from __future__ import annotations

import contextlib
import sys
import threading
from collections.abc import Iterator, Sequence
from typing import Any

import torch
from torch._subclasses.fake_tensor import FakeTensor
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes
from torch.utils._pytree import tree_flatten, tree_unflatten
from torch.utils.weak import WeakIdKeyDictionary

aten = torch.ops.aten
_CAP = 1 << 16  # elements: a tensor larger than this is not computed (masks and ids only)
# reads of a value into Python: eager runs them, the trace has no node for them
SCALAR_READS = frozenset(
    {aten._local_scalar_dense.default, aten.is_nonzero.default, aten.equal.default}
)
_ACTIVE = threading.local()  # .modes: the `_Values` modes open in this thread


class _Values(TorchDispatchMode):
    """Real CPU values beside the fake tensors that have one (see the module docstring)."""

    def __init__(self, known: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> None:
        super().__init__()
        self.real: WeakIdKeyDictionary = WeakIdKeyDictionary()
        with _disable_current_modes():  # real copies, not fakes of them
            for fake, value in known:
                if _readable(value):
                    self.real[fake] = value.detach().to("cpu", copy=True)

    def knows(self, t: torch.Tensor) -> bool:
        """Whether `t`'s real value is known."""
        return t in self.real

    def _value(self, x: Any) -> Any:
        """The real value standing for `x` (a tensor, None when unknown), or `x` itself."""
        if not isinstance(x, torch.Tensor):
            return torch.device("cpu") if isinstance(x, torch.device) else x
        if x in self.real:
            return self.real[x]
        # a real integer constant (Python data lifted into the step), copied: never written
        return x.detach().to("cpu", copy=True) if _readable(x) else None

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
        kwargs = kwargs or {}
        flat, spec = tree_flatten((args, kwargs))
        with _disable_current_modes():  # real copies, not fakes of them
            values = [self._value(x) for x in flat]
        known = torch.Tag.nondeterministic_seeded not in func.tags and all(
            v is not None for x, v in zip(flat, values) if isinstance(x, torch.Tensor)
        )
        if func in SCALAR_READS and known:  # eager's answer; no op in the trace
            real_args, real_kwargs = tree_unflatten(values, spec)
            with _disable_current_modes():
                return func(*real_args, **real_kwargs)
        out = func(*args, **kwargs)
        outs = [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)]
        if known and sum(t.numel() for t in outs) <= _CAP:
            real_args, real_kwargs = tree_unflatten(values, spec)
            with _disable_current_modes():
                real = func(*real_args, **real_kwargs)
            reals = [t for t in tree_flatten(real)[0] if isinstance(t, torch.Tensor)]
            for fake, value in zip(outs, reals, strict=True):
                self.real[fake] = value
            return out
        for t in [*_written(func, args, kwargs), *outs]:  # written from what is unknown
            self.real.pop(t, None)
        return out


def _readable(t: torch.Tensor) -> bool:
    """A real tensor whose value may be read: integer or boolean, small, with data."""
    return (
        not isinstance(t, FakeTensor)
        and t.device.type != "meta"
        and not t.is_floating_point()
        and not t.is_complex()
        and t.numel() <= _CAP
    )


def _written(func: Any, args: tuple, kwargs: dict) -> list[torch.Tensor]:
    """The tensor arguments `func` writes in place."""
    out: list[torch.Tensor] = []
    for i, a in enumerate(func._schema.arguments):
        if a.alias_info is not None and a.alias_info.is_write:
            x = args[i] if i < len(args) else kwargs.get(a.name)
            out.extend(t for t in tree_flatten(x)[0] if isinstance(t, torch.Tensor))
    return out


def _is_fake_tensor(x: Any) -> bool:
    """transformers' `is_fake_tensor` (an isinstance check), False for a fake tensor whose
    value a `_Values` mode of this thread knows."""
    if not isinstance(x, FakeTensor):
        return False
    return not any(m.knows(x) for m in getattr(_ACTIVE, "modes", ()))


_PATCH_LOCK = threading.Lock()


@contextlib.contextmanager
def eager_branches(known: Sequence[tuple[torch.Tensor, torch.Tensor]] = ()) -> Iterator[None]:
    """Run the fake step with the real values eager would read (module docstring). `known`
    pairs fake tensors with their real values; only integer and boolean ones of at most
    `_CAP` elements, with data, are used."""
    mode = _Values(known)
    _patch_transformers()
    modes = getattr(_ACTIVE, "modes", ())
    _ACTIVE.modes = (*modes, mode)
    try:
        with mode:
            yield
    finally:
        _ACTIVE.modes = modes


def _patch_transformers() -> None:
    """transformers' `is_fake_tensor` (which its `is_tracing` reads) replaced, process-wide,
    by `_is_fake_tensor`: the same answer, except inside `eager_branches` for a fake tensor
    whose value is known."""
    utils = sys.modules.get("transformers.utils.import_utils")
    if utils is None:
        return
    with _PATCH_LOCK:
        if getattr(utils, "is_fake_tensor", None) is not _is_fake_tensor:
            setattr(utils, "is_fake_tensor", _is_fake_tensor)  # noqa: B010
