"""A zoo of diffusers U-Nets, tiny random-init configs called as diffusers' training
scripts call them: keyword inputs (`sample=`, `timestep=`, `encoder_hidden_states=`), the
prediction read from the output (`.sample`, or `return_dict=False` and `[0]`), the loss
outside the model, `F.mse_loss(model_pred.float(), target.float(), reduction="mean")`
against the noise.

- `diffusers-unet`: `UNet2DModel` (train_unconditional.py's model), 2 resolutions, self
  attention at the lower one, dropout on;
- `diffusers-unet-cond`: `UNet2DConditionModel` (train_text_to_image.py's), cross-attention
  on 4 tokens of text states, dropout on.

Needs diffusers (the `bench` extra); `sample_models` itself does not import this module.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from diffusers import UNet2DConditionModel, UNet2DModel

from sample_models.zoo import ZooCase, made

BATCH, STEPS = 2, 1000  # the batch; diffusion timesteps drawn from [0, STEPS)


def noise_loss(output: Any, target: torch.Tensor) -> torch.Tensor:
    """diffusers' training loss on the predicted noise, outside the model."""
    model_pred = output.sample if hasattr(output, "sample") else output[0]
    return F.mse_loss(model_pred.float(), target.float(), reduction="mean")


def _noisy(channels: int, size: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Noisy latents, their timesteps and the noise to predict."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(BATCH, channels, size, size, generator=g)
    t = torch.randint(0, STEPS, (BATCH,), generator=g)
    return x, t, torch.randn(x.shape, generator=g)


def unet() -> ZooCase:
    model = made(
        lambda: UNet2DModel(
            sample_size=16,
            in_channels=3,
            out_channels=3,
            block_out_channels=(8, 16),
            layers_per_block=1,
            down_block_types=("DownBlock2D", "AttnDownBlock2D"),
            up_block_types=("AttnUpBlock2D", "UpBlock2D"),
            norm_num_groups=4,
            attention_head_dim=8,
            dropout=0.1,
        )
    )
    x, t, noise = _noisy(3, 16, 8)
    return ZooCase(model, (), {"sample": x, "timestep": t}, noise_loss, (noise,), 2)


def unet_cond() -> ZooCase:
    model = made(
        lambda: UNet2DConditionModel(
            sample_size=8,
            in_channels=4,
            out_channels=4,
            block_out_channels=(8, 16),
            layers_per_block=1,
            down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"),
            up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"),
            cross_attention_dim=16,
            attention_head_dim=4,
            norm_num_groups=4,
            dropout=0.1,
        )
    )
    x, t, noise = _noisy(4, 8, 9)
    text = torch.randn(BATCH, 4, 16, generator=torch.Generator().manual_seed(10))
    kwargs = {"sample": x, "timestep": t, "encoder_hidden_states": text, "return_dict": False}
    return ZooCase(model, (), kwargs, noise_loss, (noise,), 2)


ZOO: dict[str, Callable[[], ZooCase]] = {
    "diffusers-unet": unet,
    "diffusers-unet-cond": unet_cond,
}
