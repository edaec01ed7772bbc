"""Ops named as PyTorch users know them (core.naming): module path and kind in words, ATen
name second; blocks by the module they run."""

from __future__ import annotations

from core.naming import block_title, op_name


def named(problem, aten_name: str):
    graph = problem.graph
    return op_name(graph, next(o.index for o in graph.ops if o.name == aten_name))


def test_gpt_ops_are_named_by_module_and_kind(analysed):
    _, _, problem = analysed("gpt-tiny")
    mask = named(problem, "empty_like_5")  # the example: a dropout mask
    assert mask.words == "transformer.h.1.attn.resid_dropout · dropout mask"
    assert mask.full.endswith("(aten.empty_like)")
    assert named(problem, "bmm").words == "transformer.h.0.attn · attention scores"
    assert named(problem, "bmm_1").kind == "attention-weighted values"
    assert named(problem, "_softmax").kind == "attention probabilities"
    assert named(problem, "native_layer_norm").words == "transformer.h.0.ln_1 · layer-norm output"
    assert named(problem, "addmm_2").words == "transformer.h.0.mlp.c_fc · linear-layer output"
    assert named(problem, "gelu_backward").words == (
        "transformer.h.1.mlp.gelu · gradient of the GELU activation"
    )


def test_every_op_has_words_and_blocks_have_module_titles(analysed):
    _, _, problem = analysed("gpt-tiny")
    graph = problem.graph
    for op in graph.ops:
        name = op_name(graph, op.index)
        assert name.kind and not name.kind.startswith("aten"), op.name
        assert name.aten == op.label
    titles = [block_title(graph, b) for b in problem.blocks]
    assert "transformer.h.0" in titles and "transformer.h.1" in titles
    assert all(t for t in titles)
