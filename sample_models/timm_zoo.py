"""A zoo of timm models (pytorch-image-models), made as timm's users make them:
`timm.create_model(name, pretrained=False, **small kwargs)`, random init, nothing
downloaded; the cross-entropy on the logits outside the model.

- `timm-resnet`: `resnet34`'s layout (stages of 3, 4, 6, 3 basic blocks, batch norm) at
  widths 8 to 64;
- `timm-vit`: `vit_tiny_patch16_224` at 32 px, patch 8, 3 blocks, dropout on;
- `timm-efficientnet`: `efficientnet_b0` (depthwise convolutions, squeeze-excite, SiLU,
  batch norm), stochastic depth on, at 32 px.

timm requires torchvision and imports it with itself, though its models never call it. Where
the real torchvision is absent or does not load (PyPI's only build for torch 2.13 is a CUDA
one that fails against the CPU torch wheel), `import_timm` imports timm over the stub in
`sample_models/torchvision_stub` (its docstring lists what timm reads). Needs timm (the
`bench` extra installs it without its dependencies: see the Makefile); `sample_models`
itself does not import this module.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path
from types import ModuleType

import torch

from sample_models.zoo import ZooCase, class_loss, made

STUB = Path(__file__).resolve().parent / "torchvision_stub"  # holds the stub `torchvision`
BATCH, SIZE, CLASSES = 2, 32, 10


def import_timm() -> ModuleType:
    """timm, imported over the torchvision stub only when the real torchvision does not
    import; the stub is on `sys.path` and in `sys.modules` only while timm is imported."""
    if "timm" in sys.modules:
        return sys.modules["timm"]
    try:
        import torchvision  # noqa: F401
    except Exception:  # absent (ImportError), or built for another torch (OSError, RuntimeError)
        _forget_torchvision()  # what a failed import left half made
        sys.path.insert(0, str(STUB))
        try:
            import timm
        finally:
            sys.path.remove(str(STUB))
            _forget_torchvision()  # timm's modules hold the few names they took
        return timm
    import timm

    return timm


def _forget_torchvision() -> None:
    for name in [n for n in sys.modules if n == "torchvision" or n.startswith("torchvision.")]:
        del sys.modules[name]


def _case(name: str, layers: int, seed: int, **kwargs: object) -> ZooCase:
    timm = import_timm()
    model = made(lambda: timm.create_model(name, pretrained=False, num_classes=CLASSES, **kwargs))
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(BATCH, 3, SIZE, SIZE, generator=g)
    y = torch.randint(0, CLASSES, (BATCH,), generator=g)
    return ZooCase(model, (x,), {}, class_loss, (y,), layers)


def resnet() -> ZooCase:
    """A CNN with batch norm: 16 basic blocks, all but the first of each stage alike."""
    return _case("resnet34", 16, 5, channels=(8, 16, 32, 64), stem_width=8)


def vit() -> ZooCase:
    """A ViT whose blocks drop activations (the random stream). Three blocks: the first is
    one block of the chain with the patch embedding before it, the other two alike.
    Stochastic depth is left off: its rate grows with depth, so no two blocks would match."""
    return _case(
        "vit_tiny_patch16_224",
        3,
        6,
        img_size=SIZE,
        patch_size=8,
        depth=3,
        proj_drop_rate=0.1,
    )


def efficientnet() -> ZooCase:
    """A depthwise-separable CNN with batch norm, SiLU (in place) and squeeze-excite;
    stochastic depth drops whole residual branches (the random stream)."""
    return _case("efficientnet_b0", 16, 7, drop_path_rate=0.1)


ZOO: dict[str, Callable[[], ZooCase]] = {
    "timm-resnet": resnet,
    "timm-vit": vit,
    "timm-efficientnet": efficientnet,
}
