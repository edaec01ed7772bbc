"""Stub `torchvision.ops.misc`: timm's norm factories map "frozenbatchnorm2d" to this class
and its freezing helpers test `isinstance` against it; timm's models never make one."""

from torchvision import Unavailable


class FrozenBatchNorm2d(Unavailable):
    pass
