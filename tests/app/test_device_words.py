"""The app and the CLI say which attention kernels a device plan assumed, in the words a
PyTorch user knows ("flash attention"), from the problem analysed for that device."""

from __future__ import annotations

import torch
from transformers import LlamaConfig, LlamaForCausalLM

import core
from app.words import intro


def _llama_on(device: str) -> core.Problem:
    cfg = LlamaConfig(
        vocab_size=128,
        hidden_size=256,
        intermediate_size=256,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=4,
    )
    with torch.device("meta"):
        model = LlamaForCausalLM(cfg).to(torch.bfloat16).train()
    ids = torch.randint(0, 128, (1, 64), device="meta")
    kwargs = {"labels": ids, "use_cache": False}
    return core.analyze(model, (ids,), kwargs, loss_fn=lambda out: out.loss, device=device)


def test_the_intro_names_the_attention_kernel_a_gpu_plan_assumed():
    problem = _llama_on("h100")
    assert problem.attention.startswith("attention: flash attention (assumed for h100")
    numbers = {
        "store_all_peak": problem.store_all_peak,
        "store_all_time": problem.store_all_time,
        "cost_model": problem.cost_model,
        "attention": problem.attention,
    }
    said = str(intro("llama", "one layer", numbers))
    assert "Planned with attention: flash attention (assumed for h100" in said
    said = str(intro("llama", "one layer", {**numbers, "attention": ""}))
    assert "Planned with" not in said
