"""What the published tables' residual analysis rests on (`bench.gpu_tables`): the trace of
Megatron's loss and the paragraphs computed from the rows."""

from __future__ import annotations

import dataclasses

import torch

from bench.gpu_tables import (
    ROWS,
    Prediction,
    analyze_row,
    hf_model,
    megatron_loss,
    residual_analysis,
    strategy_plan,
)

BATCH, SEQ, VOCAB = 2, 32, 256


def test_megatron_loss_trace_holds_two_fp32_logits_at_once():
    """Megatron's in-place cross-entropy, traced out of place: two fp32 logits-sized tensors
    are live together at some step, never three (the rows' reason counts one more than
    Megatron holds)."""
    build = hf_model(
        "GPT2LMHeadModel",
        dict(vocab_size=VOCAB, n_positions=SEQ, n_embd=64, n_layer=2, n_head=2),
        BATCH,
        SEQ,
        megatron_loss,
        torch.bfloat16,
    )
    megatron = next(r for r in ROWS if r.table.startswith("Megatron") and "fused" in r.label)
    row = dataclasses.replace(megatron, build=build, attention=None)
    case = build()
    problem = analyze_row(row, case)
    simulation = strategy_plan(problem, "store_all", case.model).simulate()
    logits = BATCH * SEQ * VOCAB * 4
    spans = [
        span
        for v, spans in simulation.intervals.items()
        if problem.graph.values[v].nbytes == logits
        for span in spans
    ]
    live = [sum(a <= i < b for a, b in spans) for i in range(len(simulation.timeline))]
    assert max(live) == 2


def _prediction(label: str, measured: int, total: int, step: int = 0) -> Prediction:
    row = next(r for r in ROWS if r.label == label)
    row = dataclasses.replace(row, measured=measured, fixed=0)
    return Prediction(row, parameters=total - step, step=step)


def test_residual_analysis_is_computed_from_the_rows():
    unfused = "peak (mem-max-allocated-bytes), unfused attention"
    fused = "peak (mem-max-allocated-bytes), fused attention"
    fp32, fp16 = "vanilla, batch 4", "batch 4, fp16"
    predictions = [
        _prediction(unfused, 4_000_000_000, 4_412_090_368, 1),
        _prediction(fused, 2_000_000_000, 2_412_090_368, 1),
        _prediction(fp32, 10_000_000_000, 9_000_000_000, 5_000_000_000),
        _prediction(fp16, 10_000_000_000, 8_500_000_000, 4_000_000_000),
    ]
    text = residual_analysis(predictions)
    lines = text.splitlines()
    assert [line.split("**")[1] for line in lines] == ["Megatron-LM.", "Hugging Face."]
    assert "Unfused attention: +10.3% as traced; +0.0% without the 0.412 GB" in lines[0]
    assert "differ by 2.00 GB predicted and 2.00 GB measured" in lines[0]
    assert "1.00 GB under, 20% of the step's 5.00 GB" in lines[1]
    assert "1.50 GB under against fp32's 1.00 GB: 0.50 GB more, -5.0 points" in lines[1]
    refused = dataclasses.replace(predictions[0], refused="UnsupportedModel: no")
    assert "Unfused" not in residual_analysis([refused])
