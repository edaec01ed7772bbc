"""The planned module composes with DistributedDataParallel (2 processes, gloo, CPU)."""

import os

import pytest
import torch
import torch.multiprocessing as mp
from helpers import gloo_worker, rendezvous
from torch.nn.parallel import DistributedDataParallel as DDP

import core
from sample_models import build


@gloo_worker
def _worker(rank: int, world: int, out_dir: str) -> None:
    plain, inputs = build("gpt-tiny")
    planned, _ = build("gpt-tiny")
    inputs = tuple(t.roll(rank, 0) for t in inputs)  # each rank its own batch
    plan = core.solve(core.analyze(planned, inputs), 0.6, method="checkpoint_blocks")
    ddp_plain = DDP(plain)
    ddp_planned = DDP(core.apply_plan(planned, plan))
    for step in range(2):
        torch.manual_seed(100 + rank + step)
        ddp_plain(*inputs).backward()
        torch.manual_seed(100 + rank + step)
        ddp_planned(*inputs).backward()
    grads = {n: p.grad for n, p in plain.named_parameters()}
    for n, p in planned.named_parameters():
        torch.testing.assert_close(p.grad, grads[n], msg=n)
    open(os.path.join(out_dir, f"ok{rank}"), "w").close()


@pytest.mark.slow
def test_ddp_gradients_equal_plain_ddp(tmp_path):
    mp.spawn(_worker, args=(2, rendezvous(), str(tmp_path)), nprocs=2, join=True)
    assert (tmp_path / "ok0").exists() and (tmp_path / "ok1").exists()
