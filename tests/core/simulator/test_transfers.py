"""The runtime's waits around host transfers (core/runtime/transfers.py), checked on CPU.

CUDA's lane runs copies on a side stream; whether compute waited for them where it must is
what decides a race there. `DeferredLane` plays the most adversarial schedule a stream allows:
a copy runs only when compute waits for it or for a later copy, the bytes a copy back will
write read as NaN until then, and a device storage freed before its copy ran is an error. A
plan that runs exactly under it has every wait CUDA needs; the last tests show it catches a
missing one.
"""

from __future__ import annotations

import weakref

import pytest
import torch
from helpers import (
    SEED_BYTES,
    assert_same_grads,
    check_runs_as_predicted,
    forced,
    measured_step,
)
from torch.utils._python_dispatch import _disable_current_modes

import core
from core.memory import copy_bytes, storage_bytes
from core.runtime.transfers import HostLane, HostStep, HostWork
from core.schedule import store_all_plan
from core.simulator import OFFLOAD


class DeferredLane(HostLane):
    """Copies queued in issue order (one stream) and run only when waited for; `skip` plays a
    runtime that forgets the waits for copies out ("out") or back ("back")."""

    def __init__(self, skip: str = "") -> None:
        super().__init__()
        self.queue: list[tuple[weakref.ref, torch.Tensor, bool]] = []
        self.ran = 0  # copies run so far
        self.pools = 0  # pools allocated
        self.skip = skip
        self.held: list[torch.Tensor] = []

    def new_pool(self, nbytes: int) -> torch.Tensor:
        self.pools += 1
        return super().new_pool(nbytes)

    def copy(self, host: torch.Tensor, device: torch.Tensor, to_host: bool) -> int:
        if not to_host:
            with _disable_current_modes():
                device.fill_(255)  # NaN in every float dtype until the copy runs
        self.queue.append((weakref.ref(device.untyped_storage()), host, to_host))
        if self.skip == "back" and not to_host:  # as record_stream does on CUDA: the memory
            self.held.append(device)  # stays the copy's; what compute read early was garbage
        return len(self.queue)

    def wait(self, token: int) -> None:
        if self.skip != ("out" if self.queue[token - 1][2] else "back"):
            self._run_until(token)

    def drain(self) -> None:
        self._run_until(len(self.queue))

    def _run_until(self, token: int) -> None:
        while self.ran < token:
            ref, host, to_host = self.queue[self.ran]
            storage = ref()
            if storage is None:
                raise AssertionError("a device storage was freed before its copy ran")
            device = storage_bytes(storage)
            copy_bytes(*((host, device) if to_host else (device, host)))
            self.ran += 1


def deferred(run: core.PlannedModule, lane: DeferredLane) -> core.PlannedModule:
    run._lanes[torch.device("cpu")] = lane
    return run


@pytest.mark.parametrize(
    "name, base, count",
    [
        ("gpt-tiny", "store_all", 3),
        ("resnet-tiny", "checkpoint_blocks", 2),
        ("mlp-tiny", "store_all", 2),
    ],
)
def test_plans_run_exactly_when_copies_run_as_late_as_a_stream_allows(name, base, count):
    lane = DeferredLane()
    check_runs_as_predicted(name, base, count, lane)
    assert lane.ran == len(lane.queue) == 2 * count


@pytest.fixture(scope="module")
def gpt(analysed):
    model, inputs, problem = analysed("gpt-tiny")
    return model, inputs, forced(problem, store_all_plan(problem), 3)


def test_a_solved_offload_plan_runs_exactly_under_deferred_copies(gpt, analysed):
    model, inputs, _ = gpt
    problem = analysed("gpt-tiny")[2]
    plan = core.solve(problem, 0.4, "offload")
    assert plan.predicted_host_bytes > 0
    _, _, eager_grads = measured_step(model, inputs, seed=4)
    run = deferred(core.apply_plan(model, plan), DeferredLane())
    peak, _, grads = measured_step(model, inputs, seed=4, run=run)
    assert_same_grads(grads, eager_grads)
    assert peak == plan.predicted_peak + SEED_BYTES


def test_a_missing_wait_for_a_copy_back_reads_garbage(gpt):
    model, inputs, plan = gpt
    _, _, eager_grads = measured_step(model, inputs, seed=3)
    run = deferred(core.apply_plan(model, plan), DeferredLane(skip="back"))
    _, _, grads = measured_step(model, inputs, seed=3, run=run)
    with pytest.raises(AssertionError):
        assert_same_grads(grads, eager_grads)


def test_a_missing_wait_for_a_copy_out_frees_its_source_too_early(gpt):
    model, inputs, plan = gpt
    run = deferred(core.apply_plan(model, plan), DeferredLane(skip="out"))
    with pytest.raises(AssertionError, match="freed before its copy ran"):
        measured_step(model, inputs, seed=3, run=run)


def test_steps_alive_at_once_take_their_own_pools_and_later_steps_reuse_them(gpt):
    """Two forwards, then both backwards (two graphs alive): each step parks in its own pool;
    the gradients are eager's; a third step takes a pool from the free list."""
    model, inputs, plan = gpt
    other = tuple(
        torch.randint_like(x, 0, 50) if not x.is_floating_point() else x.flip(0) for x in inputs
    )

    def two_steps(step):
        model.zero_grad(set_to_none=True)
        torch.manual_seed(5)
        first, second = step(*inputs), step(*other)
        second.backward()
        first.backward()
        return {n: p.grad.clone() for n, p in model.named_parameters()}

    want = two_steps(model)
    lane = DeferredLane()
    run = deferred(core.apply_plan(model, plan), lane)
    assert_same_grads(two_steps(run), want)
    assert lane.pools == 2
    measured_step(model, inputs, seed=3, run=run)
    assert lane.pools == 2


def test_a_retained_graph_backs_up_its_host_copies_after_the_copies_ran():
    """retain_graph=True copies the step's host memory for the next backward: a copy out
    still in flight must land in that backup too."""
    x = torch.arange(8, dtype=torch.float32)
    step = HostStep(DeferredLane(), 32)
    env = {7: x}
    step.work(HostWork(transfer=OFFLOAD, value=1, nodes=(7,), slot=0), env)
    assert 7 not in env  # it left with its copy; the copy has not run yet
    backup = step.copy()
    assert torch.equal(backup.pool.view(torch.float32), x)
