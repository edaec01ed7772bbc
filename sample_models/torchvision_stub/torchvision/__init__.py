"""Not torchvision: the stub `sample_models.timm_zoo` imports timm over (see the package
docstring of `sample_models.torchvision_stub`)."""

from __future__ import annotations

from typing import NoReturn

__version__ = "0.0.0+stub"  # not a torchvision release: nothing here computes anything


class Unavailable:
    """A torchvision class timm names at import time; making one is refused by name."""

    def __init__(self, *args: object, **kwargs: object) -> NoReturn:
        raise NotImplementedError(
            f"torchvision.{type(self).__module__.split('.', 1)[-1]}.{type(self).__qualname__} "
            "is the stub sample_models/torchvision_stub put in place so timm imports without "
            "torchvision; install a torchvision that loads against your torch to use it"
        )
