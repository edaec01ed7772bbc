"""Tiny random-init models nobody here wrote (Hugging Face transformers), built offline.

Each builder returns a `ZooCase`: the model, its call (positional and keyword inputs, as
users call it), a loss computed outside the model and its targets, and the number of layers
whose blocks `checkpoint_blocks` should find. Configs are tiny so a step takes milliseconds;
dropout is on wherever the config has it, so the random stream is exercised.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

VOCAB, SEQ, BATCH = 128, 16, 2


@dataclass
class ZooCase:
    model: nn.Module
    args: tuple
    kwargs: dict[str, Any]
    loss_fn: Callable[..., torch.Tensor]
    targets: tuple[torch.Tensor, ...]
    layers: int  # repeated layers: blocks checkpoint_blocks must find at least
    extra: dict[str, Any] = field(default_factory=dict)


def token_loss(output: Any, labels: torch.Tensor) -> torch.Tensor:
    """Cross-entropy over a ModelOutput's logits, computed outside the model."""
    logits = output.logits
    return nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1))


def class_loss(output: Any, labels: torch.Tensor) -> torch.Tensor:
    logits = output.logits if hasattr(output, "logits") else output
    return nn.functional.cross_entropy(logits, labels)


def _tokens(seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
    mask = torch.ones(BATCH, SEQ, dtype=torch.long)
    mask[1, -3:] = 0  # a padded row: the mask reaches attention
    labels = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
    return ids, mask, labels


def _lm(model: nn.Module, layers: int) -> ZooCase:
    ids, mask, labels = _tokens(0)
    return ZooCase(model.train(), (ids,), {"attention_mask": mask}, token_loss, (labels,), layers)


def gpt2(layers: int = 2) -> ZooCase:
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    cfg = GPT2Config(vocab_size=VOCAB, n_positions=SEQ, n_embd=32, n_layer=layers, n_head=2)
    return _lm(GPT2LMHeadModel(cfg), layers)


def llama(layers: int = 2) -> ZooCase:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=SEQ,
        attention_dropout=0.1,
    )
    return _lm(LlamaForCausalLM(cfg), layers)


def bert(layers: int = 2) -> ZooCase:
    from transformers import BertConfig, BertForMaskedLM

    torch.manual_seed(0)
    cfg = BertConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        num_hidden_layers=layers,
        num_attention_heads=2,
        intermediate_size=64,
        max_position_embeddings=SEQ,
    )
    return _lm(BertForMaskedLM(cfg), layers)


def t5(layers: int = 2) -> ZooCase:
    """An encoder-decoder: the decoder's inputs are the labels shifted right inside the model
    (a Python scalar written into a slice: a lifted tensor constant)."""
    from transformers import T5Config, T5ForConditionalGeneration

    torch.manual_seed(0)
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
    model = T5ForConditionalGeneration(cfg).train()
    return ZooCase(model, (ids,), {"attention_mask": mask, "labels": labels}, _hf_loss, (), layers)


def _hf_loss(output: Any) -> torch.Tensor:
    """The loss the model computed itself (labels passed as a keyword input)."""
    return output.loss


def vit(layers: int = 2) -> ZooCase:
    from transformers import ViTConfig, ViTForImageClassification

    torch.manual_seed(0)
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
    model = ViTForImageClassification(cfg).train()
    return ZooCase(model, (), {"pixel_values": x}, class_loss, (y,), layers)


def mixtral(layers: int = 2) -> ZooCase:
    """A mixture of experts: the router normalises its top-k weights in place."""
    from transformers import MixtralConfig, MixtralForCausalLM

    torch.manual_seed(0)
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
        experts_implementation="batched_mm",
    )
    return _lm(MixtralForCausalLM(cfg), layers)


def resnet(layers: int = 2) -> ZooCase:
    """A CNN with batch norm (Hugging Face's ResNet: timm needs torchvision, which has no
    build for this CPU torch wheel here)."""
    from transformers import ResNetConfig, ResNetForImageClassification

    torch.manual_seed(0)
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
    model = ResNetForImageClassification(cfg).train()
    return ZooCase(model, (x,), {}, class_loss, (y,), 3)


ZOO: dict[str, Callable[..., ZooCase]] = {
    "hf-gpt2": gpt2,
    "hf-llama": llama,
    "hf-bert": bert,
    "hf-t5": t5,
    "hf-vit": vit,
    "hf-mixtral": mixtral,
    "hf-resnet": resnet,
}


def report(names: list[str]) -> None:
    """Per zoo model: blocks, cold Rockmate solve (to its minimum), Rockmate at 50% and at its minimum
    (predicted peak over eager's measured peak, predicted overhead), measured - predicted.
    `REMAT_CACHE=off python tests/zoo.py [names]`, 1 thread."""
    import time

    import core
    from core.memory import StorageTracker, step_tensors
    from core.solvers.rotor import minimum_budget

    torch.set_num_threads(1)

    def peak_of(case: ZooCase, run: Callable | None) -> int:
        given = [*case.args, *case.kwargs.values(), *case.targets]
        case.model.zero_grad(set_to_none=True)
        with StorageTracker(step_tensors(case.model, given)) as tracker:
            if run is None:
                loss = case.loss_fn(case.model(*case.args, **case.kwargs), *case.targets)
            else:
                loss = run(*case.args, **case.kwargs, targets=case.targets)
            loss.backward()
        return tracker.peak

    print(
        "| model | blocks (kinds) | analyze s | cold solve s | 50%: peak/eager, overhead "
        "| min: peak/eager, overhead | measured - predicted |"
    )
    print("|---|---|---|---|---|---|---|")
    for name in names:
        case = ZOO[name]()
        start = time.perf_counter()
        problem = core.analyze(case.model, case.args, case.kwargs, case.loss_fn, case.targets)
        analysed = time.perf_counter()
        lowest = core.solve(problem, minimum_budget(problem, "rockmate"), method="rockmate")
        solved = time.perf_counter()
        plans = [lowest]
        if lowest.predicted_peak <= 0.5 * problem.store_all_peak:
            plans.insert(0, core.solve(problem, 0.5, method="rockmate"))
        eager = peak_of(case, None)
        diffs = {peak_of(case, core.apply_plan(case.model, p)) - p.predicted_peak for p in plans}
        cells = [f"{p.predicted_peak / eager:.2f}, {p.overhead:.3f}" for p in plans]
        cells = ["below its minimum"] * (2 - len(cells)) + cells
        kinds = len({b.kind for b in problem.blocks})
        print(
            f"| {name} | {len(problem.blocks)} ({kinds}) | {analysed - start:.1f} | "
            f"{solved - analysed:.1f} | {cells[0]} | {cells[1]} | {sorted(diffs)} B |"
        )


if __name__ == "__main__":
    import sys

    report(sys.argv[1:] or list(ZOO))
