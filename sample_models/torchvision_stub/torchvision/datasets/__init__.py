"""Stub `torchvision.datasets`: the six names timm's dataset factory imports unconditionally
(Places365, INaturalist, QMNIST and ImageNet it tries and does without)."""

from torchvision import Unavailable


class CIFAR10(Unavailable):
    pass


class CIFAR100(Unavailable):
    pass


class MNIST(Unavailable):
    pass


class KMNIST(Unavailable):
    pass


class FashionMNIST(Unavailable):
    pass


class ImageFolder(Unavailable):
    pass
