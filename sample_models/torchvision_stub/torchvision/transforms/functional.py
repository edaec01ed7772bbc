"""Stub `torchvision.transforms.functional`: timm maps `InterpolationMode`'s members to and
from their names at import time; the values are torchvision's own."""

from enum import Enum


class InterpolationMode(Enum):
    NEAREST = "nearest"
    NEAREST_EXACT = "nearest-exact"
    BILINEAR = "bilinear"
    BICUBIC = "bicubic"
    BOX = "box"
    HAMMING = "hamming"
    LANCZOS = "lanczos"
