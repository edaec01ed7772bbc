"""`remat bench` on gpt-tiny: real steps, measured peaks and times, result files."""

import csv
import math
import os
import statistics
import sys

import pytest
import torch
from helpers import SEED_BYTES

import sample_models
from app import cli
from bench import MissingExtra, compare, compiled, report, runtime
from bench.app import bench_app
from bench.solvers import cold_options


@pytest.fixture(scope="module")
def rows():
    return compare.run_bench(
        ["gpt-tiny"],
        reps=2,
        methods=("store_all", "checkpoint_blocks", "offload"),
        compile_backends=(),
        only=[
            "eager",
            "ckpt",
            "soc",
            "ours:store_all",
            "ours:checkpoint_blocks",
            "ours:offload",
            "native:",
        ],
        show_progress=False,
    )


def _row(rows, key_prefix):
    found = [r for r in rows if r.key.startswith(key_prefix)]
    assert found, f"no row {key_prefix!r} in {[r.key for r in rows]}"
    return found[0]


@pytest.mark.slow  # the bench rows: real steps of every strategy
def test_eager_is_the_reference(rows):
    eager = rows[0]
    assert eager.key == "eager"
    assert eager.peak_ratio == 1.0 and eager.time_ratio == 1.0
    assert eager.grad_error == 0 and eager.grads_match
    # an eager step before every timed step of every strategy, itself included: 2 reps
    assert eager.peak > 0 and eager.time > 0 and len(eager.times) == 2 * len(rows)
    assert not eager.ratios


@pytest.mark.slow  # the bench rows: real steps of every strategy
def test_each_ratio_is_paired_with_an_eager_step(rows):
    for r in rows[1:]:
        assert len(r.ratios) == len(r.times) == 2
        assert r.time_ratio == statistics.median(r.ratios)
        assert all(x > 0 for x in r.ratios)


@pytest.mark.slow  # the bench rows: real steps of every strategy
def test_store_all_matches_eager(rows):
    r = _row(rows, "ours:store_all")
    assert r.grad_error == 0 and r.grads_match
    assert r.peak == rows[0].peak  # eager's
    # the plan's simulated peak is the measured one
    assert r.peak == r.predicted_peak + SEED_BYTES


@pytest.mark.slow  # the bench rows: real steps of every strategy
def test_checkpointing_lowers_the_measured_peak(rows):
    eager = rows[0]
    ours = _row(rows, "ours:checkpoint_blocks")
    torch_ckpt = _row(rows, "ckpt")
    assert ours.peak < eager.peak
    assert torch_ckpt.peak < eager.peak
    assert ours.grads_match and torch_ckpt.grads_match
    assert all(r.ok and not math.isnan(r.time) for r in rows)


@pytest.mark.slow  # the bench rows: real steps of every strategy
def test_files_written(rows, tmp_path):
    paths = report.write_results(rows, tmp_path / "out", reps=2)
    for ext in ("md", "csv", "png", "html"):
        assert paths[ext].exists() and paths[ext].stat().st_size > 0, ext
    md = paths["md"].read_text()
    assert "| strategy | budget asked | measured peak |" in md
    assert "eager" in md
    csv_lines = paths["csv"].read_text().splitlines()
    assert len(csv_lines) == len(rows) + 1


@pytest.mark.slow  # the bench rows: real steps of every strategy
def test_png_left_out_with_a_message_without_matplotlib(rows, tmp_path, monkeypatch):
    """A plain install (no `bench` extra) writes every other file and says how to get the PNG."""
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # `import matplotlib` raises
    said: list[str] = []
    paths = report.write_results(rows, tmp_path / "out", reps=2, log=said.append)
    assert sorted(paths) == ["csv", "html", "md"]
    assert all(p.stat().st_size > 0 for p in paths.values())
    assert not (tmp_path / "out" / "bench.png").exists()
    assert len(said) == 1 and "bench.png" in said[0] and "remat-studio[bench]" in said[0]


def test_app_bench_without_playwright_is_one_error_line(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "playwright.sync_api", None)
    with pytest.raises(MissingExtra, match=r"remat-studio\[bench\]"):
        bench_app()
    assert cli.main(["bench", "--app"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: `remat bench --app` needs playwright") and "Traceback" not in err


def test_cold_options_restores_the_cache_setting(monkeypatch):
    monkeypatch.setenv("REMAT_CACHE", "/somewhere")
    with cold_options():
        assert os.environ["REMAT_CACHE"] == "off"
    assert os.environ["REMAT_CACHE"] == "/somewhere"
    monkeypatch.delenv("REMAT_CACHE")
    with cold_options():
        assert os.environ["REMAT_CACHE"] == "off"
    assert "REMAT_CACHE" not in os.environ


def test_find_blocks_picks_the_repeated_layers():
    expected = {
        "gpt-tiny": "Block",
        "resnet-tiny": "BasicBlock",
        "resnet18": "BasicBlock",
        "vit-tiny": "EncoderBlock",
        "regnet-tiny": "XBlock",
        "mlp-tiny": "Layer",
    }
    for name, cls in expected.items():
        model, _ = sample_models.build(name)
        blocks = compare.find_blocks(model)
        assert len(blocks) >= 2, name
        assert {type(b).__name__ for b in blocks} == {cls}, name


def test_patched_forward_is_restored():
    model, _ = sample_models.build("mlp-tiny")
    blocks = compare.find_blocks(model)
    with compare._patched_forward(blocks, compare._checkpointed):
        assert all("forward" in b.__dict__ for b in blocks)
    assert all("forward" not in b.__dict__ for b in blocks)
    x = torch.randn(2, model.config.in_features)
    torch.testing.assert_close(blocks[0](x), type(blocks[0]).forward(blocks[0], x))


def test_pareto_front():
    pts = [(1.0, 1.0), (1.5, 0.5), (1.2, 1.1), (2.0, 0.5), (3.0, 0.2)]
    assert report.pareto(pts) == [0, 1, 4]


def test_main_rejects_unknown_models(capsys):
    assert compare.main(["--models", "nope", "--out", "/nonexistent"]) == 2


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal where there is no GPU")
@pytest.mark.parametrize("device", ["cuda", "mps", "gpu"])
def test_main_refuses_a_device_this_machine_lacks(device, capsys):
    assert compare.main(["--models", "gpt-tiny", "--device", device, "--out", "/nonexistent"]) == 2
    assert f"--device {device}: no such device here" in capsys.readouterr().out


@pytest.mark.parametrize("budgets", ["half", "0.5,1.5", "0"])
def test_main_rejects_bad_budgets(budgets, capsys):
    assert (
        compare.main(["--models", "gpt-tiny", "--budgets", budgets, "--out", "/nonexistent"]) == 2
    )
    assert "--budgets" in capsys.readouterr().out


@pytest.mark.slow  # the bench rows: real steps of every strategy
def test_save_on_cpu_parks_saved_tensors_outside_the_peak(rows):
    """PyTorch's own offloading, emulated on CPU: exact gradients, and the host copies are not
    device memory; with checkpointing too (soc+ckpt)."""
    eager = rows[0]
    for key in ("soc", "soc+ckpt"):
        r = _row(rows, key)
        assert r.grad_error == 0 and r.grads_match
        assert r.peak < eager.peak
    # every saved tensor leaves: far below what checkpointing every block keeps
    assert _row(rows, "soc").peak < _row(rows, "ckpt").peak


@pytest.mark.slow  # the bench rows: real steps of every strategy
def test_offload_plans_measure_as_predicted(rows):
    """Our offload plans in the bench: one row per distinct plan, its minimum included, each at
    its predicted peak (the host pool is not device memory, as for save_on_cpu)."""
    ours = [r for r in rows if r.key.startswith("ours:offload")]
    assert any("min" in r.budget for r in ours)
    for r in ours:
        assert r.grad_error == 0 and r.grads_match
        assert r.peak == r.predicted_peak + SEED_BYTES


@pytest.mark.slow  # a whole `remat bench` run
def test_budgets_flag_picks_our_budgets(tmp_path, monkeypatch, capsys):
    """Also the command line of a plain install: without matplotlib it says, literally, which
    extra brings the PNG."""
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    out = tmp_path / "b"
    argv = ["--models", "gpt-tiny", "--methods", "rockmate", "--budgets", "0.6", "--no-compile"]
    assert compare.main([*argv, "--reps", "1", "--out", str(out)]) == 0
    keys = {r["key"] for r in csv.DictReader((out / "bench.csv").open())}
    assert "ours:rockmate@60%" in keys and "ours:rockmate@50%" not in keys
    assert "needs matplotlib: pip install 'remat-studio[bench]'" in capsys.readouterr().out
    assert not (out / "bench.png").exists()


@pytest.mark.slow
def test_quick_command_line(tmp_path, capsys):
    """`remat bench --quick` on gpt-tiny: every strategy that runs without inductor, tables
    printed and files written. Its two models (gpt-tiny and resnet-tiny) run in `.ci/run`'s
    plain install, which checks both models' rows."""
    out = tmp_path / "quick"
    assert compare.main(["--quick", "--models", "gpt-tiny", "--reps", "1", "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "gpt-tiny" in printed
    rows = list(csv.DictReader((out / "bench.csv").open()))
    keys = {(r["model"], r["key"]) for r in rows}
    for model in ("gpt-tiny",):
        keys_wanted = ("eager", "soc", "ckpt", "ckpt2", "sac", "soc+ckpt", "aot-0.5", "aot-0.2")
        for key in (*keys_wanted, "ours:store_all@100%"):
            assert (model, key) in keys, (model, key)
    for r in rows:
        assert not r["note"].startswith("failed"), r
        if r["key"].startswith("ours:"):
            assert float(r["grad_error"]) == 0.0, r
    for ext in ("md", "csv", "png", "html"):
        assert (out / f"bench.{ext}").stat().st_size > 0


def test_runtime_bench_prints_overhead_and_calibration(capsys):
    """`remat bench --runtime` on the smallest model: one row, eager and planned milliseconds,
    their ratio and the op-cost calibration (the figures themselves are timings, not checked)."""
    assert runtime.main(["--models", "mlp-tiny", "--reps", "1", "--rounds", "1"]) == 0
    row = capsys.readouterr().out.splitlines()[-1].split()
    assert row[0] == "mlp-tiny" and len(row) == 5
    assert all(float(x) > 0 for x in row[1:])
    with pytest.raises(SystemExit):
        runtime.main(["--rounds", "-1"])


@pytest.mark.slow  # the bench rows: real steps of every strategy
def test_native_rows_beside_the_interpreter(rows):
    """Each plan also runs with runtime="native", paired in the same run (an offloading
    plan's offloads through saved-tensor hooks): gradients bit-equal to eager's, the peak
    the native simulation's (not the interpreter plan's); a recomputing plan below eager's
    peak, store-all at it."""
    eager = rows[0]
    native = {r.key: r for r in rows if r.key.startswith("native:")}
    blocks = [r for k, r in native.items() if k.startswith("native:checkpoint_blocks@")]
    assert "native:store_all@100%" in native and blocks
    assert any(k.startswith("native:offload") for k in native)
    for r in native.values():
        assert r.ok and r.grad_error == 0 and r.grads_match, r
        assert len(r.ratios) == 2
        assert r.peak == r.predicted_peak + SEED_BYTES, r
    assert native["native:store_all@100%"].peak == eager.peak
    assert all(r.peak < eager.peak for r in blocks)


@pytest.mark.slow  # two inductor compiles of forward and backward
def test_native_compiled_row_checks_against_compiled_eager():
    """The compiled native row: peak from the allocator profile, gradients checked bit for bit
    against inductor-compiled eager's (inductor's kernels round otherwise than eager's)."""
    rows = compare.run_bench(
        ["gpt-tiny"],
        reps=1,
        methods=("checkpoint_blocks",),
        compile_backends=("inductor",),
        only=["eager", "native-compiled:"],
        show_progress=False,
    )
    (row,) = [r for r in rows if r.key.startswith("native-compiled:")]
    assert row.ok and row.peak_source == "profiler" and row.grads_match
    assert "gradients torch.equal to torch.compile inductor of eager's" in row.note
    assert 0 < row.peak < row.eager_peak  # eager under the same profile


def test_budget_search_keeps_the_nearest_peak_when_not_monotone():
    """compiled eager's peak is not monotone in activation_memory_budget: the search keeps
    every budget tried and returns the one whose peak is nearest the target."""
    peaks = {1.0: 100, 0.5: 70, 0.25: 60, 0.125: 80, 0.0625: 90}
    budget, peak, tried = compiled.search_budget(peaks.__getitem__, 50, steps=4)
    assert (budget, peak) == (0.25, 60)
    assert [b for b, _ in tried] == [1.0, 0.5, 0.25, 0.125, 0.0625]
    assert compiled.search_budget(peaks.__getitem__, 72, steps=1)[:2] == (0.5, 70)


@pytest.mark.slow  # inductor compiles of eager at each budget tried
def test_compiled_command_line(capsys):
    """`remat bench --compiled` on gpt-tiny: one line, no graph break, gradients equal to
    compiled eager's."""
    argv = ["--compiled", "--models", "gpt-tiny", "--reps", "1", "--steps", "1"]
    assert compare.main(argv) == 0
    line = capsys.readouterr().out.strip().splitlines()[-1].split()
    assert line[0] == "gpt-tiny" and line[-4:-2] == ["0", "yes"], line


@pytest.mark.parametrize("argv", [["--budgets", "half"], ["--models", "nope"], ["--reps", "0"]])
def test_compiled_command_line_rejects_bad_arguments(argv, capsys):
    with pytest.raises(SystemExit) as e:
        compare.main(["--compiled", *argv])
    assert e.value.code == 2 and "remat bench --compiled" in capsys.readouterr().err


@pytest.mark.slow
def test_strategies_bench_on_gpt_tiny(one_thread) -> None:
    """`remat bench --strategies` on gpt-tiny, without compile: every strategy row's measured
    peak is its prediction + the 4-byte seed, gradients equal eager's, ours planned at each
    rival's measured peak fits it, and the report says the conditions."""
    from bench import current

    rows = current.bench_model("gpt-tiny", 1, None, lambda _msg: None, autosac=(0.5,))
    by = {r.key: r for r in rows}
    for key in ("hf", "torchtitan", "torchtune"):
        assert by[key].peak == by[key].predicted + SEED_BYTES
        assert by[key].grads_equal
        assert len(by[key].ratios) == 1
    ours = by["ours@hf"]
    assert ours.peak == ours.predicted + SEED_BYTES and ours.peak <= by["hf"].peak
    assert "no native plan fits" in by["ours@torchtune"].note  # recompute cannot reach offload
    assert "sac_milp: no solution" in by["autosac@50%"].note  # 2 layers: its ILP is infeasible
    text = current.table(rows)
    assert "| gpt-tiny | torchtitan |" in text and "+4 B" in text
    assert any(v.startswith("gpt-tiny hf:") for v in current.verdicts(rows))
