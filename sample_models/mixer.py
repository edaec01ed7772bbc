"""MLP-Mixer (Tolstikhin et al., 2021): patches mixed by MLPs across tokens, then channels.

Each block is an `nn.ModuleDict` of its layers, and the root's `forward` runs the block:
the residual adds and the transposes around the token MLP are the root's own code, not a
submodule's. So no submodule's forward is a block, as in models written this way (timm's
`MixerBlock` is a module; many research codebases are not).
"""

from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F


@dataclass
class MixerConfig:
    image_size: int = 32
    patch_size: int = 4
    in_chans: int = 3
    n_layer: int = 4
    n_embd: int = 64  # channels per token
    token_hidden: int = 32  # the token MLP's width
    channel_hidden: int = 128  # the channel MLP's width
    num_classes: int = 10
    dropout: float = 0.1


def _mlp(d: int, hidden: int, dropout: float) -> nn.Sequential:
    return nn.Sequential(nn.Linear(d, hidden), nn.GELU(), nn.Dropout(dropout), nn.Linear(hidden, d))


class Mixer(nn.Module):
    def __init__(self, config: MixerConfig):
        super().__init__()
        self.config = config
        tokens = (config.image_size // config.patch_size) ** 2
        self.patch_embed = nn.Conv2d(
            config.in_chans, config.n_embd, config.patch_size, stride=config.patch_size
        )
        self.blocks = nn.ModuleList(
            nn.ModuleDict(
                {
                    "norm1": nn.LayerNorm(config.n_embd),
                    "token_mlp": _mlp(tokens, config.token_hidden, config.dropout),
                    "norm2": nn.LayerNorm(config.n_embd),
                    "channel_mlp": _mlp(config.n_embd, config.channel_hidden, config.dropout),
                }
            )
            for _ in range(config.n_layer)
        )
        self.norm = nn.LayerNorm(config.n_embd)
        self.head = nn.Linear(config.n_embd, config.num_classes)

    def forward(self, x: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        x = self.patch_embed(x).flatten(2).transpose(1, 2)  # (B, tokens, channels)
        for block in self.blocks:
            x = x + block["token_mlp"](block["norm1"](x).transpose(1, 2)).transpose(1, 2)
            x = x + block["channel_mlp"](block["norm2"](x))
        logits = self.head(self.norm(x).mean(dim=1))
        if targets is None:
            return logits
        return F.cross_entropy(logits, targets)
