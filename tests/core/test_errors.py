"""Bad input gets a clear error that says what is wrong and what to do."""

import os
import socket
import subprocess
import sys

import pytest
import torch
from helpers import SEED_BYTES, assert_same_grads, measured_step
from torch import nn

import core
from app.cli import main
from core.errors import BudgetError, InfeasibleBudget
from core.frontier import minimum_budget
from core.solvers import parse_budget


@pytest.fixture(scope="module")
def problem(analysed):
    return analysed("gpt-tiny")[2]


@pytest.mark.parametrize(
    "budget",
    [0, -5, 0.0, -0.5, float("nan"), "", "lots", "-3GB", True, float("inf"), "1e999", "1e999%",
     "inf", 2**70, "1e30TB", 1e300],
)  # fmt: skip
def test_bad_budgets_are_refused(problem, budget):
    with pytest.raises(BudgetError):
        core.solve(problem, budget, method="store_all")


@pytest.mark.parametrize(
    ("text", "expected"),
    [("2GB", 2 * 10**9), ("512MiB", 512 * 2**20), ("1.5 kB", 1500), ("4096", 4096), ("3e3B", 3000)],
)
def test_budget_strings(text, expected):
    assert parse_budget(text, 10**12) == expected


def test_percent_and_fraction(problem):
    peak = problem.store_all_peak
    assert parse_budget("50%", peak) == parse_budget(0.5, peak) == int(0.5 * peak)
    # a bare number string reads as the Python literal: "0.5" a fraction, "4096" bytes
    assert parse_budget("0.5", peak) == parse_budget(0.5, peak)
    assert parse_budget("4096", peak) == parse_budget(4096, peak) == 4096


def test_budget_above_store_all_gives_store_all_with_a_note(problem):
    plan = core.solve(problem, "150%", method="sqrt_n")
    assert plan.predicted_peak <= problem.store_all_peak
    assert any("above the store-all peak" in n for n in plan.notes)


def test_budget_below_minimum_names_the_minimum(problem):
    with pytest.raises(InfeasibleBudget) as err:
        core.solve(problem, 0.05, method="checkpoint_blocks")
    minimum = err.value.minimum
    assert minimum > 0.05 * problem.store_all_peak
    assert str(minimum) in str(err.value)
    core.solve(problem, minimum, method="checkpoint_blocks")  # the minimum itself fits


def test_a_budget_below_every_plan_names_the_op_that_sets_the_floor(problem):
    """The floor is one op's own inputs and outputs: no method's plan goes below it, and a
    budget under it says which op and how many bytes."""
    floor = problem.floor  # the loss's softmax backward: logits, their grad, the result
    assert floor.label == "aten._log_softmax_backward_data" and len(set(floor.tensors)) == 1
    for method in ("checkpoint_blocks", "rotor", "rockmate", "offload"):
        with pytest.raises(InfeasibleBudget) as err:
            core.solve(problem, floor.nbytes - 1, method=method)
        assert f"no plan of any method goes below {floor.op}" in str(err.value)
        assert err.value.minimum >= floor.nbytes
    low = minimum_budget(problem, "rockmate")
    assert floor.nbytes <= core.solve(problem, low).predicted_peak
    with pytest.raises(InfeasibleBudget) as err:  # above the floor, below the method's minimum
        core.solve(problem, (floor.nbytes + low) // 2, method="checkpoint_blocks")
    assert "no plan of any method" not in str(err.value)


class _Nonzero(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(4, 4)
        self.pick = _Pick()

    def forward(self, x):
        return self.pick(self.proj(x)).sum()


class _Pick(nn.Module):
    def forward(self, x):
        return x[x > 0]  # boolean indexing: output shape depends on the data


def test_op_with_data_dependent_shape_names_op_and_module():
    with pytest.raises(core.UnsupportedModel) as err:
        core.analyze(_Nonzero(), (torch.randn(3, 4),))
    assert "pick (_Pick)" in str(err.value)
    assert "aten.nonzero" in str(err.value) or "output shape depends on the data" in str(err.value)


def test_wrong_example_inputs_are_an_unsupported_model_error():
    with pytest.raises(core.UnsupportedModel, match="example inputs"):
        core.analyze(nn.Linear(4, 4), (torch.randn(3, 5),))


def _remat(*args: str, path: str = "") -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [path, os.getcwd()])))
    return subprocess.run(
        [sys.executable, "-m", "app.cli", *args],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )


@pytest.fixture
def remat(capsys, monkeypatch):
    """`remat ARGS` run in this process (`app.cli.main`): its exit code and what it printed,
    as `_remat`'s subprocess gives them, without a fresh interpreter importing torch per call
    (test_cli_error_is_one_line_exit_2 keeps one real process). `path` goes on sys.path for
    the call, and the modules imported from it are forgotten after."""

    def run(*args: str, path: str = "") -> subprocess.CompletedProcess:
        before = set(sys.modules)
        with monkeypatch.context() as m:
            if path:
                m.syspath_prepend(path)
            capsys.readouterr()
            code = main(list(args))
            out, err = capsys.readouterr()
        for name in set(sys.modules) - before:
            if path and str(getattr(sys.modules[name], "__file__", "")).startswith(path):
                del sys.modules[name]
        return subprocess.CompletedProcess(list(args), code, out, err)

    return run


def _one_error_line(result: subprocess.CompletedProcess) -> str:
    """The CLI's single `error:` line (exit 2, no traceback)."""
    assert result.returncode == 2, (result.returncode, result.stderr[-500:])
    assert "Traceback" not in result.stderr
    lines = [ln for ln in result.stderr.splitlines() if "error: " in ln]
    assert len(lines) == 1, result.stderr[-500:]
    return lines[0]


@pytest.mark.slow
def test_cli_builder_that_raises_or_exits_is_named(tmp_path, remat):
    (tmp_path / "mybuilders.py").write_text(
        "import sys\n"
        "def boom():\n    raise RuntimeError('no data here')\n"
        "def leave():\n    sys.exit(0)\n"
    )
    line = _one_error_line(remat("inspect", "mybuilders:boom", path=str(tmp_path)))
    assert "mybuilders:boom raised RuntimeError: no data here" in line
    line = _one_error_line(remat("inspect", "mybuilders:leave", path=str(tmp_path)))
    assert "mybuilders:leave called sys.exit(0)" in line
    debug = remat("--debug", "inspect", "mybuilders:boom", path=str(tmp_path))
    assert debug.returncode == 2 and "Traceback" in debug.stderr


@pytest.mark.slow  # `remat plan` analyses two models
def test_cli_plans_a_model_called_with_keywords_and_a_loss_outside(tmp_path, remat):
    """A builder returning a core.ModelCall, and a zoo name: the plan file carries the call,
    and applying it with the same loss_fn trains as the call says."""
    (tmp_path / "mycalls.py").write_text(
        "import torch, core\n"
        "def loss(out, y):\n    return torch.nn.functional.mse_loss(out, y)\n"
        "def build():\n"
        "    torch.manual_seed(0)\n"
        "    net = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.ReLU(), torch.nn.Linear(32, 8))\n"
        "    return core.ModelCall(net, kwargs={'input': torch.randn(4, 8)}, loss_fn=loss,\n"
        "                          targets=(torch.randn(4, 8),))\n"
    )
    out = tmp_path / "plan.pkl"
    result = remat("plan", "mycalls:build", "--budget", "100%", "-o", str(out), path=str(tmp_path))
    assert result.returncode == 0, result.stderr[-800:]
    assert core.load_plan(out).graph_meta.call["loss"]
    zoo = remat(
        "plan",
        "hf-bert",
        "--budget",
        "1.0",
        "--method",
        "checkpoint_blocks",
        "-o",
        str(tmp_path / "bert.pkl"),
    )
    assert zoo.returncode == 0 and "plan for hf-bert" in zoo.stdout, zoo.stderr[-800:]


@pytest.mark.slow  # a `remat` subprocess analyses a model
def test_cli_app_bad_port_model_and_port_in_use():
    assert "99999" in _one_error_line(_remat("app", "--port", "99999"))
    assert "nosuch" in _one_error_line(_remat("app", "--model", "nosuch:x", "--port", "0"))
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = str(busy.getsockname()[1])
        assert port in _one_error_line(_remat("app", "--port", port))


@pytest.mark.slow  # a `remat` subprocess analyses a model
def test_cli_error_is_one_line_exit_2():
    result = _remat("plan", "gpt-tiny", "--budget", "1%", "--method", "checkpoint_blocks")
    assert result.returncode == 2
    lines = [ln for ln in result.stderr.splitlines() if ln.strip() and "Warning" not in ln]
    assert lines[-1].startswith("error: no 'checkpoint_blocks' plan fits")
    assert "Traceback" not in result.stderr


@pytest.mark.slow
def test_cli_debug_shows_traceback(remat):
    result = remat("--debug", "plan", "no-such-model", "--budget", "50%")
    assert result.returncode == 2
    assert "Traceback" in result.stderr and "error: unknown model" in result.stderr


@pytest.mark.slow  # a `remat` subprocess analyses a model
def test_cli_bad_budget_and_missing_file(tmp_path, remat):
    assert "error: cannot read the budget" in remat("plan", "mlp-tiny", "--budget", "x").stderr
    result = remat("show", str(tmp_path / "missing.pkl"))
    assert result.returncode == 2 and "error: cannot read plan file" in result.stderr


class _Checkpointed(nn.Module):
    def __init__(self, reentrant: bool):
        super().__init__()
        self.inner = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 8))
        self.reentrant = reentrant

    def forward(self, x):
        y = torch.utils.checkpoint.checkpoint(self.inner, x, use_reentrant=self.reentrant)
        return y.sum()


def test_model_that_already_checkpoints_reentrantly_is_told_to_remove_it():
    x = torch.randn(4, 8, requires_grad=True)
    with pytest.raises(core.UnsupportedModel) as err:
        core.analyze(_Checkpointed(reentrant=True), (x,))
    assert "torch.utils.checkpoint (reentrant)" in str(err.value)
    assert "remove the inner checkpoint" in str(err.value)


def test_model_with_non_reentrant_checkpoint_is_planned_exactly():
    """The model's own non-reentrant checkpoint is traced as plain forward ops (the plan
    decides what to recompute and replaces it): no forward op is recomputed in the traced
    backward, and plans run with eager's gradients at the predicted peak."""
    model, x = _Checkpointed(reentrant=False), torch.randn(4, 8)
    problem = core.analyze(model, (x,))
    backward = [problem.graph.ops[o].name for o in problem.graph.backward_ops]
    assert sum(name.startswith("addmm") for name in backward) == 0  # inner[0] not recomputed
    eager_peak, eager_loss, eager_grads = measured_step(model, (x,))
    plan = core.solve(problem, 1.0, method="store_all")
    peak, loss, grads = measured_step(model, (x,), run=core.apply_plan(model, plan))
    assert loss == eager_loss and peak == plan.predicted_peak + SEED_BYTES
    assert_same_grads(grads, eager_grads)
