"""A mixture of experts with transformers' default experts (`grouped_mm`, one
`aten._grouped_mm` per expert projection) traces on CPU and its plans are exact: loss,
gradients, buffers and random stream equal eager's bit for bit, measured peak = predicted +
4 B, with keyword inputs and the loss outside the model."""

from __future__ import annotations

import pytest
import torch
from zoo_exact import eager as _eager
from zoo_exact import run_exactly as _run_exactly

import core
from sample_models.hf_zoo import mixtral

pytestmark = pytest.mark.usefixtures("one_thread")  # bit-identical on 1 thread


@pytest.mark.slow
def test_default_grouped_mm_experts_plan_and_run_exactly():
    case = mixtral(experts=None)
    assert case.model.config._experts_implementation == "grouped_mm"
    problem = core.analyze(case.model, case.args, case.kwargs, case.loss_fn, case.targets)
    grouped = [op for op in problem.graph.ops if op.name.startswith("_grouped_mm")]
    assert len(grouped) >= 6 * case.layers  # 3 projections forward, their gradients back
    start = {k: v.clone() for k, v in case.model.state_dict().items()}
    eager = _eager(case, start)
    blocks = core.solve(problem, 1.0, method="checkpoint_blocks")
    between = (problem.store_all_peak + blocks.predicted_peak) // 2
    plans = [
        blocks,
        core.solve(problem, between, method="rockmate"),
        core.solve(problem, 0.8, method="offload"),
    ]
    assert blocks.recomputed_ops > 0
    for plan in plans:
        _run_exactly(case, start, plan, eager)


def _cases(dtype: torch.dtype) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]]:
    """aten._grouped_mm's four forms, one with an output row of 5 elements (padded)."""
    g = torch.Generator().manual_seed(0)
    offs = torch.tensor([2, 4, 6], dtype=torch.int32)

    def r(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g).to(dtype)

    return [
        (r(6, 16), r(3, 16, 16), offs),  # 2d x 3d: tokens by expert
        (r(6, 16), r(3, 5, 16).transpose(-1, -2), offs),  # 2d x 3d, rows of 5
        (r(6, 16).t(), r(6, 16), offs),  # 2d x 2d: weight gradients
        (r(3, 8, 16), r(3, 16, 16), None),  # 3d x 3d
        (r(3, 8, 16), r(16, 24), torch.tensor([8, 16, 24], dtype=torch.int32)),  # 3d x 2d
    ]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_grouped_mm_fake_kernel_is_the_cpu_kernels_layout(dtype):
    """Shape, strides (rows padded to 16 bytes) and dtype as the CPU kernel makes them."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from core.trace import fake_kernels

    fake_kernels.register()
    for a, b, offs in _cases(dtype):
        real = torch._grouped_mm(a, b, offs=offs)
        with FakeTensorMode(allow_non_fake_inputs=True):
            fake = torch._grouped_mm(a, b, offs=offs)
        assert (fake.shape, fake.stride(), fake.dtype) == (real.shape, real.stride(), real.dtype)
        assert fake.untyped_storage().nbytes() == real.untyped_storage().nbytes()


def test_grouped_mm_fake_kernel_refuses_what_the_cpu_kernel_refuses():
    from torch._subclasses.fake_tensor import FakeTensorMode

    from core.trace import fake_kernels

    fake_kernels.register()
    offs = torch.tensor([2, 4, 6], dtype=torch.int32)
    bad = [
        (torch.randn(6, 16, dtype=torch.float64), torch.randn(3, 16, 16, dtype=torch.float64)),
        (torch.randn(6, 16), torch.randn(3, 16, 16, dtype=torch.bfloat16)),
        (torch.randn(6, 16), torch.randn(3, 16, 5)),  # rows of 20 bytes
    ]
    for a, b in bad:
        with pytest.raises(RuntimeError):
            torch._grouped_mm(a, b, offs=offs)
        with pytest.raises(RuntimeError), FakeTensorMode(allow_non_fake_inputs=True):
            torch._grouped_mm(a, b, offs=offs)
