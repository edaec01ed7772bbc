"""`parallel_plan`: the data-parallel x tensor-parallel layout of N devices that trains fastest
and fits, each rank with its own remat plan.

For every tp dividing N (dp = N / tp): the column -> row pairs of each kind of block are
sharded tp ways where the model's code runs that way (`sharding.rank_problem` traces one
rank's step), the rank's memory and step time are predicted, and its remat plan is solved
for the memory left. The traced batch is one data-parallel rank's micro-batch: a layout with
dp ranks trains dp micro-batches a step, so layouts are ranked by step time / dp (time per
micro-batch, i.e. throughput), then by memory.

Per-device memory (stacked): parameters (tp-sharded; / dp under FSDP), AdamW's two fp32
moments (2x the parameters, same sharding; no fp32 master copy: parameters are assumed fp32),
the inputs, the step's peak under the rank's remat plan (activations and gradients as the
backward makes them: the plan's own prediction on the rank's graph), and data-parallel
buffers: DDP's gradient buckets (1x the gradients, PyTorch's default), or FSDP's gathered
parameters (the root's and two layers' unsharded, less the own shard: forward prefetch).
Step time: the rank plan's predicted time (compute on 1/tp of the features, recomputation
included), an all-reduce of each pair's output in the forward and of its input gradient in
the backward over tp, and over dp a gradient all-reduce (DDP) or two parameter all-gathers
and a gradient reduce-scatter (FSDP), priced by `cost.LinkSpec`, none overlapped.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
from torch import nn

from core.errors import InfeasibleBudget, RematError, fmt_bytes
from core.parallel.cost import LinkSpec, link_for
from core.parallel.sharding import KindPairs, Pair, find_pairs, rank_problem
from core.plan import Plan
from core.problem import Problem
from core.schedule import store_all_plan
from core.solvers import parse_budget, solve
from core.trace.nodes import TensorSpec


class ParallelError(RematError, ValueError):
    """A parallel layout asked for or applied wrongly: the message says what to change."""


OPTIMIZER_STATES = 2  # AdamW: exp_avg and exp_avg_sq, each the size of the parameters


@dataclass(frozen=True)
class Memory:
    """Predicted bytes on one device, by kind."""

    parameters: int
    optimizer: int
    inputs: int
    step: int  # activations and gradients: the rank plan's peak
    data_parallel: int  # DDP's buckets or FSDP's gathered parameters

    @property
    def total(self) -> int:
        return self.parameters + self.optimizer + self.inputs + self.step + self.data_parallel

    def rows(self) -> list[tuple[str, int]]:
        return [
            ("params", self.parameters),
            ("AdamW", self.optimizer),
            ("inputs", self.inputs),
            ("acts+grads", self.step),
            ("dp buffers", self.data_parallel),
        ]


@dataclass(frozen=True)
class StepTime:
    """Predicted seconds of one step on one device, by kind."""

    compute: float  # every op once, on the rank's shapes
    recompute: float  # what the rank's remat plan adds
    tensor_parallel: float  # pairs' all-reduces, forward and backward
    data_parallel: float  # gradient all-reduce, or FSDP's gathers and reduce-scatter

    @property
    def total(self) -> float:
        return self.compute + self.recompute + self.tensor_parallel + self.data_parallel


@dataclass(frozen=True)
class Layout:
    """dp x tp ranks, the pairs sharded tp ways, each rank's remat plan and predictions."""

    dp: int
    tp: int
    data: str  # "none" (dp 1), "ddp" (replicated) or "fsdp" (sharded over dp)
    pairs: tuple[Pair, ...]  # sharded tp ways, every block's
    kinds: tuple[str, ...]  # per kind of block: what is sharded (for people)
    memory: Memory
    time: StepTime
    fits: bool
    units: tuple[str, ...]  # FSDP's units: the modules of the blocks of repeated kinds
    plan: Plan | None = field(default=None, compare=False, repr=False)  # the rank's remat plan
    note: str = ""

    @property
    def name(self) -> str:
        if self.tp == 1:
            return {"ddp": "plain DP", "fsdp": "FSDP", "none": "one device"}[self.data]
        return f"dp{self.dp} x tp{self.tp}" + (" FSDP" if self.data == "fsdp" else "")

    @property
    def per_micro_batch(self) -> float:
        return self.time.total / self.dp


@dataclass(frozen=True)
class ParallelPlan:
    """The chosen layout and every one considered, fitting first, fastest first."""

    best: Layout | None
    layouts: tuple[Layout, ...]
    devices: int
    memory: int
    device: str
    link: LinkSpec
    refused: tuple[str, ...]  # pairs replicated, and why

    def baseline(self, data: str) -> Layout | None:
        """Plain DP ("ddp") or FSDP ("fsdp") over all devices, tp 1."""
        return next((x for x in self.layouts if x.tp == 1 and x.data == data), None)


def parallel_plan(
    problem: Problem,
    devices: int,
    memory: int | str,
    device: str = "h100",
    *,
    model: nn.Module | None = None,
    link: str | None = None,
    method: str = "rockmate",
) -> ParallelPlan:
    """The fastest dp x tp layout of `devices` devices of `memory` bytes each ("80GiB") that
    fits, with its alternatives ranked; `problem` is one rank's micro-batch step (its model,
    or `model`, is re-traced for each tp). `device`: the cost preset and its link (`link`
    overrides it: "nvlink4", "pcie4", ...); `method`: the rank's remat solver."""
    model = model if model is not None else (problem.model_ref() if problem.model_ref else None)
    if model is None:
        raise ParallelError("the problem's model is gone: pass model= (the model analysed)")
    if isinstance(devices, bool) or not isinstance(devices, int) or devices < 1:
        raise ParallelError(f"devices is a whole number of devices, at least 1, not {devices!r}")
    capacity = parse_budget(memory, problem.store_all_peak)
    spec = link_for(device, link)
    kinds = find_pairs(problem, model)
    groups = [[b[i] for b in k.per_block] for k in kinds for i in range(len(k.relative))]
    refused = [r for k in kinds for r in k.refused]
    layouts = []
    for tp in [t for t in range(1, devices + 1) if devices % t == 0]:
        rank, kept, why = rank_problem(problem, model, groups, tp, device)
        refused += why
        if tp > 1 and not kept:
            continue
        pairs = tuple(p for g in kept for p in g)
        dp = devices // tp
        modes = ["none"] if dp == 1 else (["ddp", "fsdp"] if tp == 1 else ["fsdp"])
        for data in modes:
            layouts.append(
                _layout(problem, rank, kinds, pairs, dp, tp, data, capacity, spec, method)
            )
    ranked = sorted(layouts, key=lambda x: (not x.fits, x.per_micro_batch, x.memory.total))
    best = ranked[0] if ranked and ranked[0].fits else None
    return ParallelPlan(best, tuple(ranked), devices, capacity, device, spec, tuple(refused))


def _layout(
    problem: Problem,
    rank: Problem,
    kinds: list[KindPairs],
    pairs: tuple[Pair, ...],
    dp: int,
    tp: int,
    data: str,
    capacity: int,
    link: LinkSpec,
    method: str,
) -> Layout:
    params = _trainable_bytes(rank)
    state = rank.param_bytes - params
    shard = dp if data == "fsdp" else 1
    buffers = params if data == "ddp" else _gathered(rank, dp) if data == "fsdp" else 0
    static = params // shard + state + OPTIMIZER_STATES * params // shard + rank.input_bytes
    plan, note = _rank_plan(rank, capacity - static - buffers, method)
    step = plan.predicted_peak if plan else rank.store_all_peak
    memory = Memory(
        params // shard + state, OPTIMIZER_STATES * params // shard, rank.input_bytes, step, buffers
    )
    sharded = {p.row for p in pairs}
    time = StepTime(
        rank.store_all_time,
        (plan.predicted_time if plan else rank.store_all_time) - rank.store_all_time,
        sum(2 * link.all_reduce(_output_bytes(problem, p.row), tp) for p in pairs),
        _data_parallel_time(link, data, params, dp),
    )
    described = tuple(_describe(k, sharded, tp) for k in kinds)
    units = tuple(_layers(rank))
    fits = plan is not None
    return Layout(dp, tp, data, pairs, described, memory, time, fits, units, plan, note)


def _data_parallel_time(link: LinkSpec, data: str, params: int, dp: int) -> float:
    """DDP: one gradient all-reduce; FSDP: parameters gathered in the forward and again in
    the backward, gradients reduce-scattered (gradients are the parameters' size)."""
    if data == "ddp":
        return link.all_reduce(params, dp)
    if data == "fsdp":
        return 3 * link.all_gather(params, dp)
    return 0.0


def _rank_plan(rank: Problem, budget: int, method: str) -> tuple[Plan | None, str]:
    """The rank's remat plan for `budget` bytes of activations and gradients, or None."""
    if budget <= 0:
        return None, f"parameters and optimizer state alone exceed memory by {fmt_bytes(-budget)}"
    if budget >= rank.store_all_peak:
        return store_all_plan(rank), ""
    try:
        return solve(rank, budget, method), ""
    except InfeasibleBudget as e:
        return None, f"the step needs at least {fmt_bytes(e.minimum)}, {fmt_bytes(budget)} left"


def _trainable_bytes(problem: Problem) -> int:
    return sum(v.nbytes for v in problem.graph.values if v.kind == "param")


def _gathered(rank: Problem, dp: int) -> int:
    """FSDP's unsharded parameters beyond the own shard: the root's (parameters in no layer
    of a repeated kind) and two of the largest layer's (the current one and the prefetched)."""
    names = rank.graph.trace.param_names
    specs = rank.graph.trace.param_specs
    sizes = dict(zip(names, (_spec_bytes(s) for s in specs)))
    layers = _layers(rank)
    per_layer = [sum(n for k, n in sizes.items() if k.startswith(f"{m}.")) for m in layers]
    root = sum(sizes.values()) - sum(per_layer)
    return (root + 2 * max(per_layer, default=0)) * (dp - 1) // dp


def _layers(problem: Problem) -> list[str]:
    """The modules running the blocks of a repeated kind (a transformer's layers)."""
    counts: dict[int, int] = {}
    for b in problem.blocks:
        counts[b.kind] = counts.get(b.kind, 0) + 1
    return [b.name for b in problem.blocks if counts[b.kind] > 1 and b.name != "model"]


def _spec_bytes(spec: TensorSpec) -> int:
    return math.prod(spec.shape) * getattr(torch, spec.dtype).itemsize


def _output_bytes(problem: Problem, module: str) -> int:
    """Bytes of a row layer's output: what its all-reduce moves (from the full model's trace)."""
    graph = problem.graph
    for op in graph.ops:
        if op.phase == "forward" and graph.trace.nodes[op.nodes[0]].module == module:
            return sum(graph.values[v].nbytes for v in op.outputs)
    return 0


def _describe(kind: KindPairs, sharded: set[str], tp: int) -> str:
    first = kind.per_block[0]
    done = [p for p in first if p.row in sharded]
    where = f"{kind.block_name} (x{kind.blocks})"
    if not done:
        return f"{where}: replicated"
    short = [f"{'+'.join(_leaf(c) for c in p.columns)} -> {_leaf(p.row)}" for p in done]
    return f"{where}: {'; '.join(short)} split {tp} ways, the rest replicated"


def _leaf(path: str) -> str:
    return path.rsplit(".", 1)[-1]
