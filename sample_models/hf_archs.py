"""Hugging Face architectures at their published sizes, to plan for a GPU from the app's menu
and `remat fit`: each config is written out here from the model's published config.json
(nothing is downloaded), the model is built on the meta device (no weights allocated, it
cannot run) in the dtype the checkpoint is published in, and called on `batch x seq` token
ids with its own loss (`labels=`), as a Trainer calls it.

Needs transformers (the `bench` extra); the app's menu says so when it is missing.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch


@dataclass(frozen=True)
class Architecture:
    """One published model: its name in the menu, where its numbers come from, and how to
    make its config and model class (both from transformers, imported when built)."""

    name: str  # the menu's key, e.g. "llama3-8b"
    title: str  # "Llama 3 8B"
    source: str  # the Hugging Face repository whose config.json the numbers are from
    family: str  # transformers' config and model classes: "llama", "gpt2", ...
    config: dict[str, Any]  # the published config's fields that set the step's shape
    dtype: torch.dtype  # the checkpoint's dtype (config.json's torch_dtype; float32 if none)
    max_seq: int  # the longest sequence its positions allow
    params: int  # its parameter count, as built (tests/app/test_app_architectures.py checks)

    @property
    def size_words(self) -> str:
        """Its parameter count in words: "8.03 B parameters", "124 M parameters"."""
        if self.params >= 10**9:
            return f"{self.params / 1e9:.2f} B parameters"
        return f"{self.params / 1e6:.0f} M parameters"

    @property
    def layers(self) -> int:
        """Its repeated layers (config's num_hidden_layers or n_layer)."""
        return int(self.config.get("num_hidden_layers", self.config.get("n_layer", 0)))


_LLAMA3_ROPE = {  # Llama 3.1 and 3.2's long-context rope (config.json's rope_scaling)
    "rope_type": "llama3",
    "factor": 32.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}

ARCHITECTURES: dict[str, Architecture] = {
    a.name: a
    for a in (
        Architecture(
            "gpt2-small",
            "GPT-2 small (124M)",
            "openai-community/gpt2",
            "gpt2",
            {"vocab_size": 50257, "n_positions": 1024, "n_embd": 768, "n_layer": 12, "n_head": 12},
            torch.float32,
            1024,
            124_439_808,
        ),
        Architecture(
            "gpt2-medium",
            "GPT-2 medium (355M)",
            "openai-community/gpt2-medium",
            "gpt2",
            {"vocab_size": 50257, "n_positions": 1024, "n_embd": 1024, "n_layer": 24, "n_head": 16},
            torch.float32,
            1024,
            354_823_168,
        ),
        Architecture(
            "llama3-8b",
            "Llama 3 8B",
            "meta-llama/Meta-Llama-3-8B",
            "llama",
            {
                "vocab_size": 128256,
                "hidden_size": 4096,
                "intermediate_size": 14336,
                "num_hidden_layers": 32,
                "num_attention_heads": 32,
                "num_key_value_heads": 8,
                "max_position_embeddings": 8192,
                "rms_norm_eps": 1e-5,
                "rope_theta": 500000.0,
                "tie_word_embeddings": False,
            },
            torch.bfloat16,
            8192,
            8_030_261_248,
        ),
        Architecture(
            "llama3.2-1b",
            "Llama 3.2 1B",
            "meta-llama/Llama-3.2-1B",
            "llama",
            {
                "vocab_size": 128256,
                "hidden_size": 2048,
                "intermediate_size": 8192,
                "num_hidden_layers": 16,
                "num_attention_heads": 32,
                "num_key_value_heads": 8,
                "head_dim": 64,
                "max_position_embeddings": 131072,
                "rms_norm_eps": 1e-5,
                "rope_theta": 500000.0,
                "rope_scaling": _LLAMA3_ROPE,
                "tie_word_embeddings": True,
            },
            torch.bfloat16,
            131072,
            1_235_814_400,
        ),
        Architecture(
            "llama3.2-3b",
            "Llama 3.2 3B",
            "meta-llama/Llama-3.2-3B",
            "llama",
            {
                "vocab_size": 128256,
                "hidden_size": 3072,
                "intermediate_size": 8192,
                "num_hidden_layers": 28,
                "num_attention_heads": 24,
                "num_key_value_heads": 8,
                "head_dim": 128,
                "max_position_embeddings": 131072,
                "rms_norm_eps": 1e-5,
                "rope_theta": 500000.0,
                "rope_scaling": _LLAMA3_ROPE,
                "tie_word_embeddings": True,
            },
            torch.bfloat16,
            131072,
            3_212_749_824,
        ),
        Architecture(
            "qwen2.5-7b",
            "Qwen2.5 7B",
            "Qwen/Qwen2.5-7B",
            "qwen2",
            {
                "vocab_size": 152064,
                "hidden_size": 3584,
                "intermediate_size": 18944,
                "num_hidden_layers": 28,
                "num_attention_heads": 28,
                "num_key_value_heads": 4,
                "max_position_embeddings": 131072,
                "rms_norm_eps": 1e-6,
                "rope_theta": 1000000.0,
                "use_sliding_window": False,
                "tie_word_embeddings": False,
            },
            torch.bfloat16,
            131072,
            7_615_616_512,
        ),
        Architecture(
            "mistral-7b",
            "Mistral 7B v0.3",
            "mistralai/Mistral-7B-v0.3",
            "mistral",
            {
                "vocab_size": 32768,
                "hidden_size": 4096,
                "intermediate_size": 14336,
                "num_hidden_layers": 32,
                "num_attention_heads": 32,
                "num_key_value_heads": 8,
                "max_position_embeddings": 32768,
                "rms_norm_eps": 1e-5,
                "rope_theta": 1000000.0,
                "sliding_window": None,
                "tie_word_embeddings": False,
            },
            torch.bfloat16,
            32768,
            7_248_023_552,
        ),
        Architecture(
            "bert-large",
            "BERT-large (uncased, 336M)",
            "google-bert/bert-large-uncased",
            "bert",
            {
                "vocab_size": 30522,
                "hidden_size": 1024,
                "num_hidden_layers": 24,
                "num_attention_heads": 16,
                "intermediate_size": 4096,
                "max_position_embeddings": 512,
                "type_vocab_size": 2,
            },
            torch.float32,
            512,
            335_174_458,
        ),
    )
}

DEFAULT_BATCH = 1
# the menu's sequence length for an architecture, or its longest if shorter: at 1,024 tokens
# a 1-8B model's peak is its parameter gradients, and no plan goes much below it
DEFAULT_SEQ = 8192
MAX_BATCH = 4096  # the menu's limits: larger is a typo here, not a plan
MIN_SEQ = 8


class ShapeError(ValueError):
    """A batch or sequence length the menu cannot plan (out of the architecture's range)."""


def default_seq(name: str) -> int:
    """The sequence length the menu offers for architecture `name` before one is typed."""
    return min(DEFAULT_SEQ, ARCHITECTURES[name].max_seq)


def check_shape(name: str, batch: Any, seq: Any) -> tuple[int, int]:
    """`(batch, seq)` as whole numbers in range for architecture `name`, or a ShapeError in
    words: what is wrong and what range to choose from."""
    arch = ARCHITECTURES[name]
    for what, value, lo, hi in (
        ("batch", batch, 1, MAX_BATCH),
        ("sequence length", seq, MIN_SEQ, arch.max_seq),
    ):
        if isinstance(value, float) and value.is_integer():
            value = int(value)
        if type(value) is not int or not lo <= value <= hi:
            raise ShapeError(
                f"{arch.title}: the {what} must be a whole number from {lo} to {hi:,}, "
                f"not {value!r}"
            )
    return int(batch), int(seq)


def menu_name(name: str, batch: int, seq: int) -> str:
    """The model menu's entry for an architecture at a shape: "llama3-8b 1x8192"."""
    return f"{name} {batch}x{seq}"


def parse_menu_name(value: str) -> tuple[str, int, int]:
    """`(name, batch, seq)` of a `menu_name`, or a KeyError: only a known architecture at a
    shape in its range is one."""
    name, _, shape = value.partition(" ")
    batch, _, seq = shape.partition("x")
    if name not in ARCHITECTURES or not batch.isdigit() or not seq.isdigit():
        raise KeyError(f"not an architecture of the menu: {value!r}")
    try:
        return (name, *check_shape(name, int(batch), int(seq)))
    except ShapeError as e:
        raise KeyError(str(e)) from None


def describe(value: str) -> str:
    """A `menu_name` in words: "Llama 3 8B at the published size (meta-llama/...'s config,
    8.03 B parameters, bfloat16, on the meta device), batch 1 x 8192 tokens"."""
    name, batch, seq = parse_menu_name(value)
    arch = ARCHITECTURES[name]
    dtype = str(arch.dtype).removeprefix("torch.")
    return (
        f"{arch.title} at its published size: {arch.source}'s config, {arch.size_words} in "
        f"{dtype}, built on the meta device; batch {batch} x {seq} tokens"
    )


def _classes(family: str) -> tuple[Callable[..., Any], Callable[[Any], torch.nn.Module]]:
    import transformers as tf

    return {
        "gpt2": (tf.GPT2Config, tf.GPT2LMHeadModel),
        "llama": (tf.LlamaConfig, tf.LlamaForCausalLM),
        "qwen2": (tf.Qwen2Config, tf.Qwen2ForCausalLM),
        "mistral": (tf.MistralConfig, tf.MistralForCausalLM),
        "bert": (tf.BertConfig, tf.BertForMaskedLM),
    }[family]


def config(name: str) -> Any:
    """The transformers config of architecture `name`, at its published numbers (SDPA
    attention; dropout as the published config has it)."""
    arch = ARCHITECTURES[name]
    config_cls, _ = _classes(arch.family)
    return config_cls(**arch.config, attn_implementation="sdpa")


def build(name: str, batch: int, seq: int) -> Any:
    """One training step of architecture `name` on `batch x seq` tokens, on the meta device:
    a `core.ModelCall` with the model in its published dtype, the ids as inputs and labels
    (the model's own loss: shifted for a causal LM, masked-LM's over every token for BERT),
    no padding mask (so causal attention is SDPA's `is_causal`)."""
    from core import ModelCall

    batch, seq = check_shape(name, batch, seq)
    arch = ARCHITECTURES[name]
    _, model_cls = _classes(arch.family)
    cfg = config(name)
    with torch.device("meta"):
        model = model_cls(cfg).to(arch.dtype).train()
        ids = torch.zeros(batch, seq, dtype=torch.long)
    kwargs: dict[str, Any] = {"labels": ids}
    if arch.family != "bert":
        kwargs["use_cache"] = False
    return ModelCall(model, (ids,), kwargs, _own_loss)


def _own_loss(output: Any) -> torch.Tensor:
    """The loss the model computed from `labels=`."""
    return output.loss
