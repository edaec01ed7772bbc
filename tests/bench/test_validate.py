"""`remat bench --validate`: the GPU validation matrix, run dry on the CPU with tiny models
(the storage tracker measures; measured = predicted + the 4 B seed of loss.backward())."""

from __future__ import annotations

import pytest
import torch

from app.cli import main as cli_main
from bench.validate import (
    COLUMNS,
    PRECISIONS,
    RUNTIMES,
    SEED_BYTES,
    STRATEGIES,
    ModelSpec,
    Result,
    _hf,
    _same,
    _sample_gpt,
    attention_kernels,
    format_kernels,
    format_table,
    run_matrix,
    summary,
)

TINY = (
    ModelSpec("gpt-1layer", _sample_gpt("gpt-1layer")),
    ModelSpec("hf-gpt2", _hf("gpt2", 32, 1, 16, 2)),
    ModelSpec("hf-llama", _hf("llama", 32, 1, 16, 2)),
)


def _broken(device: torch.device):
    raise RuntimeError("no such model here")


@pytest.fixture(scope="module")
def rows() -> list[Result]:
    return run_matrix("cpu", models=(*TINY, ModelSpec("broken", _broken)), reps=1)


@pytest.mark.slow
def test_the_matrix_is_whole_and_in_order(rows: list[Result]) -> None:
    want = [
        (m.name, p, s, r)
        for m in (*TINY, ModelSpec("broken", _broken))
        for p in PRECISIONS
        for s in STRATEGIES
        for r in RUNTIMES
    ]
    assert [(r.model, r.precision, r.strategy, r.runtime) for r in rows] == want


@pytest.mark.slow
def test_every_row_ran_or_says_why(rows: list[Result]) -> None:
    for r in rows:
        assert (r.measured is not None) != bool(r.note), r
    broken = [r for r in rows if r.model == "broken"]
    assert all(r.note.startswith("model not built: RuntimeError: no such model") for r in broken)


@pytest.mark.slow
def test_interpreter_rows_are_exact_on_cpu(rows: list[Result]) -> None:
    ran = [r for r in rows if r.runtime == "interpreter" and r.measured is not None]
    # store-all and checkpointing run for every model and precision
    assert len(ran) >= len(TINY) * len(PRECISIONS) * 2
    for r in ran:
        assert r.difference == SEED_BYTES, r
        assert r.grads == "equal", r
        assert r.eager_spread == "equal", r  # the CPU's kernels are deterministic
        assert r.bound is not None and r.bound >= r.predicted + SEED_BYTES
        assert r.bound % 512 == 0
        assert r.time_ratio > 0


@pytest.mark.slow
def test_native_rows_have_their_own_prediction(rows: list[Result]) -> None:
    native = [r for r in rows if r.runtime == "native" and r.measured is not None]
    assert native, "no native row ran"
    assert all(r.bound is None and r.predicted is not None for r in native)
    assert all(r.grads == "equal" for r in native)


@pytest.mark.slow
def test_the_table_has_a_line_per_row(rows: list[Result]) -> None:
    text = format_table(rows)
    lines = text.splitlines()
    assert lines[0].split()[:4] == list(COLUMNS[:4])
    assert set(lines[1]) == {"-"}
    assert len(lines) == 2 + len(rows)
    for line, r in zip(lines[2:], rows):
        assert line.split()[:4] == [r.model, r.precision, r.strategy, r.runtime]
        if r.note:
            assert line.endswith(r.note)
    assert summary(rows, "cpu").startswith(f"{len(rows)} rows: ")


def test_result_difference() -> None:
    r = Result("m", "fp32", "store_all", "interpreter", predicted=100, measured=104)
    assert r.difference == 4
    assert Result("m", "fp32", "store_all", "native").difference is None


def test_cuda_without_a_gpu_is_a_clear_refusal(capsys: pytest.CaptureFixture[str]) -> None:
    if torch.cuda.is_available():
        pytest.skip("a GPU is here: the command would run")
    assert cli_main(["bench", "--device", "cuda", "--validate"]) == 2
    assert "no CUDA device here" in capsys.readouterr().out


def test_the_attention_rules_pick_the_kernel_cpu_runs() -> None:
    # on the GPU the same table sets our CUDA rules against the kernels torch runs there
    rows = attention_kernels("cpu")
    assert len(rows) == 3 * 4 * 4 * 2 * 2
    assert all(_same(r) for r in rows), [r for r in rows if not _same(r)]
    assert {r.ran for r in rows} == {"flash", "math (composite)"}
    assert format_kernels(rows).endswith(f"{len(rows)} of {len(rows)} calls as predicted")
