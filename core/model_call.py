"""A `ModelCall`: a model and how one training step calls it, keyword inputs and a loss
computed outside the model included, as Hugging Face models are trained. The command line and
the app name one by a MODEL argument (`app.models`)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_leaves

from core.problem import Problem, analyze


@dataclass
class ModelCall:
    """A model and how one training step calls it: `loss_fn(model(*args, **kwargs), *targets)`,
    or the model's own output when `loss_fn` is None (what `core.analyze` takes)."""

    model: nn.Module
    args: tuple = ()
    kwargs: dict[str, Any] = field(default_factory=dict)
    loss_fn: Callable[..., torch.Tensor] | None = None
    targets: tuple = ()

    def analyze(self, **options: Any) -> Problem:
        """`core.analyze` of this call (`options`: costs, device, name, progress)."""
        return analyze(self.model, self.args, self.kwargs, self.loss_fn, self.targets, **options)

    def tensors(self) -> list[torch.Tensor]:
        """Every input tensor of the call, targets included (what a step's peak leaves out)."""
        leaves = tree_leaves((self.args, self.kwargs, self.targets))
        return [t for t in leaves if isinstance(t, torch.Tensor)]

    def run(self, planned: nn.Module) -> torch.Tensor:
        """One forward of `planned` (the model, or `core.apply_plan`'s wrapper of it) as the
        call says, to the loss."""
        if self.loss_fn is None:
            return planned(*self.args, **self.kwargs)
        if planned is self.model:
            return self.loss_fn(planned(*self.args, **self.kwargs), *self.targets)
        return planned(*self.args, **self.kwargs, targets=self.targets)
