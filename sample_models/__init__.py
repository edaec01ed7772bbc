"""Small, readable PyTorch models for exercising the rematerialization planner.

Every preset in REGISTRY is a zero-argument builder returning ``(model, example_inputs)``
such that ``loss = model(*example_inputs); loss.backward()`` is one training step.
"""

from dataclasses import dataclass

import torch
import torch.nn as nn

from .gpt import GPT, GPTConfig
from .mixer import Mixer, MixerConfig
from .mlp import MLP, MLPConfig
from .regnet import RegNet, RegNetConfig
from .resnet import ResNet, ResNetConfig
from .two_tower import TwoTower, TwoTowerConfig
from .unet import UNet, UNetConfig
from .vit import ViT, ViTConfig

__all__ = ["REGISTRY", "SMALL", "Preset", "build", "describe", "names"]


@dataclass(frozen=True)
class Preset:
    """A named model configuration plus the shape of one training batch."""

    model_cls: type[nn.Module]
    config: object
    batch_size: int
    description: str
    image_size: int | None = None  # CNNs only; ViT and token models carry it in their config

    def make_model(self) -> nn.Module:
        # Forked so that building a model never perturbs the caller's global RNG stream.
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(0)
            model = self.model_cls(self.config)
        return model.train()

    def make_inputs(self) -> tuple[torch.Tensor, ...]:
        g = torch.Generator().manual_seed(0)
        c, b = self.config, self.batch_size
        if isinstance(c, GPTConfig):
            idx = torch.randint(0, c.vocab_size, (b, c.block_size), generator=g)
            targets = torch.randint(0, c.vocab_size, (b, c.block_size), generator=g)
            return idx, targets
        if isinstance(c, UNetConfig):  # noisy images, diffusion timesteps, the noise to predict
            x = torch.randn(b, c.in_chans, c.image_size, c.image_size, generator=g)
            t = torch.randint(0, 1000, (b,), generator=g)
            return x, t, torch.randn(x.shape, generator=g)
        if isinstance(c, TwoTowerConfig):
            a, x = torch.randn(b, c.in_a, generator=g), torch.randn(b, c.in_b, generator=g)
            return a, x, torch.randint(0, c.num_classes, (b,), generator=g)
        if isinstance(c, MLPConfig):
            x = torch.randn(b, c.in_features, generator=g)
        else:
            size = c.image_size if isinstance(c, (ViTConfig, MixerConfig)) else self.image_size
            x = torch.randn(b, c.in_chans, size, size, generator=g)
        targets = torch.randint(0, c.num_classes, (b,), generator=g)
        return x, targets

    def __call__(self) -> tuple[nn.Module, tuple[torch.Tensor, ...]]:
        return self.make_model(), self.make_inputs()


def _gpt(n_layer, n_embd, n_head, vocab, seq, batch, size, tie=False) -> Preset:
    config = GPTConfig(
        block_size=seq,
        vocab_size=vocab,
        n_layer=n_layer,
        n_head=n_head,
        n_embd=n_embd,
        dropout=0.1,
        tie_weights=tie,
    )
    desc = (
        f"GPT decoder, {size}: {n_layer}L d{n_embd} {n_head}h, vocab {vocab}, {batch}x{seq} tokens"
    )
    return Preset(GPT, config, batch, desc)


def _resnet(block, layers, width, batch, image, classes, size) -> Preset:
    config = ResNetConfig(block=block, layers=tuple(layers), width=width, num_classes=classes)
    desc = (
        f"ResNet ({block} blocks), {size}: layers {list(layers)}, width {width}, "
        f"{batch}x3x{image}x{image}, {classes} classes"
    )
    return Preset(ResNet, config, batch, desc, image_size=image)


def _vit(patch, image, n_embd, n_layer, n_head, batch, classes, size) -> Preset:
    config = ViTConfig(
        image_size=image,
        patch_size=patch,
        num_classes=classes,
        n_layer=n_layer,
        n_head=n_head,
        n_embd=n_embd,
        dropout=0.1,
    )
    desc = (
        f"ViT encoder, {size}: {n_layer}L d{n_embd} {n_head}h, patch {patch}, "
        f"{batch}x3x{image}x{image}, {classes} classes"
    )
    return Preset(ViT, config, batch, desc)


def _regnet(stem, widths, depths, group_width, batch, image, classes, size) -> Preset:
    config = RegNetConfig(
        stem_width=stem,
        widths=tuple(widths),
        depths=tuple(depths),
        group_width=group_width,
        num_classes=classes,
    )
    desc = (
        f"RegNetX CNN, {size}: widths {list(widths)}, depths {list(depths)}, "
        f"group width {group_width}, {batch}x3x{image}x{image}, {classes} classes"
    )
    return Preset(RegNet, config, batch, desc, image_size=image)


def _mlp(n_layer, width, in_features, batch, classes, size) -> Preset:
    config = MLPConfig(in_features=in_features, width=width, n_layer=n_layer, num_classes=classes)
    desc = (
        f"MLP (Linear-ReLU), {size}: {n_layer} layers, width {width}, "
        f"{batch}x{in_features} inputs, {classes} classes"
    )
    return Preset(MLP, config, batch, desc)


def _unet(channels, image, batch, groups, time_dim, n_head, size) -> Preset:
    config = UNetConfig(image, 3, tuple(channels), groups, time_dim, n_head)
    desc = (
        f"diffusion U-Net, {size}: channels {list(channels)}, attention at {image >> (len(channels) - 1)}px, "
        f"{batch}x3x{image}x{image}"
    )
    return Preset(UNet, config, batch, desc)


def _two_tower(in_features, width, depth_a, depth_b, shared, batch, size) -> Preset:
    config = TwoTowerConfig(in_features, in_features, width, depth_a, depth_b, shared)
    towers = f"shared tower of {depth_a}" if shared else f"towers of {depth_a} and {depth_b}"
    desc = f"two-tower join, {size}: {towers} residual MLP layers, width {width}, batch {batch}"
    return Preset(TwoTower, config, batch, desc)


def _mixer(patch, image, n_embd, n_layer, batch, classes, size) -> Preset:
    config = MixerConfig(
        image_size=image,
        patch_size=patch,
        n_layer=n_layer,
        n_embd=n_embd,
        token_hidden=n_embd // 2,
        channel_hidden=4 * n_embd,
        num_classes=classes,
    )
    desc = (
        f"MLP-Mixer, ModuleDict blocks run by the root, {size}: {n_layer}L d{n_embd}, "
        f"patch {patch}, {batch}x3x{image}x{image}, {classes} classes"
    )
    return Preset(Mixer, config, batch, desc)


REGISTRY: dict[str, Preset] = {
    "gpt-1layer": _gpt(1, 32, 2, vocab=64, seq=32, batch=2, size="1-layer"),
    "gpt-tiny": _gpt(2, 64, 2, vocab=256, seq=64, batch=4, size="tiny"),
    "gpt-small-6l": _gpt(6, 256, 4, vocab=4096, seq=256, batch=4, size="small"),
    # GPT-2 ties wte and lm_head; doing the same keeps the parameter count at GPT-2's 124M.
    "gpt2-small": _gpt(12, 768, 12, vocab=50257, seq=512, batch=8, size="GPT-2 124M", tie=True),
    "resnet-tiny": _resnet("basic", [1, 1, 1, 1], 16, batch=2, image=32, classes=10, size="tiny"),
    "resnet-bottleneck-tiny": _resnet(
        "bottleneck", [1, 1, 1, 1], 8, batch=2, image=32, classes=10, size="tiny"
    ),
    "resnet18": _resnet(
        "basic", [2, 2, 2, 2], 64, batch=8, image=64, classes=100, size="ResNet-18 layout"
    ),
    "resnet50": _resnet(
        "bottleneck", [3, 4, 6, 3], 64, batch=4, image=64, classes=100, size="ResNet-50 layout"
    ),
    "vit-tiny": _vit(8, 32, 64, 2, 2, batch=4, classes=10, size="tiny"),
    "vit-small": _vit(16, 128, 384, 6, 6, batch=8, classes=100, size="small"),
    "mixer-tiny": _mixer(4, 32, 64, 4, batch=8, classes=10, size="tiny"),
    "regnet-tiny": _regnet(16, [16, 32], [1, 1], 8, batch=2, image=32, classes=10, size="tiny"),
    "regnet-small": _regnet(
        32, [32, 64, 160, 384], [1, 2, 4, 1], 16, batch=8, image=64, classes=100, size="small"
    ),
    "mlp-tiny": _mlp(4, 64, 32, batch=16, classes=10, size="tiny"),
    "mlp": _mlp(8, 1024, 1024, batch=64, classes=10, size="medium"),
    # a large batch makes activations, not gradients, the bulk of memory: room to recompute
    "mlp-batch": _mlp(6, 128, 128, batch=512, classes=10, size="large-batch"),
    "unet-tiny": _unet((8, 16, 32), 16, batch=2, groups=4, time_dim=32, n_head=2, size="tiny"),
    "unet-small": _unet((32, 64, 128), 32, batch=8, groups=8, time_dim=128, n_head=4, size="small"),
    "two-tower-tiny": _two_tower(32, 32, 2, 1, shared=False, batch=8, size="tiny"),
    "siamese-tiny": _two_tower(32, 32, 2, 2, shared=True, batch=8, size="tiny"),
    "two-tower-small": _two_tower(256, 256, 4, 2, shared=False, batch=256, size="small"),
}

# One quick preset per family, for fast tests.
SMALL: list[str] = ["gpt-tiny", "resnet-tiny", "vit-tiny", "regnet-tiny", "mlp-tiny"]


def names() -> list[str]:
    return list(REGISTRY)


def build(name: str) -> tuple[nn.Module, tuple[torch.Tensor, ...]]:
    if name not in REGISTRY:
        raise KeyError(f"unknown sample model {name!r}; valid names: {', '.join(REGISTRY)}")
    return REGISTRY[name]()


def describe(name: str) -> str:
    """A sample model, or an architecture of the app's menu ("llama3-8b 1x8192"), in words."""
    if name not in REGISTRY:
        from .hf_archs import ARCHITECTURES
        from .hf_archs import describe as architecture

        if name.partition(" ")[0] in ARCHITECTURES:
            return architecture(name)
        raise KeyError(f"unknown sample model {name!r}; valid names: {', '.join(REGISTRY)}")
    builder = REGISTRY[name]
    return builder.description if isinstance(builder, Preset) else name
