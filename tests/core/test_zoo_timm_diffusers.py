"""timm and diffusers models (sample_models/timm_zoo.py, sample_models/diffusers_zoo.py),
made and called as their users do, held to what tests/core/test_zoo.py holds the Hugging Face
models to: every plan's loss, gradients, buffers (batch-norm statistics) and random stream
equal to eager's bit for bit (1 thread), under the interpreter and under native execution,
and the measured peak equal to the predicted one.

The measured peak is the predicted one + 4 bytes (the scalar seed `loss.backward()`
allocates, which the prediction leaves out as an input of the backward) when the step peaks
in its backward; when it peaks in its forward, before the seed exists, it is the predicted
one exactly (diffusers' UNet2DModel under native execution: eager's forward holds more than
its backward ever does)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers import SEED_BYTES, zoo_step

import core
from core.native.runtime import native_handle
from core.schedule import store_all_plan
from sample_models import diffusers_zoo, timm_zoo
from sample_models.zoo import ZooCase

ZOO = {**timm_zoo.ZOO, **diffusers_zoo.ZOO}
# A 2-level U-Net of one layer per level has no two blocks alike: every level differs, and
# the skips keep the whole U one block of the chain (nested blocks plan inside it).
NO_TWO_ALIKE = {"diffusers-unet", "diffusers-unet-cond"}


pytestmark = pytest.mark.usefixtures("one_thread")  # bit-identical on 1 thread


# the U-Nets' tests take 9-15 s each (nested blocks for Rockmate): only `make test` runs them
SLOW = ("diffusers-unet", "diffusers-unet-cond")


@pytest.fixture(
    scope="module",
    params=[pytest.param(n, marks=pytest.mark.slow) if n in SLOW else n for n in sorted(ZOO)],
)
def zoo(request) -> tuple[str, ZooCase, core.Problem, dict]:
    """Each model analysed once for this module: name, case, problem, starting state."""
    torch.set_num_threads(1)
    case = ZOO[request.param]()
    problem = core.analyze(case.model, case.args, case.kwargs, case.loss_fn, case.targets)
    return request.param, case, problem, {k: v.clone() for k, v in case.model.state_dict().items()}


def _plans(problem: core.Problem) -> dict[str, core.Plan]:
    """checkpoint_blocks, Rockmate halfway between it and store-all, Rockmate at its least."""
    with pytest.raises(core.InfeasibleBudget) as refused:
        core.solve(problem, 1, method="rockmate")
    blocks = core.solve(problem, 1.0, method="checkpoint_blocks")
    assert blocks.recomputed_ops > 0
    between = (problem.store_all_peak + blocks.predicted_peak) // 2
    return {
        "checkpoint_blocks": blocks,
        "rockmate_between": core.solve(problem, between, method="rockmate"),
        "rockmate_min": core.solve(problem, refused.value.minimum, method="rockmate"),
    }


def _run_exactly(case: ZooCase, start: dict, run, predicted: int, label: str) -> int:
    """One step of `run` from the starting state, held to eager's (a step from the same
    state just before) bit for bit and to `predicted`; returns the measured peak."""
    case.model.load_state_dict(start)
    _, _, eager_loss, eager_grads = zoo_step(case)
    eager_state = {k: v.clone() for k, v in case.model.state_dict().items()}
    eager_rng = torch.get_rng_state()
    case.model.load_state_dict(start)
    peak, forward_peak, loss, grads = zoo_step(case, run)
    assert torch.equal(loss, eager_loss), label
    assert grads.keys() == eager_grads.keys(), label
    for key, want in eager_grads.items():
        assert torch.equal(grads[key], want), (label, key)
    for key, value in case.model.state_dict().items():  # batch-norm statistics included
        assert torch.equal(value, eager_state[key]), (label, key)
    assert torch.equal(torch.get_rng_state(), eager_rng), label
    seed = SEED_BYTES if peak > forward_peak else 0  # the seed exists from backward() on
    assert peak == predicted + seed, (label, peak, predicted)
    return peak


def test_plans_run_exactly_under_the_interpreter(zoo):
    name, case, problem, start = zoo
    assert len(problem.blocks) >= case.layers
    kinds = len({b.kind for b in problem.blocks})
    assert (kinds == len(problem.blocks)) if name in NO_TWO_ALIKE else (kinds < len(problem.blocks))
    for label, plan in {"store_all": store_all_plan(problem), **_plans(problem)}.items():
        run = core.apply_plan(case.model, plan)
        _run_exactly(case, start, run, plan.predicted_peak, label)


def test_plans_run_exactly_under_native_execution(zoo):
    """`runtime="native"`: measured = the native simulation's prediction, not the plan's."""
    _, case, problem, start = zoo
    for label, plan in {"store_all": store_all_plan(problem), **_plans(problem)}.items():
        run = core.apply_plan(case.model, plan, loss_fn=case.loss_fn, runtime="native")
        handle = native_handle(run)
        try:
            _run_exactly(case, start, run, handle.prediction.peak, label)
        finally:
            handle.remove()


@pytest.mark.parametrize("real", ["absent", "broken", "working"])
def test_timm_imports_over_the_stub_only_without_a_working_torchvision(real, tmp_path):
    """`import_timm` in a fresh process: over the stub when torchvision is missing or
    raises on import (as PyPI's CUDA build does against the CPU torch wheel), over the real
    one when it imports; the stub is gone from sys.path and sys.modules afterwards, and a
    torchvision class timm holds from it refuses by name."""
    site = tmp_path / "site"
    if real != "absent":
        fake = site / "torchvision"
        (fake / "ops").mkdir(parents=True)
        body = 'raise OSError("libc10_cuda.so: cannot open shared object file")\n'
        if real == "working":  # a torchvision with just what timm reads at import
            stub = Path(timm_zoo.STUB) / "torchvision"
            for path in stub.rglob("*.py"):
                target = fake / path.relative_to(stub)
                target.parent.mkdir(parents=True, exist_ok=True)
                target.write_text(path.read_text())
            body = (stub / "__init__.py").read_text() + "REAL = True\n"
        (fake / "__init__.py").write_text(body)
    code = f"""
import sys
sys.path.insert(0, {str(site)!r})
sys.modules.pop("timm", None)
from sample_models.timm_zoo import STUB, import_timm
timm = import_timm()
from timm.layers.create_norm import FrozenBatchNorm2d
model = timm.create_model("resnet18", pretrained=False, num_classes=3)
assert str(STUB) not in sys.path
real = getattr(sys.modules.get("torchvision"), "REAL", False)
try:
    FrozenBatchNorm2d(8)
    made = "made"
except NotImplementedError as e:
    made = str(e)
print(real, "torchvision" in sys.modules, made)
"""
    root = Path(__file__).resolve().parents[2]
    done = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]
    real_used, kept, made = done.stdout.strip().split(" ", 2)
    assert (real_used, kept) == (("True", "True") if real == "working" else ("False", "False"))
    assert made.startswith("torchvision.ops.misc.FrozenBatchNorm2d is the stub")
