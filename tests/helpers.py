"""Shared test helpers: eager reference steps and plan steps measured the same way, plans
with offloads forced in, and the app served in a thread for the browser and load tests."""

from __future__ import annotations

import logging
import threading

import torch
from torch import nn

import core
from core.memory import StorageTracker, step_tensors
from core.schedule import Plan, store_all_plan
from core.simulator import DagOp
from core.solvers.offload import MIN_BYTES, with_transfer
from core.validate import check_program
from sample_models import build

# bytes a measured step holds beyond the plan's prediction: the float32 scalar seed that
# loss.backward() allocates (torch.ones_like(loss)), which the traced step receives as input
SEED_BYTES = 4

# A toy step for the simulator's tests, x -> a -> b -> loss; backward: db reads b, da reads a
# and db. Values: 0 x (placeholder), 1 a, 2 b, 3 loss, 4 db, 5 da.
TOY_OPS = [
    DagOp((0,), (1,), 1.0, False),  # a = f(x)
    DagOp((1,), (2,), 2.0, False),  # b = g(a)
    DagOp((2,), (3,), 1.0, False),  # loss = h(b)
    DagOp((2,), (4,), 1.0, True),  # db
    DagOp((1, 4), (5,), 1.0, True),  # da (final)
]
TOY_SIZES = {1: 10, 2: 100, 3: 1, 4: 100, 5: 10}
TOY_FINAL = frozenset({3, 5})


def fresh(name: str) -> tuple[nn.Module, tuple[torch.Tensor, ...]]:
    return build(name)


def measured_step(
    model: nn.Module, inputs: tuple, seed: int = 1, run: nn.Module | None = None
) -> tuple[int, float, dict[str, torch.Tensor]]:
    """One training step of `run` (default: the model) from zero grads under a storage tracker:
    (peak bytes, loss, grads of the model's parameters)."""
    model.zero_grad(set_to_none=True)
    torch.manual_seed(seed)
    with StorageTracker(step_tensors(model, inputs)) as tracker:
        loss = (run or model)(*inputs)
        loss.backward()
    loss = loss.detach()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return tracker.peak, loss.item(), grads


def assert_same_grads(got: dict, want: dict) -> float:
    """assert_close on every gradient (default tolerances); returns the max abs difference."""
    assert got.keys() == want.keys()
    worst = 0.0
    for name in want:
        torch.testing.assert_close(got[name], want[name], msg=lambda m, n=name: f"{n}: {m}")
        worst = max(worst, (got[name] - want[name]).abs().max().item())
    return worst


def serve_in_thread(app) -> tuple[str, object]:
    """Serve a Dash app on 127.0.0.1, a free port, in a daemon thread: (url, server)."""
    from werkzeug.serving import make_server

    logging.getLogger("werkzeug").setLevel(logging.ERROR)
    server = make_server("127.0.0.1", 0, app.server, threaded=True)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return f"http://127.0.0.1:{server.server_port}/", server


def forced(problem, plan: Plan, count: int) -> Plan:
    """`plan` with its `count` largest kept activations offloaded, whatever the peak does."""
    graph = problem.graph
    program, start = list(plan.program), plan.backward_start
    kept = plan.simulate().live_after(start - 1)
    chosen = sorted(
        (
            v
            for v in kept
            if graph.values[v].kind == "activation" and graph.values[v].nbytes >= MIN_BYTES
        ),
        key=lambda v: (-graph.values[v].nbytes, v),
    )
    done = 0
    for v in chosen:
        trial = with_transfer(problem, program, start, v)
        if trial is not None and done < count:
            (program, start), done = trial, done + 1
    assert done == count, f"only {done} activations to offload"
    return Plan(program, start, "forced", 0, problem.fingerprint, problem=problem)


def check_runs_as_predicted(name: str, base: str, count: int, lane=None) -> None:
    """`count` activations of `name`'s `base` plan forced to the host, run exactly
    (`assert_runs_exactly`), under `lane` (a core.transfers.HostLane) when given."""
    model, inputs = fresh(name)
    problem = core.analyze(model, inputs)
    start = store_all_plan(problem) if base == "store_all" else core.solve(problem, 1.0, base)
    plan = forced(problem, start, count)
    sim = check_program(plan, problem)
    assert sim.host_peak > 0 and len(sim.transfers) == 2 * count
    run = assert_runs_exactly(model, inputs, plan, lane)
    assert run._program.host_pool == sim.host_pool == sim.host_peak  # forward in, backward out


def assert_runs_exactly(model: nn.Module, inputs: tuple, plan: Plan, lane=None) -> nn.Module:
    """One step of `plan` against eager's, from the same model state and random seed: the
    same loss and gradients, device peak = predicted + 4 B, host bytes = predicted (the
    simulation's). Under `lane` when given; returns the planned module."""
    state = {k: v.clone() for k, v in model.state_dict().items()}
    _, eager_loss, eager_grads = measured_step(model, inputs, seed=3)
    model.load_state_dict(state)
    run = core.apply_plan(model, plan)
    if lane is not None:
        run._lanes[torch.device("cpu")] = lane
    peak, loss, grads = measured_step(model, inputs, seed=3, run=run)
    assert loss == eager_loss
    assert_same_grads(grads, eager_grads)
    assert peak == plan.predicted_peak + SEED_BYTES
    assert run.host_peak == plan.predicted_host_bytes == plan.simulate().host_peak
    return run
