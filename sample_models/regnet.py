"""RegNetX-style CNN (Radosavovic et al., 2020): stem, then stages of X blocks."""

from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F


@dataclass
class RegNetConfig:
    stem_width: int = 32
    widths: tuple[int, ...] = (32, 64, 160, 384)
    depths: tuple[int, ...] = (1, 2, 4, 1)
    group_width: int = 16
    bottleneck_ratio: int = 1
    in_chans: int = 3
    num_classes: int = 1000


def conv_bn(
    c_in: int, c_out: int, kernel_size: int, stride: int = 1, groups: int = 1
) -> nn.Sequential:
    return nn.Sequential(
        nn.Conv2d(
            c_in, c_out, kernel_size, stride, padding=kernel_size // 2, groups=groups, bias=False
        ),
        nn.BatchNorm2d(c_out),
    )


class XBlock(nn.Module):
    """1x1 conv-BN-ReLU, 3x3 group conv-BN-ReLU, 1x1 conv-BN, residual add, ReLU."""

    def __init__(self, w_in: int, w_out: int, stride: int, group_width: int, bottleneck_ratio: int):
        super().__init__()
        w_b = w_out // bottleneck_ratio
        groups = w_b // min(group_width, w_b)
        self.a = conv_bn(w_in, w_b, 1)
        self.b = conv_bn(w_b, w_b, 3, stride=stride, groups=groups)
        self.c = conv_bn(w_b, w_out, 1)
        self.relu = nn.ReLU(inplace=False)
        if stride != 1 or w_in != w_out:
            self.proj = conv_bn(w_in, w_out, 1, stride=stride)
        else:
            self.proj = nn.Identity()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.relu(self.a(x))
        out = self.relu(self.b(out))
        out = self.c(out)
        return self.relu(out + self.proj(x))


class Stage(nn.Module):
    def __init__(self, w_in: int, w_out: int, depth: int, group_width: int, bottleneck_ratio: int):
        super().__init__()
        # Each stage halves the resolution in its first block.
        self.blocks = nn.Sequential(
            *[
                XBlock(
                    w_in if i == 0 else w_out,
                    w_out,
                    2 if i == 0 else 1,
                    group_width,
                    bottleneck_ratio,
                )
                for i in range(depth)
            ]
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.blocks(x)


class RegNet(nn.Module):
    def __init__(self, config: RegNetConfig):
        super().__init__()
        assert len(config.widths) == len(config.depths)
        self.config = config
        self.stem = conv_bn(config.in_chans, config.stem_width, 3, stride=2)
        self.stem_relu = nn.ReLU(inplace=False)
        stages = []
        w_in = config.stem_width
        for w_out, depth in zip(config.widths, config.depths, strict=True):
            stages.append(Stage(w_in, w_out, depth, config.group_width, config.bottleneck_ratio))
            w_in = w_out
        self.stages = nn.ModuleList(stages)
        self.avgpool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(w_in, config.num_classes)

        for m in self.modules():
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")

    def forward(self, x: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        x = self.stem_relu(self.stem(x))
        for stage in self.stages:
            x = stage(x)
        logits = self.fc(torch.flatten(self.avgpool(x), 1))
        if targets is None:
            return logits
        return F.cross_entropy(logits, targets)
