"""A zoo of Hugging Face models nobody here wrote: tiny random-init configs built offline, and
the 12-layer GPT-2 and Llama built on the meta device (no weights allocated).

Each builder returns a `ZooCase`: the model, its call (positional and keyword inputs, as
users call it), a loss computed outside the model and its targets, and the number of layers
whose blocks `checkpoint_blocks` should find. Tiny configs take milliseconds a step; dropout
is on wherever the config has it, so the random stream is exercised. Needs transformers (the
`bench` extra): `sample_models/__init__.py` does not import this module, so the other sample
models work without it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from transformers import (
    BertConfig,
    BertForMaskedLM,
    GPT2Config,
    GPT2LMHeadModel,
    LlamaConfig,
    LlamaForCausalLM,
    MixtralConfig,
    MixtralForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
    ResNetConfig,
    ResNetForImageClassification,
    T5Config,
    T5ForConditionalGeneration,
    ViTConfig,
    ViTForImageClassification,
)

from sample_models.zoo import ZooCase, class_loss, made

VOCAB, SEQ, BATCH = 128, 16, 2  # the tiny configs' call
BIG_SEQ = 512  # the meta-device models' tokens


def token_loss(output: Any, labels: torch.Tensor) -> torch.Tensor:
    """Cross-entropy over a ModelOutput's logits, computed outside the model."""
    logits = output.logits
    return nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1))


def _tokens(seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
    mask = torch.ones(BATCH, SEQ, dtype=torch.long)
    mask[1, -3:] = 0  # a padded row: the mask reaches attention
    labels = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
    return ids, mask, labels


def _made(cls: Callable[[Any], nn.Module], cfg: Any) -> nn.Module:
    """`cls(cfg)` in training mode, its weights from seed 0 (`sample_models.zoo.made`)."""
    return made(lambda: cls(cfg))


def _lm(model: nn.Module, layers: int) -> ZooCase:
    ids, mask, labels = _tokens(0)
    return ZooCase(model, (ids,), {"attention_mask": mask}, token_loss, (labels,), layers)


def gpt2(layers: int = 2) -> ZooCase:
    cfg = GPT2Config(
        vocab_size=VOCAB,
        n_positions=SEQ,
        n_embd=32,
        n_layer=layers,
        n_head=2,
        bos_token_id=VOCAB - 1,  # GPT-2's default (50256) is outside the tiny vocabulary
        eos_token_id=VOCAB - 1,
    )
    return _lm(_made(GPT2LMHeadModel, cfg), layers)


def _llama_like(config_cls: Callable[..., Any], layers: int) -> Any:
    """A tiny Llama-shaped config (grouped-query attention, attention dropout)."""
    return config_cls(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=SEQ,
        attention_dropout=0.1,
    )


def llama(layers: int = 2) -> ZooCase:
    return _lm(_made(LlamaForCausalLM, _llama_like(LlamaConfig, layers)), layers)


def qwen2(layers: int = 2) -> ZooCase:
    """Qwen2 (not in ZOO: the mixed-precision and checkpointing tests use it)."""
    return _lm(_made(Qwen2ForCausalLM, _llama_like(Qwen2Config, layers)), layers)


def bert(layers: int = 2) -> ZooCase:
    cfg = BertConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        num_hidden_layers=layers,
        num_attention_heads=2,
        intermediate_size=64,
        max_position_embeddings=SEQ,
    )
    return _lm(_made(BertForMaskedLM, cfg), layers)


def t5(layers: int = 2) -> ZooCase:
    """An encoder-decoder: the decoder's inputs are the labels shifted right inside the model
    (a Python scalar written into a slice: a lifted tensor constant)."""
    cfg = T5Config(
        vocab_size=VOCAB,
        d_model=32,
        d_kv=8,
        d_ff=64,
        num_layers=layers,
        num_heads=4,
        decoder_start_token_id=0,
        pad_token_id=0,
    )
    ids, mask, labels = _tokens(1)
    model = _made(T5ForConditionalGeneration, cfg)
    return ZooCase(model, (ids,), {"attention_mask": mask, "labels": labels}, _hf_loss, (), layers)


def _hf_loss(output: Any) -> torch.Tensor:
    """The loss the model computed itself (labels passed as a keyword input)."""
    return output.loss


def vit(layers: int = 2) -> ZooCase:
    cfg = ViTConfig(
        image_size=16,
        patch_size=4,
        num_channels=3,
        hidden_size=32,
        num_hidden_layers=layers,
        num_attention_heads=2,
        intermediate_size=64,
        num_labels=10,
        hidden_dropout_prob=0.1,
    )
    g = torch.Generator().manual_seed(2)
    x = torch.randn(BATCH, 3, 16, 16, generator=g)
    y = torch.randint(0, 10, (BATCH,), generator=g)
    model = _made(ViTForImageClassification, cfg)
    return ZooCase(model, (), {"pixel_values": x}, class_loss, (y,), layers)


def mixtral(layers: int = 2, experts: str | None = "batched_mm") -> ZooCase:
    """A mixture of experts: the router normalises its top-k weights in place. `experts`:
    transformers' experts_implementation (None: its default, grouped_mm)."""
    extra = {} if experts is None else {"experts_implementation": experts}
    cfg = MixtralConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_local_experts=4,
        num_experts_per_tok=2,
        max_position_embeddings=SEQ,
        **extra,
    )
    return _lm(_made(MixtralForCausalLM, cfg), layers)


def resnet() -> ZooCase:
    """A CNN with batch norm, three basic blocks (Hugging Face's; timm's: timm_zoo.py)."""
    cfg = ResNetConfig(
        embedding_size=8,
        hidden_sizes=[8, 16],
        depths=[2, 1],
        layer_type="basic",
        num_labels=10,
    )
    g = torch.Generator().manual_seed(3)
    x = torch.randn(BATCH, 3, 32, 32, generator=g)
    y = torch.randint(0, 10, (BATCH,), generator=g)
    model = _made(ResNetForImageClassification, cfg)
    return ZooCase(model, (x,), {}, class_loss, (y,), 3)


ZOO: dict[str, Callable[[], ZooCase]] = {
    "hf-gpt2": gpt2,
    "hf-llama": llama,
    "hf-bert": bert,
    "hf-t5": t5,
    "hf-vit": vit,
    "hf-mixtral": mixtral,
    "hf-resnet": resnet,
}


def _plain_lm(model: nn.Module, layers: int, seq: int, mask: bool) -> ZooCase:
    """A language model called on `BATCH x seq` tokens with no padding: the ids alone, or
    with an all-ones attention mask as a tokenizer gives it (`mask`)."""
    g = torch.Generator().manual_seed(4)
    ids = torch.randint(0, VOCAB, (BATCH, seq), generator=g)
    labels = torch.randint(0, VOCAB, (BATCH, seq), generator=g)
    kwargs = {"attention_mask": torch.ones(BATCH, seq, dtype=torch.long)} if mask else {}
    return ZooCase(model, (ids,), kwargs, token_loss, (labels,), layers)


# the models at their config's defaults (attention: SDPA; dropout as configured by default),
# at two sizes: (hidden, heads, layers, tokens)
TINY, WIDE = (32, 4, 2, SEQ), (64, 4, 4, 32)


def gpt2_default(size: tuple[int, int, int, int] = TINY) -> ZooCase:
    """GPT-2 at its defaults (dropout 0.1 in attention, residuals and embeddings), ids only."""
    hidden, heads, layers, seq = size
    cfg = GPT2Config(
        vocab_size=VOCAB,
        n_positions=seq,
        n_embd=hidden,
        n_layer=layers,
        n_head=heads,
        bos_token_id=VOCAB - 1,
        eos_token_id=VOCAB - 1,
    )
    return _plain_lm(_made(GPT2LMHeadModel, cfg), layers, seq, mask=size != TINY)


def _llama_default(
    config_cls: Callable[..., Any], size: tuple[int, int, int, int], kv_heads: int
) -> Any:
    hidden, heads, layers, seq = size
    return config_cls(
        vocab_size=VOCAB,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        max_position_embeddings=seq,
    )


def llama_default(size: tuple[int, int, int, int] = TINY) -> ZooCase:
    """Llama at its defaults (no attention dropout, as many key/value heads as heads)."""
    cfg = _llama_default(LlamaConfig, size, size[1])
    return _plain_lm(_made(LlamaForCausalLM, cfg), size[2], size[3], mask=size != TINY)


def qwen2_default(size: tuple[int, int, int, int] = TINY) -> ZooCase:
    """Qwen2 at its defaults (biased q/k/v projections, no attention dropout), with half as
    many key/value heads as heads (its default ties them to 32 heads)."""
    cfg = _llama_default(Qwen2Config, size, size[1] // 2)
    return _plain_lm(_made(Qwen2ForCausalLM, cfg), size[2], size[3], mask=size != TINY)


# at their defaults, called without padding: the tiny size with the ids alone, the wide one
# with an all-ones mask; transformers then lets SDPA run its causal path (`is_causal=True`),
# which no padded zoo call reaches
DEFAULTS: dict[str, Callable[[], ZooCase]] = {
    "hf-gpt2-default": gpt2_default,
    "hf-llama-default": llama_default,
    "hf-qwen2-default": qwen2_default,
    "hf-gpt2-default-64": lambda: gpt2_default(WIDE),
    "hf-llama-default-64": lambda: llama_default(WIDE),
    "hf-qwen2-default-64": lambda: qwen2_default(WIDE),
}


def _meta_lm(model: Callable[[], nn.Module], layers: int) -> ZooCase:
    """A language model and one batch of 512 tokens on the meta device: shapes and costs
    without weights, to plan; it cannot run."""
    with torch.device("meta"):
        m = model().train()
        ids = torch.zeros(1, BIG_SEQ, dtype=torch.long)
        mask = torch.ones(1, BIG_SEQ, dtype=torch.long)
        labels = torch.zeros(1, BIG_SEQ, dtype=torch.long)
    return ZooCase(m, (ids,), {"attention_mask": mask}, token_loss, (labels,), layers)


def gpt2_meta(layers: int = 12) -> ZooCase:
    """GPT-2 124M's shape (d768, 12 heads, vocabulary 50,257), batch 1 x 512 tokens."""
    cfg = GPT2Config(n_embd=768, n_layer=layers, n_head=12, n_positions=1024)
    return _meta_lm(lambda: GPT2LMHeadModel(cfg), layers)


def llama_meta(layers: int = 12) -> ZooCase:
    """A Llama of d768, MLP 2048, 12 heads, vocabulary 32,000, batch 1 x 512 tokens."""
    cfg = LlamaConfig(
        hidden_size=768,
        intermediate_size=2048,
        num_hidden_layers=layers,
        num_attention_heads=12,
        num_key_value_heads=12,
        vocab_size=32000,
    )
    return _meta_lm(lambda: LlamaForCausalLM(cfg), layers)


# 12 layers on the meta device: planned, never run
META: dict[str, Callable[[], ZooCase]] = {"hf-gpt2-12l": gpt2_meta, "hf-llama-12l": llama_meta}
