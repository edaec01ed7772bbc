"""A stack of nn.MultiheadAttention layers (batch first), each with a residual and a
LayerNorm: attention as PyTorch's own module computes it, not a hand-written one."""

from __future__ import annotations

import torch
from torch import nn


class AttentionLayer(nn.Module):
    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.attn = nn.MultiheadAttention(dim, heads, batch_first=True)
        self.norm = nn.LayerNorm(dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(x + self.attn(x, x, x)[0])


class AttentionStack(nn.Module):
    """`layers` attention layers; the loss is the mean square of the last one's output."""

    def __init__(self, dim: int = 32, heads: int = 2, layers: int = 2) -> None:
        super().__init__()
        self.layers = nn.Sequential(*(AttentionLayer(dim, heads) for _ in range(layers)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layers(x).square().mean()


def build(
    dim: int = 32, heads: int = 2, layers: int = 2, batch: int = 2, seq: int = 32
) -> tuple[nn.Module, tuple[torch.Tensor]]:
    """(model, (x,)): seeded weights and inputs, the caller's RNG stream untouched."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = AttentionStack(dim, heads, layers).train()
    x = torch.randn(batch, seq, dim, generator=torch.Generator().manual_seed(0))
    return model, (x,)
