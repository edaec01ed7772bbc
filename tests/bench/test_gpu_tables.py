"""The published GPU tables (`bench.gpu_tables`): every row a configuration, every residual
computed from it, every row beyond 10% naming its reason."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
import torch

import core
from bench.gpu_tables import (
    COUNTS,
    FSDP,
    ROWS,
    STRATEGIES,
    TOLERANCE,
    AutocastNotTraced,
    Prediction,
    Row,
    State,
    _check_autocast,
    _fsdp_buffers,
    analyze_row,
    check,
    document,
    fp32_token_loss,
    markdown_table,
    predict,
    selective_op_plan,
    strategy_plan,
)
from core.schedule import store_all_plan
from sample_models.zoo import ZooCase


def _tiny(kind: str = "gpt2") -> ZooCase:
    """A two-layer GPT-2 or Llama on the meta device, bf16, 2 x 32 tokens."""
    from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

    kw: dict[str, Any]
    if kind == "gpt2":
        kw = dict(vocab_size=256, n_positions=32, n_embd=64, n_layer=2, n_head=2)
        cls: Any = GPT2LMHeadModel
        cfg: Any = GPT2Config(**kw)
    else:
        kw = dict(
            vocab_size=256,
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=32,
        )
        cls, cfg = LlamaForCausalLM, LlamaConfig(**kw)
    with torch.device("meta"):
        model = cls(cfg).to(torch.bfloat16).train()
        ids = torch.zeros(2, 32, dtype=torch.long)
        labels = torch.zeros(2, 32, dtype=torch.long)
    return ZooCase(model, (ids,), {}, fp32_token_loss, (labels,), 2)


def _row(**changes: Any) -> Row:
    base = Row(
        "a test table",
        "tiny GPT-2",
        "https://example.org/table",
        "allocated",
        10_000_000,
        "a100",
        _tiny,
        "store_all",
        State(2, 4, 12 / 8, "bf16, fp32 grads, Adam / 8"),
        config="two layers",
    )
    return dataclasses.replace(base, **changes)


def test_every_row_is_a_configuration() -> None:
    assert len({(r.table, r.label) for r in ROWS}) == len(ROWS)
    for r in ROWS:
        assert r.counts in COUNTS, r.label
        assert r.strategy in STRATEGIES, r.label
        assert r.device in core.DEVICES, r.label
        assert r.measured > 0 and r.source.startswith("https://"), r.label
        assert r.config and r.state.describe, r.label
        assert callable(r.build)
    tables = {r.table.split(",")[0].split(" ")[0] for r in ROWS}
    assert {"Megatron-LM", "torchtitan", "Hugging"} <= tables


def test_published_figures_as_read() -> None:
    """The figures as the sources print them (golden values, GiB, NVML MiB)."""
    measured = {(r.table.split(" ")[0], r.label): r.measured for r in ROWS}
    assert measured["Megatron-LM", "peak (mem-max-allocated-bytes), unfused attention"] == (
        4_673_069_568
    )
    assert measured["Megatron-LM", "peak (mem-max-allocated-bytes), fused attention"] == (
        2_711_714_304
    )
    assert measured["torchtitan", "FSDP, 8 GPUs"] == round(82.4 * 2**30)
    assert measured["Hugging", "vanilla, batch 4"] == 14949 * 2**20
    assert measured["Hugging", "batch 1, accumulation 4, gradient checkpointing"] == 6775 * 2**20


@pytest.mark.slow
def test_prediction_is_computed_from_the_configuration() -> None:
    row = _row()
    p = predict(row)
    assert not p.refused, p.refused
    case = _tiny()
    n = sum(q.numel() for q in case.model.parameters())
    assert p.n_params == n
    assert (p.parameters, p.gradients, p.optimizer) == (2 * n, 4 * n, round(1.5 * n))
    problem = analyze_row(row, case)
    plan = store_all_plan(problem)
    step = max(s.activations + s.temporaries for s in plan.timeline) + problem.input_bytes
    assert p.step == step and p.parallel == 0
    assert p.total == 2 * n + 4 * n + round(1.5 * n) + step
    assert p.residual == pytest.approx((p.total - row.measured) / row.measured)
    # another measurement, another residual; another framework state, another total
    other = predict(dataclasses.replace(row, measured=2 * row.measured))
    assert other.residual == pytest.approx((p.total - 2 * row.measured) / (2 * row.measured))
    fixed = predict(dataclasses.replace(row, fixed=1000, state=State(4, 4, 8, "fp32")))
    assert fixed.total == 16 * n + step + 1000


def test_no_step_row_counts_only_the_state() -> None:
    p = predict(_row(strategy="none", fixed=7))
    assert p.step == 0 and p.kernels == ()
    assert p.total == p.parameters + p.gradients + p.optimizer + 7


def test_checkpointing_lowers_the_step() -> None:
    store = predict(_row())
    ckpt = predict(_row(strategy="checkpoint_blocks"))
    assert 0 < ckpt.step < store.step


def test_selective_op_keeps_every_other_mm() -> None:
    """torchtitan's policy as a keep set: between checkpointing every layer and store-all."""
    case = _tiny("llama")
    row = _row(build=lambda: _tiny("llama"), device="h100")
    problem = analyze_row(row, case)
    sac = selective_op_plan(problem, case.model)
    store = strategy_plan(problem, "store_all", case.model)
    ckpt = strategy_plan(problem, "checkpoint_blocks", case.model)
    assert ckpt.predicted_peak <= sac.predicted_peak <= store.predicted_peak
    assert sac.predicted_time > store.predicted_time  # it recomputes


def test_fsdp_buffers_are_root_two_layers_and_one_reduce() -> None:
    case = _tiny("llama")
    sizes = {n: q.numel() for n, q in case.model.named_parameters()}
    layer = sum(k for n, k in sizes.items() if n.startswith("model.layers.0."))
    root = sum(sizes.values()) - 2 * layer
    assert _fsdp_buffers(FSDP(8), case) == (root + 2 * layer) * 2 + layer * (2 + 4)


def test_an_untraced_autocast_is_refused() -> None:
    row = _row()
    problem = analyze_row(row, _tiny())
    _check_autocast(problem, row)  # no autocast asked: nothing to refuse
    with pytest.raises(AutocastNotTraced, match="float16"):
        _check_autocast(problem, _row(autocast=(("cuda", "float16"),)))


def test_rows_beyond_tolerance_must_name_a_reason() -> None:
    def made(residual: float, reason: str) -> Prediction:
        row = _row(measured=1000, reason=reason)
        return Prediction(row, parameters=round(1000 * (1 + residual)))

    close, far, named = made(0.05, ""), made(TOLERANCE + 0.01, ""), made(0.5, "a named reason")
    assert not close.needs_reason and far.needs_reason
    assert check([close, far, named]) == [f"{far.row.table} / {far.row.label}"]
    refused = Prediction(_row(), refused="UnsupportedModel: no")
    assert refused.needs_reason and check([refused]) == ["a test table / tiny GPT-2"]


def test_the_table_and_document() -> None:
    p = predict(_row())
    refused = Prediction(_row(label="refused row"), refused="UnsupportedModel: not today")
    table = markdown_table([p, refused])
    lines = table.splitlines()
    assert len(lines) == 4
    assert f"{p.residual:+.1%}" in lines[2]
    assert "| refused |" in lines[3] and "not today" in lines[3]
    doc = document([p, refused], "run here")
    for text in COUNTS.values():
        assert text in doc
    assert "https://example.org/table" in doc and "refused row" in doc


@pytest.mark.slow
def test_megatron_attention_difference() -> None:
    """The two Megatron rows differ by the attention matrix: fused against unfused, the
    predicted difference within 10% of the measured 1.96 GB."""
    unfused, fused = (r for r in ROWS if r.table.startswith("Megatron") and "peak" in r.label)
    pu, pf = predict(unfused), predict(fused)
    assert not pu.refused and not pf.refused
    measured = unfused.measured - fused.measured
    assert abs((pu.total - pf.total) - measured) < 0.1 * measured
    assert any("scaled_dot_product" in k for k in pf.kernels)
    assert pu.kernels == ("matrix (softmax)",)


def test_the_command(capsys: pytest.CaptureFixture[str]) -> None:
    from app.cli import main as cli_main

    assert cli_main(["bench", "--tables", "--rows", "no row is called this"]) == 0
    out = capsys.readouterr().out
    assert out.splitlines()[0].startswith("| table | row | counts | measured GB")
