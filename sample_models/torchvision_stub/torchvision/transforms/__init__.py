"""Stub `torchvision.transforms`: timm subclasses `ToTensor` at import time (its
`MaybeToTensor`); its transform factories read the other transforms only when called."""

from torchvision import Unavailable


class ToTensor(Unavailable):
    pass
