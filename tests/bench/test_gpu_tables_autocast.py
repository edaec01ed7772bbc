"""The published tables' fp16 rows (`bench.gpu_tables`): the step traced under CUDA autocast
holds the fp16 weight copies, for as long as eager autocast's cache holds them."""

from __future__ import annotations

import dataclasses

from bench.gpu_tables import (
    ROWS,
    Row,
    analyze_row,
    autocast_cached,
    hf_model,
    step_peak,
    strategy_plan,
)
from core import autocast_casts

_TINY_BERT = hf_model(
    "BertForSequenceClassification",
    dict(
        vocab_size=128,
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=128,
        max_position_embeddings=32,
        num_labels=2,
        attn_implementation="eager",
    ),
    2,
    32,
    None,
    device="cpu",
)


def _row(strategy: str) -> Row:
    fp16 = next(r for r in ROWS if r.autocast)
    return dataclasses.replace(fp16, build=_TINY_BERT, strategy=strategy)


def test_checkpointed_forward_holds_every_weight_cast_until_its_end():
    """Checkpointing every layer frees a layer's casts in the plan once read; autocast's
    cache keeps them to the forward's end: the step's peak counts them there."""
    row = _row("checkpoint_blocks")
    case = row.build()
    problem = analyze_row(row, case)
    simulation = strategy_plan(problem, row.strategy, case.model).simulate()
    extra = autocast_cached(problem, simulation)
    graph, last = problem.graph, simulation.backward_start - 1
    casts = {v for o in autocast_casts(graph) for v in graph.ops[o].outputs}
    assert len(casts) > 8  # every Linear's weight and bias, cast once
    live = simulation.live_after(last)
    assert extra[last] == sum(graph.values[v].nbytes for v in casts - live)
    assert extra[last] > 0 and all(x == 0 for x in extra[simulation.backward_start :])
    at_end = simulation.timeline[last]
    held = at_end.activations + at_end.temporaries + extra[last]
    assert step_peak(problem, simulation) >= held + problem.input_bytes
