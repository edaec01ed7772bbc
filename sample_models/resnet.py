"""ResNet with batch norm (He et al., 2015): BasicBlock (ResNet-18/34), Bottleneck (ResNet-50+)."""

from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F


@dataclass
class ResNetConfig:
    block: str = "basic"  # "basic" or "bottleneck"
    layers: tuple[int, ...] = (2, 2, 2, 2)
    width: int = 64
    in_chans: int = 3
    num_classes: int = 1000


def conv3x3(in_planes: int, out_planes: int, stride: int = 1, groups: int = 1) -> nn.Conv2d:
    # No bias: the following BatchNorm's shift makes it redundant.
    return nn.Conv2d(in_planes, out_planes, 3, stride=stride, padding=1, groups=groups, bias=False)


def conv1x1(in_planes: int, out_planes: int, stride: int = 1) -> nn.Conv2d:
    return nn.Conv2d(in_planes, out_planes, 1, stride=stride, bias=False)


class BasicBlock(nn.Module):
    expansion = 1

    def __init__(self, inplanes: int, planes: int, stride: int = 1):
        super().__init__()
        self.conv1 = conv3x3(inplanes, planes, stride)
        self.bn1 = nn.BatchNorm2d(planes)
        self.relu = nn.ReLU(inplace=False)
        self.conv2 = conv3x3(planes, planes)
        self.bn2 = nn.BatchNorm2d(planes)
        self.downsample = _shortcut(inplanes, planes * self.expansion, stride)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return self.relu(out + self.downsample(x))


class Bottleneck(nn.Module):
    # Stride sits on the 3x3 conv (ResNet v1.5), as in torchvision.
    expansion = 4

    def __init__(self, inplanes: int, planes: int, stride: int = 1):
        super().__init__()
        self.conv1 = conv1x1(inplanes, planes)
        self.bn1 = nn.BatchNorm2d(planes)
        self.conv2 = conv3x3(planes, planes, stride)
        self.bn2 = nn.BatchNorm2d(planes)
        self.conv3 = conv1x1(planes, planes * self.expansion)
        self.bn3 = nn.BatchNorm2d(planes * self.expansion)
        self.relu = nn.ReLU(inplace=False)
        self.downsample = _shortcut(inplanes, planes * self.expansion, stride)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.relu(self.bn2(self.conv2(out)))
        out = self.bn3(self.conv3(out))
        return self.relu(out + self.downsample(x))


def _shortcut(inplanes: int, outplanes: int, stride: int) -> nn.Module:
    if stride == 1 and inplanes == outplanes:
        return nn.Identity()
    return nn.Sequential(conv1x1(inplanes, outplanes, stride), nn.BatchNorm2d(outplanes))


class ResNet(nn.Module):
    def __init__(self, config: ResNetConfig):
        super().__init__()
        self.config = config
        block = {"basic": BasicBlock, "bottleneck": Bottleneck}[config.block]
        w = config.width

        self.conv1 = nn.Conv2d(config.in_chans, w, kernel_size=7, stride=2, padding=3, bias=False)
        self.bn1 = nn.BatchNorm2d(w)
        self.relu = nn.ReLU(inplace=False)
        self.maxpool = nn.MaxPool2d(kernel_size=3, stride=2, padding=1)

        stages = []
        inplanes = w
        for i, n_blocks in enumerate(config.layers):
            planes = w * 2**i
            stride = 1 if i == 0 else 2
            blocks = []
            for j in range(n_blocks):
                blocks.append(block(inplanes, planes, stride if j == 0 else 1))
                inplanes = planes * block.expansion
            stages.append(nn.Sequential(*blocks))
        self.layers = nn.ModuleList(stages)

        self.avgpool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(inplanes, config.num_classes)

        for m in self.modules():
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")
        # Zero the last BN of each residual branch so every block starts as the identity.
        for m in self.modules():
            if isinstance(m, Bottleneck):
                nn.init.zeros_(m.bn3.weight)
            elif isinstance(m, BasicBlock):
                nn.init.zeros_(m.bn2.weight)

    def forward(self, x: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        x = self.maxpool(self.relu(self.bn1(self.conv1(x))))
        for stage in self.layers:
            x = stage(x)
        logits = self.fc(torch.flatten(self.avgpool(x), 1))
        if targets is None:
            return logits
        return F.cross_entropy(logits, targets)
