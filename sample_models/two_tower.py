"""Two-tower model (a join graph): two encoders meet in one head.

Tower A and tower B encode their own input (a query and a document, or two modalities) and a
head scores the pair from [a, b, a * b, |a - b|]. With `shared` the towers are one module
(a Siamese network): the same weights run on both inputs and their gradients add up. The
step's graph is two chains joined at the head, not one chain.
"""

from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F


@dataclass
class TwoTowerConfig:
    in_a: int = 64
    in_b: int = 64  # must equal in_a when shared
    width: int = 128
    depth_a: int = 3  # residual MLP layers per tower
    depth_b: int = 2  # ignored when shared
    shared: bool = False
    dropout: float = 0.1
    num_classes: int = 2


class ResidualMLP(nn.Module):
    """x + Dropout(Linear(GELU(Linear(LayerNorm(x)))))."""

    def __init__(self, width: int, dropout: float):
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.fc1 = nn.Linear(width, 4 * width)
        self.fc2 = nn.Linear(4 * width, width)
        self.dropout = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.dropout(self.fc2(F.gelu(self.fc1(self.norm(x)))))


class Tower(nn.Module):
    def __init__(self, d_in: int, width: int, depth: int, dropout: float):
        super().__init__()
        self.embed = nn.Linear(d_in, width)
        self.layers = nn.Sequential(*[ResidualMLP(width, dropout) for _ in range(depth)])
        self.norm = nn.LayerNorm(width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(self.layers(self.embed(x)))


class TwoTower(nn.Module):
    def __init__(self, config: TwoTowerConfig):
        super().__init__()
        c = config
        self.config = c
        self.tower_a = Tower(c.in_a, c.width, c.depth_a, c.dropout)
        if c.shared:
            assert c.in_a == c.in_b, "shared towers read inputs of one width"
            self.tower_b = self.tower_a
        else:
            self.tower_b = Tower(c.in_b, c.width, c.depth_b, c.dropout)
        self.head = nn.Sequential(
            nn.Linear(4 * c.width, c.width), nn.GELU(), nn.Linear(c.width, c.num_classes)
        )

    def forward(
        self, a: torch.Tensor, b: torch.Tensor, targets: torch.Tensor | None = None
    ) -> torch.Tensor:
        ea, eb = self.tower_a(a), self.tower_b(b)
        logits = self.head(torch.cat([ea, eb, ea * eb, (ea - eb).abs()], dim=-1))
        if targets is None:
            return logits
        return F.cross_entropy(logits, targets)
