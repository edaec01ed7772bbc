"""What every zoo builder returns: one training step of a model nobody here wrote, called as
its users call it (`sample_models.hf_zoo`, `.timm_zoo`, `.diffusers_zoo`). Imports no
third-party library, so each zoo needs only its own."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn


@dataclass
class ZooCase:
    """One training step of a zoo model, called as its users call it."""

    model: nn.Module
    args: tuple
    kwargs: dict[str, Any]
    loss_fn: Callable[..., torch.Tensor]
    targets: tuple[torch.Tensor, ...]
    layers: int  # repeated layers: blocks checkpoint_blocks must find at least


def class_loss(output: Any, labels: torch.Tensor) -> torch.Tensor:
    """Cross-entropy over class logits (a ModelOutput's or a plain tensor), outside the model."""
    logits = output.logits if hasattr(output, "logits") else output
    return nn.functional.cross_entropy(logits, labels)


def made(build: Callable[[], nn.Module]) -> nn.Module:
    """`build()` in training mode, its weights from seed 0; the caller's random stream is left
    as it was."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        return build().train()
