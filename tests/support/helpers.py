"""Shared test helpers: eager reference steps and plan steps measured the same way, plans
with offloads forced in, and the app served in a thread for the browser and load tests."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import gc
import logging
import os
import tempfile
import threading
from collections.abc import Callable, Iterator

import torch
import torch.distributed as dist
from hypothesis import strategies as st
from torch import nn

import core
from core.graph import Graph, Op, Value
from core.graph_meta import GraphMeta
from core.memory import StorageTracker, step_tensors
from core.plan import Plan
from core.problem import Problem
from core.schedule import plan_from_runs, store_all_plan
from core.simulator import DagOp, simulate, store_all_program
from core.solvers.offload import MIN_BYTES, with_transfer
from core.solvers.rotor_table import BlockOption, ChainBlock
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


def rendezvous() -> str:
    """A fresh file for a gloo group's rendezvous (a `FileStore`): no TCP port to race for.
    A port found free and bound later was taken in between by another suite's group on a
    busy machine (EADDRINUSE in a fresh-clone CI run beside two others)."""
    return os.path.join(tempfile.mkdtemp(prefix="remat-gloo-"), "store")


@contextlib.contextmanager
def gloo_group(rank: int, world: int, store: str) -> Iterator[None]:
    """This process as `rank` of a gloo group meeting at the file `store`, 1 thread, torn
    down after."""
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    torch.set_num_threads(1)
    try:
        yield
        dist.barrier()  # no rank tears down while another still has collectives in flight
    finally:
        dist.destroy_process_group()


def zoo_step(case, run=None, seed: int = 3) -> tuple[int, int, torch.Tensor, dict]:  # noqa: ANN001
    """One training step of a zoo case (`sample_models.zoo.ZooCase`) from zero grads under a
    storage tracker, the model itself or `run` (called with `targets=`): (peak, the peak
    before `loss.backward()`, loss, grads)."""
    model = case.model
    model.zero_grad(set_to_none=True)
    torch.manual_seed(seed)
    given = [x for x in (*case.args, *case.kwargs.values(), *case.targets) if torch.is_tensor(x)]
    with StorageTracker(step_tensors(model, given)) as tracker:
        if run is None:
            loss = case.loss_fn(model(*case.args, **case.kwargs), *case.targets)
        else:
            loss = run(*case.args, **case.kwargs, targets=case.targets)
        forward_peak = tracker.peak
        loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return tracker.peak, forward_peak, loss.detach(), grads


def gloo_worker(body: Callable[..., None]) -> Callable[..., None]:
    """An `mp.spawn` target: `worker(rank, world, store, *args)` runs `body(rank, world,
    *args)` as `rank` of a gloo group and collects what `body` made before the group is torn
    down: a sharded model's pending gloo work must not outlive its process group (a rank
    aborted at teardown once, "terminate called without an active exception")."""

    @functools.wraps(body)
    def worker(rank: int, world: int, store: str, *args: object) -> None:
        with gloo_group(rank, world, store):
            body(rank, world, *args)
            gc.collect()

    return worker


class Untraceable(nn.Module):
    """A model whose analysis fails: data-dependent control flow cannot be traced."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        y = self.lin(x)
        if y.sum() > 0:  # data-dependent control flow: cannot be traced
            y = y * 2
        return y.sum()


def untraceable() -> tuple[nn.Module, tuple[torch.Tensor, ...]]:
    return Untraceable(), (torch.randn(2, 4),)


def serve_in_thread(app) -> tuple[str, Callable[[], None]]:
    """Serve a Dash app on 127.0.0.1, a free port, in a daemon thread: (url, stop). `stop()`
    shuts the server down and waits for its background jobs, so the next module's app does
    not share the process with analyses nobody will read."""
    from werkzeug.serving import make_server

    logging.getLogger("werkzeug").setLevel(logging.ERROR)
    server = make_server("127.0.0.1", 0, app.server, threaded=True)
    threading.Thread(target=server.serve_forever, daemon=True).start()

    def stop() -> None:
        server.shutdown()
        app.jobs.stop_all()

    return f"http://127.0.0.1:{server.server_port}/", stop


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
    return Plan(program, start, "forced", 0, problem)


def check_runs_as_predicted(name: str, base: str, count: int, lane=None) -> None:
    """`count` activations of `name`'s `base` plan forced to the host, run exactly
    (`assert_runs_exactly`), under `lane` (a core.runtime.transfers.HostLane) when given."""
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


# ---- random step graphs (tests/core/simulator/test_reorder.py, tests/core/simulator/test_layout.py) ----------------------


@st.composite
def step_graphs(draw, max_forward: int = 6, max_backward: int = 7) -> Problem:
    """A random forward DAG over activations (some ops random, one maybe a state update) and a
    backward DAG reading them, the tangent and each other, ending in parameter gradients."""
    values = [
        Value(0, "w", 4, "param"),
        Value(1, "x", 4, "input"),
        Value(2, "dy", 1, "tangent"),
        Value(3, "stat", 4, "state"),
    ]
    ops: list[Op] = []

    def add_op(phase: str, reads: list[int], kinds: list[str], **flags) -> None:
        outs = []
        for kind in kinds:
            outs.append(len(values))
            values.append(Value(len(values), f"v{len(values)}", draw(st.integers(0, 9)), kind))
        ops.append(
            Op(
                len(ops),
                f"op{len(ops)}",
                "aten.x",
                (),
                tuple(sorted(set(reads))),
                tuple(outs),
                phase,
                **flags,
            )
        )

    n_fwd = draw(st.integers(1, max_forward))
    for i in range(n_fwd):
        pool = [0, 1] + [v.index for v in values if v.kind == "activation"]
        reads = draw(st.lists(st.sampled_from(pool), min_size=1, max_size=3))
        state = i == 0 and draw(st.booleans())
        add_op(
            "forward",
            reads + ([3] if state else []),
            ["activation"] * (1 if i == n_fwd - 1 else draw(st.integers(1, 2))),
            random=not state and draw(st.booleans()),
            state_update=state,
        )
    output = len(values) - 1  # the last forward op's one value is the model output
    n_bwd = draw(st.integers(1, max_backward))
    for _ in range(n_bwd):
        pool = [2] + [v.index for v in values if v.kind in ("activation", "temporary")]
        reads = draw(st.lists(st.sampled_from(pool), min_size=1, max_size=3))
        add_op("backward", reads, [draw(st.sampled_from(["temporary", "gradient"]))])
    values[-1].kind = "gradient"
    for op in ops:
        for v in op.outputs:
            values[v].producer = op.index
        for v in op.inputs:
            values[v].consumers += (op.index,)
    final = {output} | {v.index for v in values if v.kind == "gradient"}
    graph = Graph(None, ops, values, (), (), frozenset(final))
    for op in ops:
        op.time = float(draw(st.integers(1, 3)))
    block_of_op = [0] * len(ops)
    store_all = simulate(graph, block_of_op, *store_all_program(graph))
    total = sum(op.time for op in ops)
    meta = GraphMeta((), (), (), len(ops))  # a graph of no traced step: nothing to record
    return Problem(graph, [], block_of_op, "synthetic", "synthetic", meta, store_all.peak, total)


def runs_keeping(problem: Problem, keep: set[int]) -> tuple[list[int], int]:
    """Forward once keeping `keep`; each backward op recomputes what it reads just before."""
    graph = problem.graph
    ops, values = graph.ops, graph.values
    runs = list(graph.forward_ops)
    available = set(keep) | set(graph.final_values)
    available |= {v.index for v in values if v.producer is None}

    def ensure(v: int) -> None:
        if v in available:
            return
        producer = ops[values[v].producer]
        for u in producer.inputs:
            ensure(u)
        runs.append(producer.index)
        available.update(producer.outputs)

    for o in graph.backward_ops:
        for v in ops[o].inputs:
            ensure(v)
        runs.append(o)
        available.update(ops[o].outputs)
    return runs, len(graph.forward_ops)


def recompute_plan(problem: Problem, keep_bits: list[bool]):
    """A plan that keeps some forward values and recomputes the rest in the backward."""
    acts = [v.index for v in problem.graph.values if v.kind == "activation"]
    keep = {v for v, k in zip(acts, keep_bits) if k}
    runs, n_forward = runs_keeping(problem, keep)
    return plan_from_runs(problem, runs, n_forward, "test", 0)


# ---- abstract chains (tests/core/solvers/test_solver_properties.py, tests/core/solvers/test_pofo.py) -----------------


def draw_blocks(draw, n: int, max_options: int) -> list[ChainBlock]:
    """A random chain of `n` blocks with 1 to `max_options` options each, whose backward
    peaks are at least where they end (tests/core/solvers/test_solver_properties.py, tests/core/solvers/test_pofo.py)."""
    blocks = []
    for j in range(n):
        out = 0 if j == n - 1 else draw(st.integers(1, 4))
        options = []
        for _ in range(draw(st.integers(1, max_options))):
            kept = draw(st.integers(0, 6))
            reads_output = j < n - 1 and draw(st.booleans())
            options.append(
                BlockOption(
                    (),
                    (),
                    forward_time=float(draw(st.integers(1, 5))),
                    forward_peak=out + kept + draw(st.integers(0, 3)),
                    kept=kept,
                    reads_output=reads_output,
                    reads_input=j > 0 and draw(st.booleans()),
                    backward_time=float(draw(st.integers(1, 9))),
                    backward_peak=draw(st.integers(0, 6)),
                    needs_forward=kept > 0 or reads_output or draw(st.booleans()),
                )
            )
        blocks.append(
            ChainBlock(
                output=out,
                grad=0 if j == 0 else draw(st.integers(0, 3)),
                permanent=draw(st.integers(0, 2)),
                forward_runs=(),
                forward_time=min(o.forward_time for o in options),
                forward_peak=min(
                    [out + draw(st.integers(0, 3))] + [o.forward_peak for o in options]
                ),
                options=options,
            )
        )
    for j, blk in enumerate(blocks):  # a backward peaks at least where it ends
        incoming = blocks[j + 1].grad if j + 1 < n else 0
        for i, o in enumerate(blk.options):
            end = blk.grad + blk.permanent - o.kept - incoming
            if o.backward_peak < end:
                blk.options[i] = dataclasses.replace(o, backward_peak=end)
    return blocks


def step_effects(blocks: list[ChainBlock]):
    """`reads(step)` and `makes(step)` of a chain schedule's steps in the brute force's memory
    model: items are block outputs ("A", j) and an option's kept values ("K", j); a transfer
    step (pofo's "offload", "prefetch") reads and makes none."""
    n = len(blocks)

    def reads(step) -> set:
        kind, j = step[0], step[1]
        if kind in ("offload", "prefetch"):
            return set()
        if kind != "B":
            return {("A", j - 1)} if j > 0 else set()
        opt = blocks[j].options[step[2]]
        need = {("K", j)} if opt.needs_forward or j == n - 1 else set()
        need |= {("A", j - 1)} if j > 0 and opt.reads_input else set()
        return need | ({("A", j)} if opt.reads_output else set())

    def makes(step) -> dict:
        kind, j = step[0], step[1]
        if kind not in ("F", "Fe"):
            return {}
        made = {("A", j): blocks[j].output} if j < n - 1 else {}
        return made | ({("K", j): blocks[j].options[step[2]].kept} if kind == "Fe" else {})

    return reads, makes


def until_made(rest: list[tuple], item, makes) -> list[tuple]:
    """The steps of `rest` before `item` is next produced."""
    for k, step in enumerate(rest):
        if item in makes(step):
            return rest[:k]
    return rest


def classic_chain(blocks: list[ChainBlock]) -> list[ChainBlock]:
    """Rotor's own model: every backward reads its block's input."""
    return [
        dataclasses.replace(
            blk, options=[dataclasses.replace(o, reads_input=j > 0) for o in blk.options]
        )
        for j, blk in enumerate(blocks)
    ]
