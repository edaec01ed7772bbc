"""`analyze`: trace -> costs -> blocks, and the Problem every solver takes."""

from __future__ import annotations

import functools
import weakref
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any, Concatenate, ParamSpec, TypeVar

import torch
from torch import nn

from core import costs as cost_models
from core.blocks import Block, constant_ops, find_blocks
from core.errors import UnsupportedModel, fmt_bytes
from core.graph import Graph, build_graph
from core.optimizer_step import OptimizerStep
from core.simulator import Link, simulate, store_all_program
from core.trace import Autocast, capture, fingerprint, graph_meta
from core.trace.loss_head import PLAIN, LossHead, LossHeadMode
from core.trace.nodes import Trace

Progress = Callable[[str, float], None]  # (stage description, fraction done)
T = TypeVar("T")
P = ParamSpec("P")


@dataclass(frozen=True)
class Floor:
    """The most device memory one op needs at once: its inputs and outputs (parameters, state
    and step inputs aside, as in every peak). No plan, recomputing or offloading, goes below."""

    nbytes: int
    op: str  # its name in the graph, e.g. "_log_softmax_backward_data"
    label: str  # e.g. "aten._log_softmax_backward_data"
    tensors: tuple[int, ...]  # the bytes of each tensor it holds, largest first

    def describe(self) -> str:
        sizes = ", ".join(fmt_bytes(n) for n in self.tensors[:4])
        more = f" and {len(self.tensors) - 4} more" if len(self.tensors) > 4 else ""
        return f"{self.op} ({self.label}) holds {fmt_bytes(self.nbytes)} at once: {sizes}{more}"


@dataclass(eq=False)  # compared (and hashed) by identity: solvers memoise per problem
class Problem:
    """A traced training step with op costs, its chain of blocks and its store-all figures."""

    graph: Graph
    blocks: list[Block]
    block_of_op: list[int]
    cost_model: str  # "estimated:<device>" or "measured:<device>"
    fingerprint: str
    graph_meta: dict[str, Any]  # what a plan file records to say what differs on a mismatch
    store_all_peak: int  # bytes: peak of one plain forward+backward beyond params and inputs
    store_all_time: float  # seconds: every op once
    name: str = "model"
    model_ref: weakref.ref | None = field(default=None, repr=False)  # the model analysed
    loss_fn: Callable[..., torch.Tensor] | None = field(default=None, repr=False)
    # the optimizer run inside the step (analyze's optimizer=), or None: the user steps it
    optimizer_step: OptimizerStep | None = field(default=None, repr=False)

    @cached_property
    def constant_ops(self) -> tuple[int, ...]:
        """Step constants (masks, position ids, rotary tables): in no block, run first."""
        return constant_ops(self.graph)

    @cached_property
    def floor(self) -> Floor:
        """The op whose inputs and outputs need the most device bytes at once: a lower bound
        on every plan's peak (on a GPT with a large vocabulary, the loss's softmax backward,
        unless the problem was analysed with a chunked loss head)."""
        return floor_of(self.graph)

    @property
    def loss_head(self) -> LossHead:
        """How the step computes its LM-head loss: plain, or chunked (docs/floor.md)."""
        return LossHead.from_data(self.graph_meta.get("loss_head"))

    @property
    def link(self) -> Link:
        """The host link offloads and prefetches are timed with (`core.costs.host_link`)."""
        return cost_models.host_link(self.cost_model)

    @property
    def param_bytes(self) -> int:
        return sum(v.nbytes for v in self.graph.values if v.kind in ("param", "state"))

    @property
    def input_bytes(self) -> int:
        return sum(v.nbytes for v in self.graph.values if v.kind == "input")


def floor_of(graph: Graph) -> Floor:
    """`Problem.floor` of a graph."""
    values = graph.values

    def held(op) -> list[int]:
        kept = {v for v in (*op.inputs, *op.outputs) if not values[v].is_placeholder}
        return sorted((values[v].nbytes for v in kept), reverse=True)

    op = max(graph.ops, key=lambda o: (sum(held(o)), -o.index))
    return Floor(sum(held(op)), op.name, op.label, tuple(held(op)))


def per_problem(fn: Callable[Concatenate[Problem, P], T]) -> Callable[Concatenate[Problem, P], T]:
    """Memoise `fn(problem, ...)` per problem (by identity) and per other arguments; the
    memo goes with the problem. Solvers keep their tables this way, typed by `fn`, instead
    of in a bag on the problem."""
    memo: weakref.WeakKeyDictionary[Problem, dict[Hashable, T]] = weakref.WeakKeyDictionary()

    @functools.wraps(fn)
    def memoised(problem: Problem, *args: P.args, **kwargs: P.kwargs) -> T:
        table = memo.setdefault(problem, {})
        key = (args, tuple(sorted(kwargs.items())))
        if key not in table:
            table[key] = fn(problem, *args, **kwargs)
        return table[key]

    return memoised


def analyze(
    model: nn.Module,
    args: Sequence[Any],
    kwargs: dict[str, Any] | None = None,
    loss_fn: Callable[..., torch.Tensor] | None = None,
    targets: Sequence[torch.Tensor] = (),
    *,
    costs: str = "estimated",
    device: str = "cpu",
    name: str = "model",
    progress: Progress | None = None,
    autocast: Autocast | torch.autocast | None = None,
    loss_head: str | LossHead = "plain",
    optimizer: torch.optim.Optimizer | None = None,
) -> Problem:
    """Trace one training step of `model`, time its ops and find its chain of blocks.

    The step is `output = model(*args, **kwargs)`, then `loss = loss_fn(output, *targets)`
    when `loss_fn` is given (a scalar; the planned module then returns it, see apply_plan),
    so the budget covers the loss too (a model computing its own loss, such as Hugging Face's
    given `labels=`: `loss_fn=lambda out: out.loss`). Without `loss_fn`, every differentiable
    output gets a gradient: backpropagating only some makes autograd pass zeros for the
    others, memory the plan does not count.
    Non-tensor arguments (flags, None) are bound as given.
    costs: "estimated" (FLOPs and bytes against the `device` preset, no compute) or
    "measured" (each distinct op timed on real tensors on the model's device, 1 thread,
    median).
    autocast: the mixed-precision state the step runs under, recorded with the plan: None
    reads the caller's (`with torch.autocast("cuda", torch.bfloat16): core.analyze(...)`), or
    pass `torch.autocast(...)` itself. The planned module refuses calls under another state.
    loss_head: "plain" (the step as written), "chunked" (an LM head's linear + cross-entropy
    over chunks of rows, below the floor: docs/floor.md; `LossHead("chunked", rows)` sets the
    rows per chunk) or "auto" (chunked where that lowers the floor).
    optimizer: a torch.optim SGD, Adam or AdamW to run inside the step: each parameter is
    updated as soon as its gradient is complete and the gradient freed; the planned module
    then updates the parameters itself (call no optimizer.step(); .grad stays None).
    """
    report = progress or (lambda stage, frac: None)
    report("tracing", 0.0)
    if loss_fn is not None and kwargs and "targets" in kwargs:
        raise UnsupportedModel(
            "a keyword input named 'targets' with a loss_fn",
            "",
            "the planned module takes loss_fn's targets as `targets=`: rename the model's "
            "argument, or compute the loss inside the model",
        )
    state = autocast if isinstance(autocast, Autocast) else Autocast.of(autocast)
    opt = None
    if optimizer is not None:
        opt = OptimizerStep(optimizer, [p for p in model.parameters() if p.requires_grad])
    step = (args, kwargs, loss_fn, targets)
    trace, graph, head = _traced(model, step, state, loss_head, opt)
    report("costs", 0.3)
    if costs == "measured":
        on = _device_name(model)
        cost_models.assign_times(
            graph,
            "measured",
            device=on,
            progress=lambda d, n: report("timing ops", 0.3 + 0.6 * d / max(n, 1)),
        )
        cost_name = "measured:" + on
    elif costs == "estimated":
        cost_models.assign_times(graph, "estimated", device=device)
        cost_name = "estimated:" + device
    else:
        raise ValueError(f"unknown cost model {costs!r}: use 'estimated' or 'measured'")
    report("blocks", 0.9)
    blocks, block_of_op = find_blocks(graph)
    store_all = simulate(graph, block_of_op, *store_all_program(graph))
    report("done", 1.0)
    meta = graph_meta(trace)
    if head.to_data() is not None:
        meta["loss_head"] = head.to_data()
    if opt is not None:
        meta["optimizer"] = opt.to_data()
    return Problem(
        graph,
        blocks,
        block_of_op,
        cost_name,
        fingerprint(trace),
        meta,
        store_all.peak,
        sum(op.time for op in graph.ops),
        name,
        weakref.ref(model),
        loss_fn,
        opt,
    )


def _traced(
    model: nn.Module,
    step: tuple,
    state: Autocast,
    loss_head: str | LossHead,
    opt: OptimizerStep | None = None,
) -> tuple[Trace, Graph, LossHead]:
    """The step traced with its loss head as `loss_head` asks: (trace, graph, the head used).
    `step` is (args, kwargs, loss_fn, targets)."""
    if isinstance(loss_head, str):
        if loss_head not in ("plain", "chunked", "auto"):
            raise ValueError(f"unknown loss_head {loss_head!r}: use 'plain', 'chunked' or 'auto'")
        head = LossHead("chunked") if loss_head != "plain" else PLAIN
    else:
        head = loss_head
    args, kwargs, loss_fn, targets = step
    mode = LossHeadMode(head)
    trace = capture(model, args, kwargs, loss_fn, targets, state, mode, opt)
    graph = build_graph(trace)
    if head.kind == "plain":
        return trace, graph, head
    chunked = bool(mode.found) and not _full_logits_survive(graph, mode)
    if chunked and loss_head != "auto":
        return trace, graph, head
    if loss_head == "auto":
        if not mode.found:  # nothing substituted: this trace is the plain one
            return trace, graph, PLAIN
        plain = capture(model, args, kwargs, loss_fn, targets, state, None, opt)
        plain_graph = build_graph(plain)
        if chunked and floor_of(graph).nbytes < floor_of(plain_graph).nbytes:
            return trace, graph, head
        return plain, plain_graph, PLAIN
    raise UnsupportedModel(
        "loss_head='chunked' on a step with no LM-head loss to chunk",
        "",
        "the chunked head needs a linear (F.linear, nn.Linear) whose output, or a view of it "
        "keeping the last dim, feeds only F.cross_entropy (or F.linear_cross_entropy) over "
        "that dim: 2-d logits, class-index targets, mean or sum, no class weights or label "
        "smoothing, no autocast, more rows than one chunk; return only the loss (a loss_fn "
        "keeping the logits out of the output), or use loss_head='auto' or 'plain'",
    )


def _full_logits_survive(graph: Graph, mode: LossHeadMode) -> bool:
    """Whether a chunked head's full logits are still computed: the logits are used beyond
    the loss (returned, or read by another op), so chunking would only add work."""
    full = {(h.rows, h.classes) for h in mode.found}
    nodes = graph.trace.nodes
    for op in graph.ops:
        for n in op.nodes:
            node = nodes[n]
            if node.label in ("aten.mm", "aten.addmm") and node.specs:
                shape = node.specs[0].shape
                if len(shape) == 2 and (shape[0], shape[1]) in full:
                    return True
    return False


def _device_name(model: nn.Module) -> str:
    p = next(iter(model.parameters()), None)
    return str(p.device) if p is not None else "cpu"
