"""A planned module runs the ops its trace recorded. Python-level state that chose those ops
(training mode, dropout's p, any plain attribute of a submodule) and the call's arguments are
checked at every call: a change is a PlanMismatch naming what changed, never a silent run of
the old ops or a raw exception."""

from __future__ import annotations

import pytest
import torch

import core
from sample_models import build
from sample_models.hf_zoo import gpt2


@pytest.fixture(scope="module")
def planned() -> tuple[torch.nn.Module, tuple, torch.nn.Module]:
    model, inputs = build("gpt-1layer")
    problem = core.analyze(model, inputs)
    return model, inputs, core.apply_plan(model, core.solve(problem, 1.0))


def test_a_dropout_probability_changed_after_planning_is_refused(planned) -> None:
    model, inputs, run = planned
    dropout = model.transformer.h[0].attn.attn_dropout
    before = dropout.p
    dropout.p = 0.3
    try:
        with pytest.raises(
            core.PlanMismatch, match=r"model\.transformer\.h\.0\.attn\.attn_dropout\.p is 0\.3"
        ):
            run(*inputs)
    finally:
        dropout.p = before
    run(*inputs).backward()  # set back, the plan runs again


def test_eval_mode_with_gradients_is_refused_and_no_grad_runs_the_model(planned) -> None:
    model, inputs, run = planned
    model.eval()
    try:
        with pytest.raises(core.PlanMismatch, match=r"model\.training is False.*torch\.no_grad"):
            run(*inputs)
        with torch.no_grad():
            assert torch.equal(run(*inputs), model(*inputs))
    finally:
        model.train()


def test_a_plain_attribute_added_by_a_switch_is_refused(planned) -> None:
    """An adapter switch (peft's disable_adapter sets a flag on its layers) or an attention
    implementation's name is a plain attribute like any other."""
    model, inputs, run = planned
    block = model.transformer.h[0]
    block.flash = True
    try:
        run(*inputs).backward()  # an attribute the trace did not see is not a change
    finally:
        del block.flash
    attn = model.transformer.h[0].attn
    attn.n_head, before = attn.n_head + 1, attn.n_head
    try:
        with pytest.raises(core.PlanMismatch, match=r"attn\.n_head is"):
            run(*inputs)
    finally:
        attn.n_head = before


def test_an_argument_given_where_the_plan_had_none_is_a_plan_mismatch() -> None:
    case = gpt2(1)
    kwargs = {"attention_mask": None}
    problem = core.analyze(case.model, case.args, kwargs, case.loss_fn, case.targets)
    run = core.apply_plan(case.model, core.solve(problem, 1.0))
    with pytest.raises(core.PlanMismatch, match="attention_mask"):
        run(*case.args, **case.kwargs, targets=case.targets)
