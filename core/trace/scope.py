"""Which submodule is running while the step is traced, and tracing failures turned into
`UnsupportedModel` errors that name the op, the module and the fix."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any, TypeVar

import torch.fx.traceback as fx_traceback
from torch import nn
from torch._subclasses.fake_tensor import (
    DataDependentOutputException,
    DynamicOutputShapeException,
    UnsupportedOperatorException,
)

from core.errors import UnsupportedModel

T = TypeVar("T")

_DATA_DEPENDENT_FIX = (
    "the graph must not depend on tensor values: replace .item(), bool(tensor) or "
    "`if tensor:` with tensor ops such as torch.where"
)


class ModuleScope:
    """Tracks which submodule is running: trace failures name it, and every traced forward
    node records it in `node.meta["custom"]["module"]` (blocks are cut at module boundaries)."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self.stack: list[str] = []
        self.tags: list[Any] = []
        self.handles: list[Any] = []

    def __enter__(self) -> ModuleScope:
        for name, mod in self.model.named_modules():
            self.handles.append(mod.register_forward_pre_hook(self._push(name)))
            self.handles.append(mod.register_forward_hook(self._pop))
        self.meta = fx_traceback.preserve_node_meta()
        self.meta.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        while self.tags:
            self.tags.pop().__exit__(None, None, None)
        self.meta.__exit__(None, None, None)
        for h in self.handles:
            h.remove()

    def _push(self, name: str) -> Callable[[nn.Module, Any], None]:
        def hook(mod: nn.Module, args: Any) -> None:
            self.stack.append(name)
            tag = fx_traceback.annotate({"module": name})
            tag.__enter__()
            self.tags.append(tag)

        return hook

    def _pop(self, mod: nn.Module, args: Any, out: Any) -> None:
        if self.stack:
            self.stack.pop()
            self.tags.pop().__exit__(None, None, None)

    @property
    def where(self) -> str:
        """'blocks.0.attn (Attention)': the innermost running module, for error messages."""
        if not self.stack:
            return ""
        name = self.stack[-1]
        mod = self.model.get_submodule(name)
        return f"{name} ({type(mod).__name__})" if name else f"{type(mod).__name__} (the root)"


def guard(scope: ModuleScope, fn: Callable[[], T]) -> T:
    """Run `fn`, turning tracing failures into UnsupportedModel naming op and module (fake
    tensors' own log of a failing shape function is silenced: the error says it)."""
    log = logging.getLogger("torch._subclasses.fake_tensor")
    level = log.level
    log.setLevel(logging.CRITICAL)
    try:
        return fn()
    except UnsupportedModel:
        raise
    except DataDependentOutputException as e:
        raise UnsupportedModel(
            f"data-dependent control flow (op {e.func})", scope.where, _DATA_DEPENDENT_FIX
        ) from None
    except DynamicOutputShapeException as e:
        raise UnsupportedModel(
            f"an op whose output shape depends on the data ({e.func})",
            scope.where,
            "use fixed-shape ops (masking with torch.where instead of boolean indexing)",
        ) from None
    except UnsupportedOperatorException as e:
        raise UnsupportedModel(
            f"the op {e.func}", scope.where, "it has no fake-tensor implementation"
        ) from None
    except Exception as e:  # noqa: BLE001 - anything the model raises while tracing
        raise _failure(e, scope.where) from None
    finally:
        log.setLevel(level)


def _failure(e: Exception, where: str) -> UnsupportedModel:
    """The UnsupportedModel for any other exception the model raised while traced."""
    if _raised_in_checkpoint(e):
        return UnsupportedModel(
            "torch.utils.checkpoint (reentrant) inside the forward pass",
            where,
            "remove the inner checkpoint: the plan decides what to keep and what to "
            "recompute for the whole step and replaces it",
        )
    if "data-dependent" in str(e) or "data dependent" in str(e):
        return UnsupportedModel("data-dependent control flow", where, _DATA_DEPENDENT_FIX)
    text = str(e).strip().splitlines()[0] if str(e).strip() else ""
    return UnsupportedModel(
        f"the forward pass ({type(e).__name__}: {text[:300]})",
        where,
        "check that the example inputs match what the model expects; if they do, an op "
        "there may lack a shape (meta) implementation for them in this torch: use another "
        "implementation of that module (e.g. transformers' attn_implementation or "
        "experts_implementation)",
    )


def _raised_in_checkpoint(e: BaseException) -> bool:
    """Whether `e` came from inside torch.utils.checkpoint, whose reentrant form fails under
    the fake tensors of the trace."""
    tb = e.__traceback__
    while tb is not None:
        if tb.tb_frame.f_code.co_filename.endswith(("utils/checkpoint.py", "utils\\checkpoint.py")):
            return True
        tb = tb.tb_next
    return False
