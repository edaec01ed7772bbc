"""A native plan inside `transformers.Trainer`: analyse one batch as the Trainer calls the
model, `use_cache=False`, apply the plan in place, hand the model to the Trainer. A 4-step
run's losses (each step's, and the logged ones) and final weights equal plain Trainer's bit
for bit (README's recipe)."""

from __future__ import annotations

import pytest
import torch

import core
from core.native.runtime import native_handle
from sample_models.hf_zoo import gpt2_default

pytestmark = pytest.mark.usefixtures("one_thread")  # bit-identical on 1 thread
transformers = pytest.importorskip("transformers")
STEPS, BATCH, TOKENS = 4, 2, 16


class _Recording(transformers.Trainer):
    """The Trainer, recording each step's loss exactly (the logs round it)."""

    losses: list[torch.Tensor]

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):  # noqa: ANN001, ANN201
        loss = super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
        self.losses.append((loss[0] if return_outputs else loss).detach().clone())
        return loss


def _data() -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(5)
    ids = torch.randint(0, 128, (STEPS * BATCH, TOKENS), generator=g)
    return [{"input_ids": x, "labels": x} for x in ids]


def _train(model: torch.nn.Module, out: str) -> tuple[list[torch.Tensor], list[float], dict]:
    args = transformers.TrainingArguments(
        output_dir=out,
        max_steps=STEPS,
        per_device_train_batch_size=BATCH,
        logging_steps=1,
        report_to=[],
        use_cpu=True,
        seed=0,
        save_strategy="no",
        disable_tqdm=True,
    )
    trainer = _Recording(model=model, args=args, train_dataset=_data())
    trainer.losses = []
    trainer.train()
    logged = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    return trainer.losses, logged, {k: v.clone() for k, v in model.state_dict().items()}


@pytest.mark.slow
def test_trainer_with_a_native_plan_logs_plain_trainers_losses(tmp_path):
    plain = gpt2_default().model
    plain.config.use_cache = False
    losses, logged, weights = _train(plain, str(tmp_path / "plain"))

    model = gpt2_default().model  # the same initial weights (seed 0)
    model.config.use_cache = False  # the Trainer calls the model without a cache
    batch = transformers.default_data_collator(_data()[:BATCH])  # as the Trainer batches
    problem = core.analyze(model, (), batch, loss_fn=lambda out: out.loss)
    plan = core.solve(problem, 1.0, method="checkpoint_blocks")
    core.apply_plan(model, plan, loss_fn=lambda out: out.loss, runtime="native")  # in place
    handle = native_handle(model)
    assert handle is not None and handle.lowering.recomputed_ops > 0
    got, got_logged, got_weights = _train(model, str(tmp_path / "native"))

    assert len(losses) == len(got) == STEPS
    for step, (want, have) in enumerate(zip(losses, got, strict=True)):
        assert torch.equal(want, have), step
    assert got_logged == logged and len(logged) == STEPS
    for k, v in weights.items():
        assert torch.equal(got_weights[k], v), k
