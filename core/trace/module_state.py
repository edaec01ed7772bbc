"""What a trace bakes in beyond its tensors: each submodule's plain attributes.

A trace records the ops one call ran. The Python switches that chose those ops are not
tensors: `training`, a dropout's `p`, an adapter's on/off flag, an attention implementation's
name. Changed after tracing, the planned step would still run the old ops, silently. So the
trace records every plain attribute (bool, int, float, str, None) of every submodule, and the
planned module checks them at every call that runs the plan (`Watch.check`, tens of
microseconds: docs/results.md).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from torch import nn

from core.errors import PlanMismatch

_PLAIN = (bool, int, float, str, type(None))
_UNSET = object()


@dataclass(frozen=True)
class ModuleState:
    """`(module path, attribute, value)` for every plain attribute of every submodule."""

    rows: tuple[tuple[str, str, Any], ...] = ()

    @classmethod
    def of(cls, model: nn.Module) -> ModuleState:
        return cls(
            tuple(
                (path, name, value)
                for path, module in model.named_modules(remove_duplicate=False)
                for name, value in vars(module).items()
                if isinstance(value, _PLAIN)
            )
        )

    def watch(self, model: nn.Module) -> Watch:
        """A fast checker of `model` against this state (PlanMismatch if it differs now)."""
        modules = dict(model.named_modules(remove_duplicate=False))
        watch = Watch(
            self,
            tuple(modules[p].__dict__ if p in modules else {} for p, _, _ in self.rows),
        )
        watch.check()
        return watch


@dataclass(frozen=True)
class Watch:
    """The recorded attributes, read straight from the modules' `__dict__`s."""

    state: ModuleState
    dicts: tuple[dict[str, Any], ...]

    def check(self) -> None:
        """PlanMismatch naming the first module attribute that differs from the trace's."""
        for d, (path, name, value) in zip(self.dicts, self.state.rows, strict=True):
            now = d.get(name, _UNSET)
            if now is not value and (type(now) is not type(value) or now != value):
                raise PlanMismatch(_changed(path, name, value, now))


def _changed(path: str, name: str, then: Any, now: Any) -> str:
    where = f"model.{path}" if path else "model"
    shown = "unset" if now is _UNSET else repr(now)
    text = f"{where}.{name} is {shown}, the plan was traced with {then!r}"
    if name == "training":
        return (
            f"{text}: the plan is a training step in {'train' if then else 'eval'} mode. Set the "
            "mode back, run evaluation under torch.no_grad() (it runs the model itself), or "
            "make a plan in this mode"
        )
    return f"{text}: the traced step baked it in. Set it back, or make a new plan with it"
