"""Ops in words a PyTorch user knows: the module that ran an op and what its result is.

A traced op is an ATen call ("aten.empty_like", "addmm_2"); people know their model as
modules ("transformer.h.1.attn.resid_dropout") and tensors by role ("dropout mask",
"attention scores"). `op_name` gives both, from what the trace recorded: each forward op's
module path and source line, and each backward op's autograd sequence number, which it
shares with the forward op it differentiates. `block_title` names a block by the module most
of its ops ran in. Pure reading: nothing here changes a graph or a plan.
"""

from __future__ import annotations

import weakref
from collections import Counter
from dataclasses import dataclass
from typing import Any

# ATen op (without "aten.") -> what its result is, when the op alone says it
KINDS: dict[str, str] = {
    "native_layer_norm": "layer-norm output",
    "native_batch_norm": "batch-norm output",
    "_native_batch_norm_legit": "batch-norm output",
    "_native_batch_norm_legit_functional": "batch-norm output",
    "native_group_norm": "group-norm output",
    "gelu": "GELU activation",
    "relu": "ReLU activation",
    "silu": "SiLU activation",
    "tanh": "tanh activation",
    "sigmoid": "sigmoid activation",
    "convolution": "convolution output",
    "max_pool2d_with_indices": "max-pool output",
    "avg_pool2d": "average-pool output",
    "_adaptive_avg_pool2d": "average-pool output",
    "embedding": "embedding lookup",
    "arange": "positions",
    "clone": "contiguous copy",
    "_log_softmax": "log-probabilities (the loss's)",
    "nll_loss_forward": "loss",
    "mse_loss": "loss",
    "_scaled_dot_product_flash_attention_for_cpu": "attention output",
    "_scaled_dot_product_efficient_attention": "attention output",
    "_scaled_dot_product_flash_attention": "attention output",
    "cat": "concatenation",
    "mean": "mean",
    "sum": "sum",
    "where": "selection",
    "bitwise_not": "inverted mask",
}
LINEAR = {"addmm", "mm", "linear"}


@dataclass(frozen=True)
class OpName:
    """An op as people name it: `module` ("" when none ran it), `kind` in words, `aten`."""

    module: str
    kind: str
    aten: str

    @property
    def words(self) -> str:
        """'transformer.h.1.mlp.dropout · dropout mask'."""
        return f"{self.module} · {self.kind}" if self.module else self.kind

    @property
    def full(self) -> str:
        """The words with the ATen op second: '… · dropout mask (aten.empty_like)'."""
        return f"{self.words} ({self.aten})"


def op_name(graph: Any, o: int) -> OpName:
    """The module and kind of `graph.ops[o]` (a `core.graph.Graph`)."""
    return _names(graph)[o]


def block_title(graph: Any, block: Any) -> str:
    """A block's name for people: the deepest module path shared by most of its forward ops
    ('transformer.h.0'), else its ops' kinds."""
    names = _names(graph)
    paths = [names[o].module for o in block.forward_ops if names[o].module]
    if not paths:
        kinds = Counter(names[o].kind for o in block.forward_ops)
        return ", ".join(k for k, _ in kinds.most_common(2)) or f"block {block.index}"
    common = _common_prefix([p.split(".") for p in paths])
    if common:
        return ".".join(common)
    distinct = list(dict.fromkeys(paths))
    return ", ".join(distinct[:2]) + (" …" if len(distinct) > 2 else "")


# names per graph, dropped with the graph (graphs compare by value, so they are not hashable)
_CACHE: dict[int, tuple[weakref.ref, tuple[OpName, ...]]] = {}


def _names(graph: Any) -> tuple[OpName, ...]:
    got = _CACHE.get(id(graph))
    if got is not None and got[0]() is graph:
        return got[1]
    names = _make_names(graph)
    _CACHE[id(graph)] = (weakref.ref(graph), names)
    weakref.finalize(graph, _CACHE.pop, id(graph), None)
    return names


def _make_names(graph: Any) -> tuple[OpName, ...]:
    nodes = graph.trace.nodes
    by_seq: dict[int, int] = {}
    for op in graph.ops:
        node = nodes[op.nodes[0]]
        if op.phase == "forward" and node.seq_nr >= 0:
            by_seq.setdefault(node.seq_nr, op.index)
    out: list[OpName] = []
    forward: dict[int, OpName] = {}
    for op in graph.ops:
        node = nodes[op.nodes[0]]
        if op.phase == "forward":
            name = OpName(node.module or "", _forward_kind(op, graph), op.label)
            forward[op.index] = name
        else:
            of = by_seq.get(node.seq_nr)
            base = forward.get(of) if of is not None else None
            kind = f"gradient of the {base.kind}" if base else "gradient"
            name = OpName(base.module if base else "", kind, op.label)
        out.append(name)
    return tuple(out)


def _forward_kind(op: Any, graph: Any) -> str:
    nodes = graph.trace.nodes
    labels = [nodes[i].label for i in op.nodes]
    aten = op.label.removeprefix("aten.")
    node = nodes[op.nodes[0]]
    module = node.module or ""
    leaf = module.rsplit(".", 1)[-1].lower()
    source = (node.source or "").replace(" ", "")
    attention = "attn" in module.lower() or "attention" in module.lower()
    if op.state_update:
        return "running-statistics update"
    if "aten.bernoulli_" in labels or aten in ("bernoulli", "native_dropout"):
        return "dropout mask"
    if "drop" in leaf and aten == "mul":
        return "dropout output"
    if aten in LINEAR:
        return "linear-layer output" if module else "matrix product"
    if aten == "bmm":
        if attention and ("transpose(-2,-1)" in source or ".T" in source):
            return "attention scores"
        return "attention-weighted values" if attention else "batched matrix product"
    if aten == "mul" and attention and "sqrt" in source:
        return "scaled attention scores"
    if aten == "masked_fill":
        return "masked attention scores" if attention else "masked fill"
    if aten == "_softmax":
        return "attention probabilities" if attention else "softmax"
    if aten == "add":
        residual = any(t in source for t in ("x=x+", "+x", "identity", "residual", "shortcut"))
        return "residual sum" if residual else "sum"
    if aten in KINDS:
        return KINDS[aten]
    return aten.strip("_").replace("_", " ")


def _common_prefix(parts: list[list[str]]) -> list[str]:
    """The longest module path every one of `parts` starts with."""
    out: list[str] = []
    for level in zip(*parts, strict=False):
        if len(set(level)) != 1:
            break
        out.append(level[0])
    return out
