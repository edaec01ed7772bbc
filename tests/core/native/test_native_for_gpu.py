"""A native plan made on the CPU for a GPU (`device="h100"`). Lowering runs the model again
after its trace (core.native.boundaries, core.native.lifetimes) and aligns the ops it
dispatches with the trace's; those probes run the model as the GPU does (its fused dropout,
its attention kernels, CUDA autocast's casts: `core.trace.device.running_as`), so every
traced forward op is aligned and the lowering is the one the GPU's own trace gives. On an
H200 (docs/validate.md, 2026-11-28) the GPU-traced native plans of gpt-small-6l measured
their prediction + 512 B; the CPU-traced ones had predicted another program before this."""

from __future__ import annotations

import pytest
from torch import nn

import core
import sample_models
from core.native.boundaries import boundaries
from core.native.lowering import lower
from core.trace.autocast import Autocast

BF16_CUDA = Autocast((("cuda", "bfloat16"),))


def _problem(autocast: Autocast | None) -> tuple[core.Problem, nn.Module]:
    """The problem and its model, which the caller keeps: lowering runs it again."""
    model, (idx, targets) = sample_models.build("gpt-tiny")
    problem = core.analyze(
        model.train(),
        (idx,),
        loss_fn=lambda logits, y: nn.functional.cross_entropy(logits.flatten(0, 1), y.flatten()),
        targets=(targets,),
        device="h100",
        autocast=autocast,
    )
    return problem, model


@pytest.mark.parametrize("autocast", [None, BF16_CUDA], ids=["fp32", "bf16-autocast"])
def test_every_forward_op_is_aligned_with_the_gpu_trace(autocast: Autocast | None) -> None:
    problem, _model = _problem(autocast)
    labels = {op.label for op in problem.graph.ops}
    assert "aten.native_dropout" in labels  # CUDA's fused dropout, not CPU's bernoulli
    assert boundaries(problem).unmatched == frozenset()


@pytest.mark.parametrize("autocast", [None, BF16_CUDA], ids=["fp32", "bf16-autocast"])
def test_every_checkpointed_block_runs_natively(autocast: Autocast | None) -> None:
    problem, _model = _problem(autocast)
    plan = core.solve(problem, problem.store_all_peak, "checkpoint_blocks")
    lowered = lower(plan)
    assert not [n for n in lowered.notes if "keeps it whole" in n], lowered.notes
    assert lowered.prediction.peak < problem.store_all_peak
