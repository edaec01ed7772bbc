"""`analyze`: trace -> costs -> blocks, and the Problem every solver takes."""

from __future__ import annotations

import functools
import weakref
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, field, replace
from functools import cached_property
from typing import Any, Concatenate, ParamSpec, TypeVar

import torch
from torch import nn

from core import costs as cost_models
from core.allocator import Allocator, round_values
from core.allocator import for_device_type as allocator_for
from core.blocks import Block, constant_ops, find_blocks
from core.errors import CostsDiffer, RematError, UnsupportedModel, fmt_bytes
from core.graph import Graph, build_graph
from core.graph_meta import CostRecord, GraphMeta
from core.optimizer_step import OptimizerStep
from core.simulator import Link, simulate, store_all_program
from core.trace import (
    Autocast,
    CallSpec,
    capture,
    fake_call,
    fingerprint,
    graph_meta,
    model_libraries,
    op_sequence,
    split_call,
)
from core.trace.attention import Choice
from core.trace.attention import describe as describe_attention
from core.trace.call import small_int_values
from core.trace.device import CPU, DeviceDispatch, DeviceModel
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
    graph_meta: GraphMeta  # what a plan records: to trace again, compare, and figure it
    store_all_peak: int  # bytes: peak of one plain forward+backward beyond params and inputs
    store_all_time: float  # seconds: every op once
    name: str = "model"
    model_ref: weakref.ref | None = field(default=None, repr=False)  # the model analysed
    loss_fn: Callable[..., torch.Tensor] | None = field(default=None, repr=False)
    # the optimizer run inside the step (analyze's optimizer=), or None: the user steps it
    optimizer_step: OptimizerStep | None = field(default=None, repr=False)
    # the device the step was traced for (analyze's device=), and the attention kernels it
    # assumed there (core.trace.attention), one per scaled_dot_product_attention call
    device_model: DeviceModel = CPU
    attention_kernels: tuple[Choice, ...] = ()

    @property
    def attention(self) -> str:
        """Which attention kernels the trace holds, in words: 'attention: flash attention
        (assumed for h100, bfloat16, head dim 128) in 32 calls'; empty without attention
        calls, or where torch picked them on the device itself."""
        said = describe_attention(list(self.attention_kernels), self.device_model.name)
        return f"attention: {said}" if said else ""

    @property
    def allocator(self) -> Allocator:
        """The device's allocator, whose rounding every byte figure includes (core.allocator)."""
        return allocator_for(self.device_model.type)

    def live_model(self, needed_for: str) -> nn.Module | None:
        """The model analysed, for what runs it again (`needed_for`, in words); None for a
        problem made without one. A RematError when it has been garbage collected: planning
        on without it would silently plan as if it had no modules."""
        if self.model_ref is None:
            return None
        model = self.model_ref()
        if model is None:
            raise RematError(
                f"the model analysed as {self.name!r} is gone (nothing refers to it any more), "
                f"and {needed_for} runs it: keep a reference to the model while planning "
                "(model = MyModel(); problem = core.analyze(model, ...))"
            )
        return model

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
        return self.graph_meta.loss_head

    @property
    def link(self) -> Link:
        """The host link offloads and prefetches are timed with (`core.costs.host_link`,
        recorded with the costs)."""
        costs = self.graph_meta.costs
        return costs.link if costs is not None else cost_models.host_link(self.cost_model)

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
    costs: str | CostRecord = "estimated",
    device: str | None = None,
    attention: str = "auto",
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
    median); or the `CostRecord` a plan recorded (`core.bind`: the plan's own times).
    device: the preset the step is planned for ("cpu", "a100", "h100", "v100", "rtx4090";
    `core.costs.DEVICES`); None: the model's own device. The trace is the step that device
    runs, from a model on the CPU or the meta device: attention as the kernel torch picks
    there (flash, memory-efficient, cuDNN or math: core.trace.attention), dropout as its
    kernel, and on a GPU each storage rounded as the CUDA caching allocator rounds it
    (core.allocator).
    attention: the kernel assumed first where CPU cannot know torch's pick ("flash",
    "efficient", "cudnn", "math"; "auto": torch's own order). `problem.attention` says which
    kernels were assumed.
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
    dev = _device_model(model, device, attention)
    # tensors on the device's own type dispatch as torch does there: nothing to emulate
    held = next((p.device.type for p in model.parameters()), "cpu")
    dispatch = DeviceDispatch(dev) if held != dev.type else None
    trace, graph, head = _traced(model, step, state, loss_head, opt, dispatch)
    round_values(graph, allocator_for(dev.type))
    report("costs", 0.3)
    if isinstance(costs, CostRecord):
        if len(costs.times) != len(graph.ops):
            raise CostsDiffer(len(costs.times), len(graph.ops), trace)
        for op, t in zip(graph.ops, costs.times, strict=True):
            op.time = t
        cost_name = costs.model
    elif costs == "measured":
        on = _device_name(model)
        if dispatch is not None:
            raise ValueError(
                f"costs='measured' times the ops on the model's device ({on}), but this step "
                f"is traced for {dev.describe()}, whose kernels do not run there: use "
                "costs='estimated', or analyse the model on that device"
            )
        cost_models.assign_times(
            graph,
            "measured",
            device=on,
            progress=lambda d, n: report("timing ops", 0.3 + 0.6 * d / max(n, 1)),
        )
        cost_name = "measured:" + on
    elif costs == "estimated":
        cost_models.assign_times(graph, "estimated", device=dev.name)
        cost_name = "estimated:" + dev.name
    else:
        raise ValueError(f"unknown cost model {costs!r}: use 'estimated' or 'measured'")
    report("blocks", 0.9)
    blocks, block_of_op = find_blocks(graph)
    store_all = simulate(graph, block_of_op, *store_all_program(graph))
    report("done", 1.0)
    link = costs.link if isinstance(costs, CostRecord) else cost_models.host_link(cost_name)
    meta = replace(
        GraphMeta.from_data(graph_meta(trace)),
        loss_head=head,
        optimizer=opt.to_data() if opt is not None else None,
        costs=CostRecord(cost_name, tuple(op.time for op in graph.ops), link),
        device=dev,
        values=tuple(
            (i, tuple(v))
            for i, v in small_int_values(split_call(args, kwargs or {}, targets)[0]).items()
        ),
        torch_version=str(torch.__version__),
        ops=op_sequence(trace),
        libraries=model_libraries(model),
    )
    return Problem(
        graph,
        blocks,
        block_of_op,
        cost_name,
        fingerprint(trace, any_device=dev.type == "cuda"),
        meta,
        store_all.peak,
        sum(op.time for op in graph.ops),
        name,
        weakref.ref(model),
        loss_fn,
        opt,
        device_model=dev,
        attention_kernels=tuple(dispatch.choices) if dispatch is not None else (),
    )


def trace_recorded(
    model: nn.Module,
    inputs: Sequence[tuple[Sequence[int], str | torch.dtype, bool]],
    call: CallSpec | None,
    loss_fn: Callable[..., torch.Tensor] | None = None,
    tensors_on: torch.device | None = None,
    values: Sequence[tuple[int, Sequence[int]]] = (),
    **options: Any,
) -> Problem:
    """The one route from a recorded step to a traced problem: `model` called as `call`
    records on fake inputs shaped as `inputs` records (shape, dtype, requires grad), on
    `tensors_on` (the parameters' device by default), nothing allocated however large the shapes, then
    `analyze(..., **options)`. A plan bound to a model (`core.bind`), a step planned at
    another shape (`core.shapes`) and a batch tried by `remat fit` are all traced here.
    `call` None: the inputs are the model's positional arguments (plans from before keyword
    inputs). `loss_fn` is used when the call records a loss."""
    on = tensors_on or next((p.device for p in model.parameters()), torch.device("cpu"))
    spec = _positional(len(inputs)) if call is None else call
    args, kwargs, targets = fake_call(inputs, spec, on, values=dict(values))
    uses_loss = call is not None and call.loss
    return analyze(model, args, kwargs, loss_fn if uses_loss else None, targets, **options)


def _positional(n: int) -> CallSpec:
    """The call `model(*inputs)` of `n` tensors."""
    return split_call([torch.empty(0)] * n, {})[1]


def _traced(
    model: nn.Module,
    step: tuple,
    state: Autocast,
    loss_head: str | LossHead,
    opt: OptimizerStep | None = None,
    dispatch: DeviceDispatch | None = None,
) -> tuple[Trace, Graph, LossHead]:
    """The step traced with its loss head as `loss_head` asks: (trace, graph, the head used).
    `step` is (args, kwargs, loss_fn, targets); `dispatch` runs it as on its device model."""
    if isinstance(loss_head, str):
        if loss_head not in ("plain", "chunked", "auto"):
            raise ValueError(f"unknown loss_head {loss_head!r}: use 'plain', 'chunked' or 'auto'")
        head = LossHead("chunked") if loss_head != "plain" else PLAIN
    else:
        head = loss_head
    args, kwargs, loss_fn, targets = step
    mode = LossHeadMode(head)
    trace = capture(model, args, kwargs, loss_fn, targets, state, mode, opt, dispatch)
    graph = build_graph(trace)
    if head.kind == "plain":
        return trace, graph, head
    chunked = bool(mode.found) and not _full_logits_survive(graph, mode)
    if chunked and loss_head != "auto":
        return trace, graph, head
    if loss_head == "auto":
        if not mode.found:  # nothing substituted: this trace is the plain one
            return trace, graph, PLAIN
        plain = capture(model, args, kwargs, loss_fn, targets, state, None, opt, dispatch)
        plain_graph = build_graph(plain)
        if chunked and floor_of(graph).nbytes < floor_of(plain_graph).nbytes:
            return trace, graph, head
        return plain, plain_graph, PLAIN
    why = list(dict.fromkeys(mode.refused))  # a head was found and left plain: say why
    if mode.found:
        why.append(
            "the logits are used beyond the loss (returned, or read by another op), so "
            "chunking would only add work: return only the loss"
        )
    if why:
        raise UnsupportedModel(
            "loss_head='chunked' on this step",
            "",
            "; ".join(why) + "; use loss_head='auto' (chunked only where it applies) or 'plain'",
        )
    raise UnsupportedModel(
        "loss_head='chunked' on a step with no LM-head loss to chunk",
        "",
        "the chunked head needs a linear (F.linear, nn.Linear) whose output, or a view of it "
        "keeping the last dim, feeds only F.cross_entropy (or F.linear_cross_entropy) over "
        "that dim: 2-d logits, class-index targets, mean or sum, no class weights or label "
        "smoothing, in float32 or from a bfloat16 head to a float32 loss, more rows than one "
        "chunk; return only the loss (a loss_fn keeping the logits out of the output), or use "
        "loss_head='auto' or 'plain'",
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


def _device_model(model: nn.Module, device: str | None, attention: str) -> DeviceModel:
    """The device model a step of `model` is traced for: the preset `device`, or (None) the
    model's own device (the meta device: CPU). A model on a GPU is traced by torch's own
    dispatch there, so it plans for its own GPU only."""
    on = next((p.device for p in model.parameters()), torch.device("cpu"))
    if device is None:
        return cost_models.detected_model(on, attention)
    dev = cost_models.device_model(device, attention)
    if on.type == "cuda" and dev.capability != cost_models.detected_model(on).capability:
        raise UnsupportedModel(
            f"a model on {on} planned for device={device!r}",
            "",
            "a step is traced for another device from the CPU or the meta device: move the "
            "model there (model.to('meta') keeps nothing allocated), or leave device= out",
        )
    return dev


def _device_name(model: nn.Module) -> str:
    p = next(iter(model.parameters()), None)
    return str(p.device) if p is not None else "cpu"
