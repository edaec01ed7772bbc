"""A step analysed with the chunked loss head is the interpreter's: native execution runs the
model's own head (the whole logits), so it refuses the plan rather than run another step."""

from __future__ import annotations

import pytest
import torch

import core
from core import InvalidPlan, strategies
from sample_models.gpt import GPT, GPTConfig


def test_a_chunked_head_plan_is_refused_natively_by_name() -> None:
    torch.manual_seed(0)
    cfg = GPTConfig(block_size=64, vocab_size=600, n_layer=1, n_head=2, n_embd=32, dropout=0.1)
    model = GPT(cfg)
    inputs = (torch.randint(0, 600, (2, 64)), torch.randint(0, 600, (2, 64)))
    problem = core.analyze(model, inputs, loss_head="chunked")
    plan = core.solve(problem, 1.0, method="store_all")
    with pytest.raises(InvalidPlan, match="chunked loss head, which only the interpreter"):
        core.apply_plan(model, plan, runtime="native")
    with pytest.raises(InvalidPlan, match="runtime='interpreter'"):
        core.lower(plan)
    with pytest.raises(InvalidPlan, match="chunked loss head"):
        strategies.torchtune_offload(problem)
    core.apply_plan(model, plan)  # the interpreter runs it
