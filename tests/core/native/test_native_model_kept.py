"""Native execution's lowering runs the analysed model again (its module boundaries, its
Python lifetimes). A problem whose model was garbage collected planned on as if the model had
no modules: `remat plan --method native`, which dropped the model after analysing it,
answered that no native plan of mlp-batch fits 70% ("the smallest feasible budget ... is
1.8 MiB", store-all), where one of 61% does."""

from __future__ import annotations

import gc

import pytest

import core
from app.cli import main
from sample_models import build


def test_a_native_solve_whose_model_is_gone_says_to_keep_it():
    model, inputs = build("mlp-batch")
    problem = core.analyze(model, inputs)
    del model
    gc.collect()
    with pytest.raises(core.RematError, match="keep a reference to the model"):
        core.solve(problem, 0.7, method="native")


def test_lowering_a_plan_whose_model_is_gone_says_to_keep_it():
    """`core.lower` of a plan made while the model lived: without it the lowering would
    know no module boundaries and predict another native program than the one that runs."""
    model, inputs = build("mlp-batch")
    plan = core.solve(core.analyze(model, inputs), 0.7)
    del model
    gc.collect()
    with pytest.raises(core.RematError, match="keep a reference to the model"):
        core.lower(plan)


def test_remat_plan_and_show_print_the_native_step(tmp_path, capsys):
    assert main(["plan", "mlp-batch", "--budget", "70%", "--method", "native",
                 "-o", str(tmp_path / "plan.remat")]) == 0  # fmt: skip
    said = capsys.readouterr().out
    model, inputs = build("mlp-batch")
    plan = core.solve(core.analyze(model, inputs), 0.7, method="native")
    native = core.lower(plan)
    assert native.prediction.peak < plan.problem.store_all_peak
    assert f"predicted peak (runtime='native') {core.fmt_bytes(native.prediction.peak)}" in said
    assert f"{native.recomputed_ops} recomputed ops" in said
    assert main(["show", str(tmp_path / "plan.remat")]) == 0  # the file says it too
    shown = capsys.readouterr().out
    assert f"native execution: predicted peak {core.fmt_bytes(native.prediction.peak)}" in shown
