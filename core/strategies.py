"""The strategies users already run, imported as native programs our simulator walks: what
your current checkpointing costs, predicted before it runs, beside a step that runs it with
the strategy's own code.

Each strategy is a checkpoint policy or a saved-tensor hook, so the native simulation
(`core.native.simulate`) predicts it exactly as it predicts our own native plans:

- `hf_checkpointing`: Hugging Face's `gradient_checkpointing_enable()` (transformers 5:
  `activation_checkpointing_enable`): non-reentrant `torch.utils.checkpoint` around each
  decoder layer's `forward`, nothing saved inside, early stop on.
- `torchtitan_selective`: torchtitan's op-level selective AC (`SelectiveAC`,
  `torchtitan/distributed/activation_checkpoint.py` at b5bcd76): each transformer block
  wrapped by `checkpoint_wrapper(early_stop=False)` with a policy saving the outputs of the
  partitioner's compute-intensive ops (mm, addmm, bmm, baddbmm is not among them,
  convolution, the flash/efficient SDPA kernels, `_scaled_mm`, upsample_bilinear2d),
  `aten.linear`, `aten.max.default`, `topk`, the math/cuDNN/overrideable SDPA kernels and
  flex attention, except every second `aten.mm`/`aten.linear` of the block (the 2nd,
  4th, ... are recomputed), everything else recomputed.
- `torchtune_offload`: torchtune's `OffloadActivations` (`torchtune/training/
  _activation_offloading.py` at bd2a0fc): saved-tensor hooks around the model's forward that
  copy every saved tensor of at least 1,024 bytes that is no `nn.Parameter` or buffer to the
  host, and on unpack copy it back into a fresh device tensor, one per saved tensor, which
  the node's formula drops when it returns; `model.output`, when the model has one, runs
  under a no-op hook (its saved tensors stay). torchtune refuses a machine without an
  accelerator, so on CPU its single-stream rule runs as a replica here, the host copy
  outside the tracker's view (as `torch.autograd.graph.save_on_cpu` would be host memory).
- `autosac`: PyTorch's automatic SAC (`torch.distributed._tools`): `SACEstimator` measures
  each layer's ops, `sac_milp` picks per layer a fraction of activation memory to discard
  under the budget, `get_optimal_checkpointing_policy_per_module` turns each fraction into
  per-op save/recompute decisions, applied with non-reentrant checkpoint and
  `create_selective_checkpoint_contexts` on each layer.

torch.compile's `activation_memory_budget` is decided by the min-cut partitioner inside the
compiled graph: no policy of ours reproduces it, so it is measured, never predicted
(`bench/current.py`).
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch._functorch.partitioners import get_default_op_list
from torch.utils.checkpoint import SAC_IGNORED_OPS, CheckpointPolicy

from core.errors import RematError, fmt_bytes
from core.graph import Phase
from core.memory import host_copy
from core.native.lowering import module_nodes, python_held, refuse_chunked_head
from core.native.simulate import (
    Checkpointed,
    NativeProgram,
    backward_calls,
    in_place_ops,
    native_program,
)
from core.plan import Prediction
from core.problem import Problem
from core.simulator import COLUMNS
from core.simulator.program import RUN, step_values
from core.simulator.timeline import Step
from core.simulator.walker import walk
from core.trace.call import fake_call
from core.trace.eager_branches import eager_branches

aten = torch.ops.aten

# torchtitan: `_get_default_save_ops()` (torch 2.13's partitioner list plus its own)
TITAN_SAVE = frozenset(
    {
        *(op.default for op in get_default_op_list().compute_intensive_ops),  # type: ignore[attr-defined]
        aten._scaled_dot_product_cudnn_attention.default,
        aten._scaled_dot_product_attention_math.default,
        aten._scaled_dot_product_fused_attention_overrideable.default,
        aten.max.default,
        aten.linear.default,
        aten.topk.default,
    }
)
TITAN_MM = (aten.mm.default, aten.linear.default)  # counted: every second one recomputed
TUNE_MIN_BYTES = 1024  # torchtune's min_offload_size default

Mechanism = Callable[[nn.Module], AbstractContextManager[None]]


class NotApplicable(RematError):
    """The strategy cannot be applied to this model as its own code would (what is missing
    and what to do is in the message)."""


@dataclass(frozen=True)
class Imported:
    """A strategy users run, applied to an analysed model: the regions it checkpoints (with
    what each saves), the values it offloads, and the native program that predicts it.
    `running(model)` is the strategy's own mechanism, active around the model's forward."""

    key: str  # hf | torchtitan | torchtune | autosac
    name: str
    modules: tuple[str, ...]  # checkpointed submodules
    regions: tuple[Checkpointed, ...]
    offloaded: frozenset[int]
    notes: tuple[str, ...]
    prediction: Prediction
    program: NativeProgram = field(repr=False, compare=False)
    problem: Problem = field(repr=False, compare=False)
    running: Mechanism = field(repr=False, compare=False)
    bound: int | None = None  # auto-SAC: its own predicted peak bound, bytes
    # why its gradients differ from eager's, by its own mechanism (empty: they are equal)
    differs: tuple[str, ...] = ()

    @property
    def timeline(self) -> list[Step]:
        """The native program's memory timeline, one `Step` per instruction (the app's data):
        a recomputed op is a run of its graph op marked `recompute`."""
        return native_timeline(self.problem, self.program)

    def step(self, model: nn.Module) -> Callable[..., torch.Tensor]:
        """A step `fn(*args, targets=(), **kwargs) -> loss` running the model under the
        strategy's own mechanism, the loss (the problem's `loss_fn`) outside it; the caller
        runs `loss.backward()`."""
        loss_fn = self.problem.loss_fn

        def run(*args: Any, targets: Sequence[torch.Tensor] = (), **kwargs: Any) -> torch.Tensor:
            with self.running(model):
                out = model(*args, **kwargs)
            return out if loss_fn is None else loss_fn(out, *targets)

        return run


def native_timeline(problem: Problem, program: NativeProgram) -> list[Step]:
    """A native program walked with a recording: live bytes by kind after each instruction
    (the app's timeline data). A run past the graph's ops is a recompute of its source op
    (marked `recompute`), a copy to the host (label "offload"), a copy back ("prefetch"), or
    a dead op's results made and freed at once ("unused result", after its source op)."""
    graph = problem.graph
    kind_of = {v.index: COLUMNS.index(v.kind) for v in graph.values if v.kind in COLUMNS}
    column = dict(kind_of)
    for extra_op in program.ops[len(graph.ops) :]:  # a copy has its original's kind
        originals = graph.ops[extra_op.source].outputs
        for k, v in enumerate(extra_op.outputs):
            column[v] = kind_of.get(originals[min(k, len(originals) - 1)], 0) if originals else 0
    _, initial, arriving = step_values(graph)
    walked = walk(
        program.ops,
        program.program,
        program.backward_start,
        program.sizes,
        initial,
        arriving,
        graph.final_values,
        column=column,
        record=True,
    )
    out: list[Step] = []
    for i, ((kind, target), live) in enumerate(zip(program.program, walked.columns)):
        phase: Phase = "forward" if i < program.backward_start else "backward"
        cols = (*live, *[0] * (len(COLUMNS) - len(live)))
        if kind == RUN:
            native = program.ops[target]
            op = graph.ops[native.source]
            extra = target >= len(graph.ops)
            label = op.label
            if native.transient:
                label = "unused result"  # a dead op eager runs and frees at once
            elif extra and not native.inputs:
                label = "prefetch"
            elif extra and not native.outputs:
                label = "offload"
            recompute = extra and label == op.label
            block = problem.block_of_op[op.index]
            out.append(Step(i, kind, op.index, op.name, label, phase, block, recompute, *cols))
        else:
            name = graph.values[target].name if target < len(graph.values) else f"copy {target}"
            out.append(Step(i, kind, target, name, "free", phase, -1, False, *cols))
    return out


# ---------------------------------------------------------------------------------------------
# Which layers a strategy wraps


def decoder_layers(model: nn.Module) -> list[str]:
    """The layers the strategies wrap, by path: a Hugging Face model's
    `GradientCheckpointingLayer`s (what `gradient_checkpointing_enable()` checkpoints), else
    the members of the `nn.ModuleList` whose repeated class holds the most parameters (a
    transformer's blocks). NotApplicable when the model has neither."""
    try:
        from transformers.modeling_layers import GradientCheckpointingLayer

        found = [n for n, m in model.named_modules() if isinstance(m, GradientCheckpointingLayer)]
        if found:
            return found
    except ImportError:  # transformers is optional
        pass
    best: tuple[int, list[str]] = (0, [])
    for name, module in model.named_modules():
        if not isinstance(module, nn.ModuleList) or len(module) < 2:
            continue
        kinds = {type(child) for child in module}
        if len(kinds) != 1:
            continue
        size = sum(p.numel() for p in module.parameters())
        if size > best[0]:
            best = (size, [f"{name}.{i}" if name else str(i) for i in range(len(module))])
    if not best[1]:
        raise NotApplicable(
            f"{type(model).__name__} has no decoder layers to checkpoint (no Hugging Face "
            "GradientCheckpointingLayer, no nn.ModuleList of one repeated layer class): pass "
            "the layers as `units` (auto-SAC) or use hf_checkpointing on a diffusers model"
        )
    return best[1]


# ---------------------------------------------------------------------------------------------
# Regions: a checkpointed module and what its policy saves, in graph ops


def policy_ops(problem: Problem, module: str) -> list[int]:
    """The traced nodes a selective-checkpoint policy of `module` is asked about, in order:
    its ATen ops less the ones SAC passes by (`SAC_IGNORED_OPS`)."""
    nodes = problem.graph.trace.nodes
    return [
        n
        for n in module_nodes(problem, module)
        if isinstance(nodes[n].target, torch._ops.OpOverload)
        and nodes[n].target not in SAC_IGNORED_OPS
    ]


def region(
    problem: Problem, module: str, saved: Sequence[bool] = (), early_stop: bool = True
) -> Checkpointed:
    """`module` run under checkpoint, its policy saving the `policy_ops` marked in `saved`
    (none when empty): the graph ops whose results its cache holds."""
    graph = problem.graph
    op_of = {n: op.index for op in graph.ops for n in op.nodes}
    order = policy_ops(problem, module)
    if saved and len(saved) != len(order):
        raise ValueError(f"{module}: {len(saved)} decisions for {len(order)} policy ops")
    cached = frozenset(op_of[n] for n, s in zip(order, saved) if s and n in op_of)
    inputs = python_held(problem).passed.get(module, frozenset())
    nodes = frozenset(module_nodes(problem, module))
    return Checkpointed(nodes, cached, inputs, early_stop=early_stop)


def _imported(
    problem: Problem,
    key: str,
    name: str,
    modules: Sequence[str],
    regions: Sequence[Checkpointed],
    running: Mechanism,
    offloaded: frozenset[int] = frozenset(),
    notes: Sequence[str] = (),
    bound: int | None = None,
    differs: Sequence[str] = (),
) -> Imported:
    """The strategy's native program, walked: its prediction."""
    held = python_held(problem)
    program = native_program(problem.graph, list(regions), held.dropped, offloaded, problem.link)
    walked = program.walk(problem.graph)
    base = problem.store_all_time
    prediction = Prediction(walked.peak, walked.time, walked.time / base if base else 1.0)
    return Imported(
        key,
        name,
        tuple(modules),
        tuple(regions),
        offloaded,
        tuple(notes),
        prediction,
        program,
        problem,
        running,
        bound,
        tuple(differs),
    )


def _model(problem: Problem) -> nn.Module:
    """The analysed model, which the strategy runs as its own code does (its own head)."""
    refuse_chunked_head(problem)
    model = problem.model_ref() if problem.model_ref is not None else None
    if model is None:
        raise NotApplicable(
            f"the model analysed as {problem.name!r} is gone: keep a reference to it while "
            "importing a strategy (it runs on the model itself)"
        )
    return model


# ---------------------------------------------------------------------------------------------
# Hugging Face gradient checkpointing


def hf_checkpointing(problem: Problem) -> Imported:
    """Hugging Face's `gradient_checkpointing_enable()`: each decoder layer's forward under
    non-reentrant checkpoint (transformers' default), nothing saved inside. On a model that
    is no `PreTrainedModel`, the same wrap on its repeated layers."""
    model = _model(problem)
    diffusers = callable(getattr(model, "enable_gradient_checkpointing", None)) and getattr(
        model, "_supports_gradient_checkpointing", False
    )
    layers = diffusers_checkpointed(problem) if diffusers else decoder_layers(model)
    regions = [region(problem, m) for m in layers]
    return _imported(
        problem,
        "hf",
        "Hugging Face gradient checkpointing",
        layers,
        regions,
        functools.partial(_hf_running, layers=tuple(layers)),
    )


def diffusers_checkpointed(problem: Problem) -> list[str]:
    """The submodules diffusers' `enable_gradient_checkpointing()` runs under checkpoint
    (its blocks call `self._gradient_checkpointing_func(resnet, ...)`): found by one
    forward on fake inputs shaped as traced, with a recording function in its place."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    model: Any = _model(problem)
    name_of = {id(m): n for n, m in model.named_modules()}
    found: list[str] = []

    def record(module: nn.Module, *args: Any) -> Any:
        found.append(name_of[id(module)])
        return module(*args)

    mode = FakeTensorMode(allow_non_fake_inputs=True)
    args, kwargs, _ = _traced_call(model, problem.graph.trace, mode)
    model.enable_gradient_checkpointing(gradient_checkpointing_func=record)
    try:
        with mode:
            model(*args, **kwargs)
    finally:
        model.disable_gradient_checkpointing()
    return found


@contextmanager
def _hf_running(model: nn.Module, layers: tuple[str, ...]) -> Iterator[None]:
    """transformers' own `activation_checkpointing_enable()` (or `gradient_checkpointing_
    enable()`) on a `PreTrainedModel`, disabled again after the forward (the checkpoints
    made keep their recompute); elsewhere its wrap: `checkpoint(partial(forward, self,
    **kwargs), *args, use_reentrant=False)` on each layer's forward."""
    enable: Any = getattr(model, "activation_checkpointing_enable", None) or getattr(
        model, "gradient_checkpointing_enable", None
    )
    if getattr(model, "_supports_gradient_checkpointing", False):  # diffusers
        model.enable_gradient_checkpointing()  # type: ignore[operator]
        try:
            yield
        finally:
            model.disable_gradient_checkpointing()  # type: ignore[operator]
        return
    if enable is not None and getattr(model, "supports_gradient_checkpointing", False):
        enable()
        names = ("activation_checkpointing_disable", "gradient_checkpointing_disable")
        disable: Any = next(getattr(model, n) for n in names if hasattr(model, n))
        try:
            yield
        finally:
            disable()
        return
    from torch.utils.checkpoint import checkpoint

    def wrap(module: nn.Module) -> Callable[..., Any]:
        forward = type(module).forward

        def checkpointed(*args: Any, **kwargs: Any) -> Any:
            return checkpoint(
                functools.partial(forward, module, **kwargs), *args, use_reentrant=False
            )

        return checkpointed

    with _forwards(model, layers, wrap):
        yield


@contextmanager
def _forwards(
    model: nn.Module, layers: Sequence[str], wrap: Callable[[nn.Module], Callable[..., Any]]
) -> Iterator[None]:
    """Each layer's forward replaced by `wrap(layer)` for the duration."""
    modules = [model.get_submodule(name) for name in layers]
    for m in modules:
        m.forward = wrap(m)
    try:
        yield
    finally:
        for m in modules:
            del m.forward


# ---------------------------------------------------------------------------------------------
# torchtitan's selective op policy


def titan_saves(targets: Sequence[Any]) -> list[bool]:
    """torchtitan's decisions for one block's ops in order: save an op in `TITAN_SAVE`,
    except every second `aten.mm`/`aten.linear` (its mm count even)."""
    count, out = 0, []
    for func in targets:
        if func in TITAN_MM:
            count += 1
        out.append(func in TITAN_SAVE and not (func in TITAN_MM and count % 2 == 0))
    return out


def titan_policy() -> Callable[..., CheckpointPolicy]:
    """torchtitan's `_get_custom_policy()` (default config: no forced-recompute shapes; its
    CUDA-to-CPU `_to_copy` rule never fires on CPU): a fresh counter per block call,
    forward and recompute counted apart."""
    meta = {"forward_mm_count": 0, "recompute_mm_count": 0}

    def policy(ctx: Any, func: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
        if (
            func == aten._to_copy.default
            and "cuda" in str(args[0].device)
            and "device" in kwargs
            and str(kwargs["device"]) == "cpu"
        ):
            return CheckpointPolicy.MUST_SAVE
        key = f"{'recompute' if ctx.is_recompute else 'forward'}_mm_count"
        if func in TITAN_MM:
            meta[key] += 1
        if func in TITAN_SAVE:
            if func in TITAN_MM and meta[key] % 2 == 0:
                return CheckpointPolicy.PREFER_RECOMPUTE
            return CheckpointPolicy.MUST_SAVE
        return CheckpointPolicy.PREFER_RECOMPUTE

    return policy


def torchtitan_selective(problem: Problem) -> Imported:
    """torchtitan's selective op AC on each decoder layer (`checkpoint_wrapper`,
    `early_stop=False`, `preserve_rng_state=True`)."""
    layers = decoder_layers(_model(problem))
    nodes = problem.graph.trace.nodes
    regions = [
        region(
            problem,
            m,
            titan_saves([nodes[n].target for n in policy_ops(problem, m)]),
            early_stop=False,
        )
        for m in layers
    ]
    return _imported(
        problem,
        "torchtitan",
        "torchtitan selective op AC",
        layers,
        regions,
        functools.partial(_wrapped_running, layers=tuple(layers), policies=None),
    )


@contextmanager
def _wrapped_running(
    model: nn.Module,
    layers: tuple[str, ...],
    policies: dict[str, Callable[[], Callable[..., CheckpointPolicy]]] | None,
) -> Iterator[None]:
    """Each layer swapped for PyTorch's `checkpoint_wrapper` of it, as torchtitan's
    `SelectiveAC._wrap_block` makes it (with `policies[layer]` for auto-SAC), and swapped
    back after the forward."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
    from torch.utils.checkpoint import create_selective_checkpoint_contexts

    swapped = []
    for name in layers:
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name)
        layer = parent.get_submodule(child)
        make = titan_policy if policies is None else policies[name]
        # auto-SAC saves an in-place op with its parent (dropout's `empty_like` and
        # `bernoulli_`): the cache entry is mutated by the region's own op
        mutable = policies is not None
        wrapped = checkpoint_wrapper(
            layer,
            context_fn=lambda make=make, mutable=mutable: create_selective_checkpoint_contexts(
                make(), allow_cache_entry_mutation=mutable
            ),
            preserve_rng_state=True,
            determinism_check="default",
            early_stop=False if policies is None else True,
        )
        parent.register_module(child, wrapped)
        swapped.append((parent, child, layer))
    try:
        yield
    finally:
        for parent, child, layer in swapped:
            parent.register_module(child, layer)


# ---------------------------------------------------------------------------------------------
# torchtune's activation offloading


def torchtune_offload(problem: Problem) -> Imported:
    """torchtune's `OffloadActivations` around the model's forward: every saved tensor of
    at least `TUNE_MIN_BYTES` that is no parameter or buffer goes to the host when autograd
    saves it and comes back, one fresh device copy per saved tensor, when its node runs
    (`model.output`, when the model has one, excepted, as `get_act_offloading_ctx_manager`
    does). No layer is checkpointed."""
    model = _model(problem)
    graph = problem.graph
    nodes = graph.trace.nodes
    skip = "output" if isinstance(getattr(model, "output", None), nn.Module) else None
    maker: dict[int, int] = {}  # seq_nr -> the forward node that made the autograd node
    for node in nodes:
        if node.role == "op" and node.module is not None:
            maker.setdefault(node.seq_nr, node.index)
    op_of = {n: op.index for op in graph.ops for n in op.nodes}
    forward = {n for op in graph.ops if op.phase == "forward" for n in op.nodes}

    def packed(n: int) -> bool:
        node = nodes[n]
        if node.role == "input":
            return _bytes(node) >= TUNE_MIN_BYTES
        return node.role == "op" and n in forward and _bytes(node) >= TUNE_MIN_BYTES

    saved: dict[tuple[int, int], set[int]] = {}  # (first op of a call, value) -> packed nodes
    whole: set[tuple[int, int]] = set()  # ... read unpacked too: autograd holds the original

    calls = backward_calls(graph, frozenset(in_place_ops(graph).values()))
    for call in calls:
        made = maker.get(call.seq_nr)
        inside = made is not None and not call.stale and not _under(nodes[made].module, skip)
        for b in call.ops:
            for bn in graph.ops[b].nodes:
                for n in nodes[bn].reads:
                    if n in op_of and graph.ops[op_of[n]].phase == "backward":
                        continue
                    if not nodes[n].storages:
                        continue
                    v = nodes[n].storages[0]
                    key = (call.ops[0], v)
                    if inside and packed(n):
                        saved.setdefault(key, set()).add(n)
                    else:
                        whole.add(key)
    back = {k: sum(_bytes(nodes[n]) for n in ns) for k, ns in saved.items() if k not in whole}

    def copied_back(call: Any, v: int) -> int:
        return back.get((call.ops[0], v), 0)

    offloaded = frozenset(v for _, v in back)
    held = python_held(problem)
    program = native_program(
        graph, [], held.dropped, offloaded, problem.link, copied_back=copied_back
    )
    walked = program.walk(graph)
    base = problem.store_all_time
    notes = (
        []
        if skip
        else [
            "no `output` head: torchtune offloads the LM head's saved tensors too "
            "(get_act_offloading_ctx_manager warns of it)"
        ]
    )
    return Imported(
        "torchtune",
        "torchtune activation offloading",
        (),
        (),
        offloaded,
        tuple(notes),
        Prediction(walked.peak, walked.time, walked.time / base if base else 1.0),
        program,
        problem,
        functools.partial(_tune_running, skip=skip),
    )


def _under(module: str | None, prefix: str | None) -> bool:
    return (
        prefix is not None
        and module is not None
        and (module == prefix or module.startswith(prefix + "."))
    )


def _bytes(node: Any) -> int:
    """Bytes of a traced node's (first) tensor as a saved tensor: numel x item size."""
    spec = node.specs[0]
    numel = 1
    for d in spec.shape:
        numel *= d
    return numel * torch.empty((), dtype=getattr(torch, spec.dtype)).element_size()


class TuneOffload(torch.autograd.graph.saved_tensors_hooks):
    """torchtune's `OffloadActivations` single-stream path (`use_streams=False`), for a
    machine torchtune refuses (no accelerator): a saved tensor of at least `min_bytes` that
    is no parameter or buffer is copied to host memory the tracker does not see
    (`empty_like` + `copy_`, pinned on CUDA) and, when unpacked, copied back into a fresh
    device tensor; the rest is kept as it is."""

    def __init__(self, min_bytes: int = TUNE_MIN_BYTES) -> None:
        self.tracker: dict[int, tuple[torch.Tensor, bool, torch.device]] = {}
        self.next_id = 0

        def pack(activation: torch.Tensor) -> int:
            self.next_id += 1
            nbytes = activation.element_size() * activation.nelement()
            if nbytes >= min_bytes and not isinstance(activation, (nn.Parameter, nn.Buffer)):
                self.tracker[self.next_id] = (host_copy(activation), True, activation.device)
            else:
                self.tracker[self.next_id] = (activation, False, activation.device)
            return self.next_id

        def unpack(tensor_id: int) -> torch.Tensor:
            tensor, modified, device = self.tracker.pop(tensor_id)
            if not modified:
                return tensor
            out = torch.empty_like(tensor, device=device)
            out.copy_(tensor)
            return out

        super().__init__(pack, unpack)


@contextmanager
def _tune_running(model: nn.Module, skip: str | None) -> Iterator[None]:
    """torchtune's own `OffloadActivations` on an accelerator it accepts (when installed),
    else its single-stream replica; `model.output` under a no-op hook, as torchtune does."""
    hooks: Any = TuneOffload()
    if next(model.parameters()).device.type != "cpu":
        try:
            from torchtune.training import OffloadActivations

            hooks = OffloadActivations(use_streams=False)
        except ImportError:
            pass
    handles = []
    if skip is not None:
        noop = torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t)
        head = model.get_submodule(skip)
        handles = [
            head.register_forward_pre_hook(lambda *a: noop.__enter__()),
            head.register_forward_hook(lambda *a: noop.__exit__(), always_call=True),
        ]
    try:
        with hooks:
            yield
    finally:
        for h in handles:
            h.remove()


# ---------------------------------------------------------------------------------------------
# PyTorch's automatic SAC


@dataclass(frozen=True)
class AutoSacSolution:
    """What PyTorch's auto-SAC decided for a budget: per layer the fraction of activation
    memory to discard (`sac_milp`) and the per-op decisions (`get_optimal_checkpointing_
    policy_per_module`, 1 = save, in its estimator's op order), its recompute time (ms) and
    its peak bound (bytes, parameters and gradients included; -1: no solution)."""

    discard: dict[str, float]
    decisions: dict[str, tuple[int, ...]]
    recompute_ms: float
    bound: int
    param_bytes: int


def autosac(
    problem: Problem,
    budget: float | int,
    args: Sequence[Any] | None = None,
    kwargs: dict[str, Any] | None = None,
    targets: Sequence[torch.Tensor] = (),
    units: Sequence[str] | None = None,
) -> Imported:
    """PyTorch's automatic SAC for `budget` (bytes beyond parameters and inputs, or a
    fraction of the store-all peak), solved on the model called with `args`/`kwargs`:
    its stats collected under fake tensors (MemTracker, RuntimeEstimator and SACEstimator
    in "operator-level-benchmark" mode, each op timed for real), `sac_milp` over the
    decoder layers, each chosen layer checkpointed with its per-op policy. `bound` is its
    own peak bound less the parameters (comparable to ours). `units`: the submodules it
    may checkpoint (default: the decoder layers)."""
    model = _model(problem)
    layers = list(units) if units is not None else decoder_layers(model)
    want = int(budget * problem.store_all_peak) if isinstance(budget, float) else int(budget)
    stats = _STATS.get(problem)
    if stats is None:
        stats = autosac_stats(
            model, args, kwargs or {}, problem.loss_fn, targets, problem.graph.trace
        )
        _STATS[problem] = stats
    solution = solve_autosac(
        model, layers, want, args, kwargs or {}, problem.loss_fn, targets, stats=stats
    )
    return autosac_imported(problem, layers, solution, want)


def autosac_imported(
    problem: Problem, layers: Sequence[str], solution: AutoSacSolution, want: int
) -> Imported:
    """auto-SAC's decisions for `layers` as a strategy: each decided layer checkpointed with
    its per-op policy, predicted, and checked against the random-op rule (`random_conflict`):
    where a decision breaks it, `differs` says why its gradients are not eager's."""
    nodes = problem.graph.trace.nodes
    regions, chosen, notes, differs = [], [], [], []
    for layer in layers:
        decided = solution.decisions.get(layer)
        if decided is None:
            continue
        order = policy_ops(problem, layer)
        counted = [n for n in order if nodes[n].target not in _AUTOSAC_SKIPPED]
        if len(counted) != len(decided):
            raise NotApplicable(
                f"{layer}: auto-SAC's estimator saw {len(decided)} ops where the trace has "
                f"{len(counted)}: its per-op policy cannot be matched to the traced step"
            )
        it = iter(decided)
        saved = [
            bool(next(it)) if nodes[n].target not in _AUTOSAC_SKIPPED else False for n in order
        ]
        regions.append(region(problem, layer, saved))
        chosen.append(layer)
        conflict = random_conflict(problem, order, saved)
        if conflict is not None:
            differs.append(f"{layer}: {conflict}")
    if solution.bound < 0:
        notes.append(f"sac_milp found no solution at {want:,} B: nothing checkpointed")
    notes += [f"gradients differ from eager's: {d}" for d in differs]
    policies: dict[str, Callable[[], Callable[..., CheckpointPolicy]]] = {
        layer: functools.partial(autosac_policy, tuple(solution.decisions[layer]))
        for layer in chosen
    }
    bound = solution.bound - solution.param_bytes if solution.bound >= 0 else None
    return _imported(
        problem,
        "autosac",
        f"PyTorch auto-SAC at {want:,} B",
        chosen,
        regions,
        functools.partial(_wrapped_running, layers=tuple(chosen), policies=policies),
        notes=notes,
        bound=bound,
        differs=differs,
    )


def random_conflict(problem: Problem, order: Sequence[int], saved: Sequence[bool]) -> str | None:
    """Why a selective policy saving the nodes `saved` of `order` (a region's policy ops)
    changes the region's random numbers, or None when its recompute draws as the forward did.

    Checkpoint restores the RNG state at the region's start and the recompute reruns the
    unsaved ops in order. A random op comes out right when all its nodes are served from the
    cache (it draws nothing), or when every in-place node of it reruns (CPU dropout is
    `empty_like`, `bernoulli_`, `div_`: the kernel keeps using its `empty_like` buffer, so
    a cached in-place node leaves it unwritten or written twice). A random op served from the
    cache before one that draws again shifts the later one's draw."""
    graph = problem.graph
    op_of = {n: op.index for op in graph.ops for n in op.nodes}
    nodes = graph.trace.nodes
    by_op: dict[int, list[tuple[int, bool]]] = {}
    for n, s in zip(order, saved):
        o = op_of.get(n)
        if o is not None and graph.ops[o].random:
            by_op.setdefault(o, []).append((n, s))
    cached_before = None
    for o, members in sorted(by_op.items()):
        name = graph.ops[o].name
        if all(s for _, s in members):
            cached_before = cached_before or name
            continue
        if any(s for n, s in members if nodes[n].writes):  # a cached in-place node
            return f"{name} is saved in part: its recompute runs some of its in-place writes"
        if cached_before is not None:
            return (
                f"{cached_before} is saved and {name} after it recomputed: the recompute "
                "draws other random numbers"
            )
    return None


def _autosac_skipped() -> frozenset[Any]:
    from torch.distributed._tools.sac_estimator import OPS_TO_ALWAYS_SKIP

    return frozenset(OPS_TO_ALWAYS_SKIP)


_AUTOSAC_SKIPPED = _autosac_skipped()
# auto-SAC's statistics per analysed model (the same step for every budget)
_STATS: weakref.WeakKeyDictionary[Problem, tuple[Any, Any]] = weakref.WeakKeyDictionary()


def autosac_policy(decisions: tuple[int, ...]) -> Callable[..., CheckpointPolicy]:
    """A layer's auto-SAC decisions as a selective-checkpoint policy: the k-th op its
    estimator counted (ops in `OPS_TO_ALWAYS_SKIP` aside, recomputed) saved when its
    decision is 1; forward and recompute counted apart."""
    count = {False: 0, True: 0}

    def policy(ctx: Any, func: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
        if func in _AUTOSAC_SKIPPED:
            return CheckpointPolicy.PREFER_RECOMPUTE
        k = count[ctx.is_recompute]
        count[ctx.is_recompute] = k + 1
        if k < len(decisions) and decisions[k]:
            return CheckpointPolicy.MUST_SAVE
        return CheckpointPolicy.PREFER_RECOMPUTE

    return policy


def solve_autosac(
    model: nn.Module,
    layers: Sequence[str],
    budget: int,
    args: Sequence[Any] | None,
    kwargs: dict[str, Any],
    loss_fn: Callable[..., torch.Tensor] | None,
    targets: Sequence[torch.Tensor],
    trace: Any = None,
    stats: tuple[Any, Any] | None = None,
) -> AutoSacSolution:
    """PyTorch's auto-SAC pipeline, as its test (`test/distributed/_tools/test_sac_ilp.py`)
    runs it, on a fake copy of `model`: `budget` bytes beyond the parameters is asked of
    `sac_milp` as (budget + parameters) GiB, the units being `layers`. `stats`: what
    `autosac_stats` collected for this model and call (collected here when None)."""
    import copy

    from torch.distributed._tools.ilp_utils import parse_module_info
    from torch.distributed._tools.sac_ilp import (
        get_optimal_checkpointing_policy_per_module,
        sac_milp,
    )

    if stats is None:
        stats = autosac_stats(model, args, kwargs, loss_fn, targets, trace)
    info, sac_stats = stats
    param_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    graph = parse_module_info(copy.deepcopy(info))  # sac_milp writes into its nodes
    root = type(model).__name__
    units = [f"{root}.{layer}" for layer in layers]
    discard, recompute_ms, bound = sac_milp(
        graph, (budget + param_bytes) / 2**30, world_size=1, ac_units=units
    )
    decisions = {}
    for layer, unit in zip(layers, units):
        if unit in discard:
            decided = get_optimal_checkpointing_policy_per_module(
                sac_stats[unit], memory_budget=1 - discard[unit]
            )
            decisions[layer] = tuple(int(d) for d in decided)
    return AutoSacSolution(
        {layer: discard[unit] for layer, unit in zip(layers, units) if unit in discard},
        decisions,
        float(recompute_ms),
        int(bound),
        param_bytes,
    )


def autosac_stats(
    model: nn.Module,
    args: Sequence[Any] | None,
    kwargs: dict[str, Any],
    loss_fn: Callable[..., torch.Tensor] | None,
    targets: Sequence[torch.Tensor],
    trace: Any = None,
) -> tuple[Any, Any]:
    """auto-SAC's statistics of one step of `model` (its `aggregate_stats` module info and
    SACEstimator's per-module op stats): MemTracker over two steps, RuntimeEstimator and
    SACEstimator in "operator-level-benchmark" mode, on a fake copy (each op timed for real,
    2 warm-up and 3 timed runs, on a CPU timer). The slow part: collect once per model."""
    import copy
    from unittest import mock

    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.distributed._tools.ilp_utils import aggregate_stats
    from torch.distributed._tools.mem_tracker import MemTracker, _ModState
    from torch.distributed._tools.runtime_estimator import RuntimeEstimator
    from torch.distributed._tools.sac_estimator import SACEstimator

    fm = FakeTensorMode(allow_non_fake_inputs=False)
    fake = _fake_copy(model, fm)
    known: list[tuple[torch.Tensor, torch.Tensor]] = []  # fake inputs and their real values
    if args is None:  # inputs shaped as traced
        fargs, fkwargs, ftargets = _traced_call(model, trace, fm)
    else:

        def to_fake(t: Any) -> Any:
            if not isinstance(t, torch.Tensor):
                return t
            known.append((fm.from_tensor(t), t))
            return known[-1][0]

        fargs = [to_fake(a) for a in args]
        fkwargs = {k: to_fake(v) for k, v in kwargs.items()}
        ftargets = [to_fake(t) for t in targets]

    def step() -> torch.Tensor:
        # the model's branches on its inputs' values go as in eager (HF's mask: under fake
        # tensors transformers' `is_tracing` builds one eager does not, and the estimator's
        # per-op decisions would be counted on other ops than the step runs)
        with eager_branches(known):
            out = fake(*fargs, **fkwargs)
        return out if loss_fn is None else loss_fn(out, *ftargets)

    with fm, mock.patch.multiple(torch.cuda, **_cpu_cuda_timer()):
        mt = MemTracker()
        mt.track_external(fake)
        with mt:
            snapshot = None
            for i in range(2):
                step().backward()
                if i == 1:
                    snapshot = mt.get_tracker_snapshot("current")
                fake.zero_grad(set_to_none=True)
                if i == 0:
                    mt.reset_mod_stats()
        # as the test does for modules whose inputs need no gradient (Llama's rotary
        # embedding): ModTracker never calls their backward hooks
        for stats in mt.memory_tracking.values():
            for state in (_ModState.PRE_BW, _ModState.PEAK_BW, _ModState.POST_BW):
                if state not in stats.snapshots:
                    stats.snapshots.setdefault(state, []).append(copy.deepcopy(snapshot))
        step().backward()
        fake.zero_grad(set_to_none=True)
        re = RuntimeEstimator()
        with re(estimate_mode_type="operator-level-benchmark"):
            step().backward()
        fake.zero_grad(set_to_none=True)
        sac = SACEstimator()
        with sac(estimate_mode_type="operator-level-benchmark"):
            loss = step()
        loss.backward()
        info = aggregate_stats(fake, mt, re, sac, torch.device("cpu"))
    return info, sac.sac_mod_stats


def _fake_copy(model: nn.Module, fm: Any) -> nn.Module:
    """A deep copy of `model` whose parameters and buffers are fake tensors (shared ones
    stay shared): building a model under fake mode fails for some modules."""
    fake = copy_module(model)
    memo: dict[int, Any] = {}
    for module in fake.modules():
        for name, p in list(module._parameters.items()):
            if p is not None:
                if id(p) not in memo:
                    memo[id(p)] = nn.Parameter(fm.from_tensor(p.detach()), p.requires_grad)
                module._parameters[name] = memo[id(p)]
        for name, b in list(module._buffers.items()):
            if b is not None:
                if id(b) not in memo:
                    memo[id(b)] = fm.from_tensor(b)
                module._buffers[name] = memo[id(b)]
    return fake


def copy_module(model: nn.Module) -> nn.Module:
    import copy

    return copy.deepcopy(model)


def _cpu_cuda_timer() -> dict[str, Any]:
    """Stand-ins for the `torch.cuda` timing calls of RuntimeEstimator's benchmark (2
    warm-up, 3 timed runs): events on `time.perf_counter`, for a CPU-only machine."""
    import time

    class Event:
        def __init__(self, enable_timing: bool = False) -> None:
            self.at = 0.0

        def record(self, stream: Any = None) -> None:
            self.at = time.perf_counter()

        def elapsed_time(self, end: Event) -> float:
            return (end.at - self.at) * 1e3

    return {"Event": Event, "current_stream": lambda *a: None, "synchronize": lambda *a: None}


def _traced_call(model: nn.Module, trace: Any, mode: Any) -> tuple[Any, Any, Any]:
    """(args, kwargs, targets) as fake tensors of `mode`, shaped and passed as traced."""

    device = next(model.parameters()).device
    inputs = [(s.shape, s.dtype, False) for s in trace.input_specs]
    return fake_call(inputs, trace.call, device, mode)


# ---------------------------------------------------------------------------------------------
# By name: `remat plan MODEL --method <name>`

METHODS = ("hf", "torchtitan", "torchtune", "autosac")


def by_method(problem: Problem, method: str, budget: int | None = None) -> Imported:
    """The strategy `method` (one of METHODS) applied to the analysed model; auto-SAC needs
    `budget` (bytes beyond parameters and inputs) and solves on inputs shaped as traced."""
    if method == "autosac":
        if budget is None:
            raise ValueError("--method autosac needs --budget: auto-SAC solves for one")
        return autosac(problem, budget)
    makers = {"hf": hf_checkpointing, "torchtitan": torchtitan_selective}
    makers["torchtune"] = torchtune_offload
    if method not in makers:
        raise ValueError(f"unknown strategy {method!r}: choose one of {', '.join(METHODS)}")
    return makers[method](problem)


def describe(imported: Imported) -> str:
    """What the strategy costs, in one paragraph: predicted peak and time, what it wraps."""

    problem = imported.problem
    p = imported.prediction
    lines = [
        f"{imported.name}: predicted peak {fmt_bytes(p.peak)} "
        f"({p.peak / problem.store_all_peak:.0%} of store-all {fmt_bytes(problem.store_all_peak)}),"
        f" time {p.overhead:.3f}x store-all's (the native simulation; CPU: measured = "
        "predicted + 4 B)"
    ]
    if imported.modules:
        lines.append(
            f"  checkpoints {len(imported.modules)} modules: {', '.join(imported.modules)}"
        )
    if imported.offloaded:
        lines.append(f"  offloads {len(imported.offloaded)} saved values to the host")
    if imported.bound is not None:
        lines.append(f"  its own peak bound: {fmt_bytes(imported.bound)}")
    lines += [f"  note: {n}" for n in imported.notes]
    return "\n".join(lines)
