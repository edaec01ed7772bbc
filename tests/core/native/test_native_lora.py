"""peft LoRA (r 8 on the q, v and down projections, lora_dropout 0.1) on a tiny Llama at
its defaults: natively and interpreted, loss and every gradient equal eager's bit for bit,
measured peak = predicted + 4 B.

LoRA's `B(A(dropout(x)))` ends a region's recompute before B's matmul: autograd packs a
node's inputs before its op runs, so the recompute stops once the last holder (B's input)
is filled, and B's output is never recomputed (`core.native.simulate`)."""

from __future__ import annotations

import pytest
import torch
from helpers import SEED_BYTES
from native_cases import plans as _plans
from native_cases import step as _step
from zoo_exact import eager as _eager
from zoo_exact import run_exactly as _run_exactly

import core
from core.native.lowering import lower
from core.native.runtime import native_handle
from sample_models.hf_zoo import llama_default

peft = pytest.importorskip("peft")
pytestmark = [pytest.mark.usefixtures("one_thread"), pytest.mark.slow]


def _lora_llama():
    case = llama_default()
    config = peft.LoraConfig(
        r=8, lora_alpha=16, target_modules=["q_proj", "v_proj", "down_proj"], lora_dropout=0.1
    )
    case.model = peft.get_peft_model(case.model, config).train()
    case.kwargs = {**case.kwargs, "use_cache": False}
    return case


def test_lora_native_is_exact():
    c = _lora_llama()
    model, args, kwargs, loss_fn, targets = c.model, c.args, c.kwargs, c.loss_fn, c.targets
    state = {k: v.clone() for k, v in model.state_dict().items()}
    problem = core.analyze(model, args, kwargs, loss_fn, targets)
    _, eager_loss, eager_grads = _step(model, model, args, kwargs, loss_fn, targets)
    assert eager_grads and all("lora_" in n for n in eager_grads)  # the adapters train alone
    for label, plan in _plans(problem).items():
        model.load_state_dict(state)
        predicted = lower(plan).prediction
        run = core.apply_plan(model, plan, loss_fn=loss_fn, runtime="native")
        handle = native_handle(run)
        peak, loss, grads = _step(model, run, args, kwargs, loss_fn, targets)
        handle.remove()
        print(f"lora {label}: native predicted {predicted.peak} measured {peak}")
        assert label == "store_all" or handle.lowering.recomputed_ops > 0, label
        assert torch.equal(loss, eager_loss), label
        for n in eager_grads:
            assert torch.equal(grads[n], eager_grads[n]), f"{label}: {n}"
        assert peak == predicted.peak + SEED_BYTES, label


def test_lora_interpreted_is_exact():
    c = _lora_llama()
    problem = core.analyze(c.model, c.args, c.kwargs, c.loss_fn, c.targets)
    start = {k: v.clone() for k, v in c.model.state_dict().items()}
    eager = _eager(c, start)
    for plan in _plans(problem).values():
        _run_exactly(c, start, plan, eager)
