"""Plain multilayer perceptron classifier: a stack of Linear-ReLU layers."""

from dataclasses import dataclass
from itertools import pairwise

import torch
import torch.nn as nn
import torch.nn.functional as F


@dataclass
class MLPConfig:
    in_features: int = 784
    width: int = 1024
    n_layer: int = 8  # Linear layers, counting the classifier head
    num_classes: int = 10
    dropout: float = 0.0


class Layer(nn.Module):
    def __init__(self, d_in: int, d_out: int, dropout: float):
        super().__init__()
        self.fc = nn.Linear(d_in, d_out)
        self.relu = nn.ReLU(inplace=False)
        # Skipped entirely at p=0 so the default graph has no dropout nodes.
        self.dropout = nn.Dropout(dropout) if dropout > 0 else nn.Identity()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.relu(self.fc(x)))


class MLP(nn.Module):
    def __init__(self, config: MLPConfig):
        super().__init__()
        assert config.n_layer >= 1
        self.config = config
        dims = [config.in_features] + [config.width] * (config.n_layer - 1)
        self.layers = nn.ModuleList(
            [Layer(d_in, d_out, config.dropout) for d_in, d_out in pairwise(dims)]
        )
        self.head = nn.Linear(dims[-1], config.num_classes)

    def forward(self, x: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        logits = self.head(x)
        if targets is None:
            return logits
        return F.cross_entropy(logits, targets)
