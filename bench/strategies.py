"""The strategies `remat bench` compares: PyTorch's own ways to save memory (torch.utils.checkpoint
on the model's repeated blocks, selective checkpointing, save_on_cpu, torch.compile's memory
budget) and our plans, each a step function over the same model."""

from __future__ import annotations

import copy
import functools
import math
from collections.abc import Callable, Iterable, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

import core
from core import (
    InvalidPlan,
    Plan,
    available_methods,
    fmt_bytes,
    host_copy,
    minimum_budget,
    native_handle,
)

# fractions of problem.store_all_peak, plus the minimum feasible; 25% is the goal's point
OUR_BUDGETS = (0.7, 0.5, 0.3, 0.25)
COMPILE_BUDGETS = (0.5, 0.2)  # torch._functorch.config.activation_memory_budget
# aot_eager at 1.0 recomputes nothing: a reference that separates the decompositions' own
# rounding from the differences the budget's recomputation brings (fresh dropout masks).
AOT_REFERENCE_BUDGET = 1.0
EVERY_K = 2
# methods whose plans also get a compiled native row (each is one more compile per plan)
NATIVE_COMPILED_METHODS = ("checkpoint_blocks", "rockmate")
# Outputs selective checkpointing keeps: matmuls and convolutions (the expensive ops).
SAC_SAVE = frozenset(
    getattr(torch.ops.aten, name).default
    for name in ("mm", "addmm", "bmm", "baddbmm", "convolution", "_convolution")
)

StepFn = Callable[[Sequence[torch.Tensor]], torch.Tensor]


@dataclass(frozen=True)
class Strategy:
    """One way to run a training step: `step` runs forward and backward on the inputs; the
    predictions are our plans' (NaN for PyTorch's)."""

    key: str
    name: str
    family: str
    budget: str
    step: StepFn
    peak_source: str = "tracker"
    predicted_peak: float = math.nan
    predicted_overhead: float = math.nan
    note: str = ""
    # a second reference for the gradients (a compiled row: compiled eager with the same
    # backend, whose fused kernels round as its own do), named in the row's note
    reference: StepFn | None = None
    reference_name: str = ""


# ---------------------------------------------------------------------------------------------
# Blocks: the model's repeated layers, for torch.utils.checkpoint


def find_blocks(model: nn.Module) -> list[nn.Module]:
    """The model's repeated layers: children of an nn.ModuleList/Sequential, grouped by class;
    among classes with children of their own, the one whose instances hold the most parameters
    wins (ties: more instances, then the innermost), so ResNet gives its BasicBlocks, RegNet
    its XBlocks (not the Conv2d of its conv-BN pairs), GPT its transformer blocks.
    """
    containers = (nn.ModuleList, nn.Sequential, nn.ModuleDict)
    members: dict[type, list[nn.Module]] = {}
    depth_of: dict[type, int] = {}
    for name, module in model.named_modules():
        if not isinstance(module, (nn.ModuleList, nn.Sequential)):
            continue
        for child in module.children():
            if isinstance(child, containers) or not any(True for _ in child.parameters()):
                continue
            found = members.setdefault(type(child), [])
            if all(child is not m for m in found):
                found.append(child)
            depth_of[type(child)] = max(depth_of.get(type(child), 0), name.count(".") + 1)

    def score(cls: type) -> tuple[int, int, int]:
        params = {id(p): p.numel() for m in members[cls] for p in m.parameters()}
        return (sum(params.values()), len(members[cls]), depth_of[cls])

    candidates = [cls for cls, found in members.items() if len(found) >= 2]
    composite = [c for c in candidates if any(True for _ in members[c][0].children())]
    candidates = composite or candidates  # a block is made of layers; leaves only as a fallback
    if not candidates:
        return []
    return members[max(candidates, key=score)]


@contextmanager
def _patched_forward(blocks: Iterable[nn.Module], wrap: Callable[[Callable], Callable]):
    """Temporarily replace each block's forward by `wrap(original forward)`."""
    blocks = list(blocks)
    for b in blocks:
        b.forward = wrap(type(b).forward.__get__(b))
    try:
        yield
    finally:
        for b in blocks:
            del b.forward  # the instance attribute; the class's forward shows through again


def _checkpointed(fn: Callable, context_fn: Callable | None = None) -> Callable:
    from torch.utils.checkpoint import checkpoint

    kwargs: dict[str, Any] = {"context_fn": context_fn} if context_fn is not None else {}

    @functools.wraps(fn)
    def forward(*args, **kw):
        return checkpoint(fn, *args, use_reentrant=False, **kwargs, **kw)

    return forward


def _sac_policy(ctx, op, *args, **kwargs):
    from torch.utils.checkpoint import CheckpointPolicy

    return CheckpointPolicy.MUST_SAVE if op in SAC_SAVE else CheckpointPolicy.PREFER_RECOMPUTE


def _sac_context():
    from torch.utils.checkpoint import create_selective_checkpoint_contexts

    return create_selective_checkpoint_contexts(_sac_policy)


# ---------------------------------------------------------------------------------------------
# Strategies


def _eager_step(model: Callable[..., torch.Tensor]) -> StepFn:
    def step(inputs):
        loss = model(*inputs)
        loss.backward()
        return loss

    return step


def _patched_step(model: nn.Module, blocks: list[nn.Module], wrap) -> StepFn:
    def step(inputs):
        with _patched_forward(blocks, wrap):
            loss = model(*inputs)
        loss.backward()
        return loss

    return step


@contextmanager
def save_on_host(device: torch.device):
    """PyTorch's own offloading: every tensor autograd saves goes to host memory and comes back
    for the backward. On CUDA, `torch.autograd.graph.save_on_cpu(pin_memory=True)` itself. On
    CPU, where host and device are one memory and `save_on_cpu` would copy nothing, the same
    pack and unpack: a copy into host storage the tracker does not count (as the runtime's
    host pool), and a fresh device copy for each unpack, which it does count."""
    if device.type != "cpu":
        with torch.autograd.graph.save_on_cpu(pin_memory=True):
            yield
        return

    def unpack(host: torch.Tensor) -> torch.Tensor:
        out = torch.empty_like(host)
        out.copy_(host)
        return out

    with torch.autograd.graph.saved_tensors_hooks(host_copy, unpack):
        yield


def _offloaded_step(model: nn.Module, blocks: list[nn.Module]) -> StepFn:
    device = next(model.parameters()).device

    def step(inputs):
        with save_on_host(device), _patched_forward(blocks, _checkpointed):
            loss = model(*inputs)
        loss.backward()
        return loss

    return step


def _compile_backend(name: str, budget: float):
    """A backend with its own identity (so dynamo keeps one cache entry per strategy) that
    partitions with `activation_memory_budget = budget`."""
    from torch._dynamo.backends.registry import lookup_backend

    inner = lookup_backend(name)

    def backend(gm, example_inputs):
        with torch._functorch.config.patch(activation_memory_budget=budget):
            return inner(gm, example_inputs)

    backend.__name__ = f"{name}_budget_{budget}"
    return backend


def _on_cpu(model: nn.Module) -> bool:
    return next(model.parameters()).device.type == "cpu"


def pytorch_strategies(
    model: nn.Module, compile_backends: Sequence[str] = ("aot_eager_decomp_partition",)
) -> list[Strategy]:
    """Eager first (the reference), then save_on_cpu, checkpointing of the model's repeated
    blocks (every one, every EVERY_K-th, selective, with save_on_cpu) and torch.compile at
    each memory budget of each backend."""
    host = " [CPU: emulated]" if _on_cpu(model) else ""
    return [
        _pytorch("eager", "eager PyTorch", _eager_step(model)),
        _pytorch("soc", f"torch save_on_cpu, every saved tensor{host}", _offloaded_step(model, [])),
        *_block_strategies(model, find_blocks(model), host),
        *(s for backend in compile_backends for s in _compile_strategies(model, backend)),
    ]


def _pytorch(key: str, name: str, step: StepFn) -> Strategy:
    return Strategy(key, name, "pytorch", "-", step)


def _block_strategies(model: nn.Module, blocks: list[nn.Module], host: str) -> list[Strategy]:
    """torch.utils.checkpoint on the repeated blocks; none when the model has none."""
    if not blocks:
        return []
    every_k = blocks[::EVERY_K]
    n, kind = len(blocks), type(blocks[0]).__name__
    return [
        _pytorch(
            "ckpt",
            f"torch checkpoint, every block ({n} {kind})",
            _patched_step(model, blocks, _checkpointed),
        ),
        _pytorch(
            f"ckpt{EVERY_K}",
            f"torch checkpoint, every {EVERY_K}nd block ({len(every_k)} of {n})",
            _patched_step(model, every_k, _checkpointed),
        ),
        _pytorch(
            "sac",
            "selective checkpoint (save matmul/conv), every block",
            _patched_step(model, blocks, lambda fn: _checkpointed(fn, context_fn=_sac_context)),
        ),
        _pytorch(
            "soc+ckpt",
            f"torch save_on_cpu + checkpoint, every block{host}",
            _offloaded_step(model, blocks),
        ),
    ]


def _compile_strategies(model: nn.Module, backend: str) -> list[Strategy]:
    """torch.compile with `backend` at each memory budget (aot_eager also at 1.0, the
    reference); inductor's peaks come from the allocator's profile."""
    short = "aot" if backend.startswith("aot") else backend
    budgets: tuple[float, ...] = COMPILE_BUDGETS
    if short == "aot":
        budgets = (AOT_REFERENCE_BUDGET, *budgets)
    return [
        Strategy(
            f"{short}-{b}",
            f"torch.compile {backend}",
            "pytorch",
            f"activation_memory_budget {b}",
            _eager_step(torch.compile(model, backend=_compile_backend(backend, b))),
            peak_source="profiler" if backend == "inductor" else "tracker",
        )
        for b in budgets
    ]


def our_strategies(
    model: nn.Module,
    problem,
    methods: Sequence[str],
    budgets: Sequence[float] = OUR_BUDGETS,
    log: Callable[[str], None] = print,
    native_backend: str | None = None,
) -> list[Strategy]:
    """One strategy per distinct plan: a budget whose plan equals another's shares its row.
    Each plan also runs natively (`runtime="native"`, rows `native:`), and compiled with
    `native_backend` (rows `native-compiled:`, for the methods in NATIVE_COMPILED_METHODS)
    when one is given."""
    peak = problem.store_all_peak
    out: list[Strategy] = []
    for method in methods:
        if method not in available_methods():
            log(f"[yellow]skipped ours {method}: not in core.solvers.available_methods()[/]")
            continue
        try:
            low = minimum_budget(problem, method)
        except Exception as e:  # a solver in progress must not stop the bench
            log(f"[red]ours {method}: minimum budget failed: {type(e).__name__}: {e}[/]")
            continue
        plans: dict[tuple, tuple[list[str], Plan]] = {}
        asked = [(f"{b:.0%}", int(b * peak)) for b in budgets if int(b * peak) >= low]
        skipped = [f"{b:.0%}" for b in budgets if int(b * peak) < low]
        asked.append((f"min {low / peak:.0%}", low))
        min_asked = dict(asked)
        for label, bytes_ in asked:
            try:
                plan = core.solve(problem, bytes_, method)
            except Exception as e:
                log(f"[red]ours {method} at {label}: {type(e).__name__}: {e}[/]")
                continue
            key = (tuple(plan.program), plan.backward_start)
            plans.setdefault(key, ([], plan))[0].append(label)
        if skipped:
            log(f"ours {method}: {', '.join(skipped)} below its minimum {low / peak:.0%}")
        for labels, plan in plans.values():
            wrapped = core.apply_plan(model, plan)
            first = labels[0].removeprefix("min ")
            out.append(
                Strategy(
                    f"ours:{method}@{first}",
                    f"ours {method}",
                    "ours",
                    ", ".join(labels) + f" ({fmt_bytes(min_asked[labels[-1]])})",
                    _eager_step(wrapped),
                    predicted_peak=plan.predicted_peak,
                    predicted_overhead=plan.overhead,
                )
            )
            backend = native_backend if method in NATIVE_COMPILED_METHODS else None
            out += _native_strategies(model, plan, method, first, labels, backend, log)
    return out


def shared_copy(model: nn.Module) -> nn.Module:
    """A copy of `model`'s modules holding the model's own parameters and buffers: a plan
    applied natively to the copy (which replaces its layers' forwards) leaves the model's
    other strategies untouched, while steps, resets and gradients still go to the model."""
    memo: dict[int, Any] = {id(t): t for t in (*model.parameters(), *model.buffers())}
    return copy.deepcopy(model, memo)


def _native_strategies(
    model: nn.Module,
    plan: Plan,
    method: str,
    first: str,
    labels: list[str],
    backend: str | None,
    log: Callable[[str], None],
) -> list[Strategy]:
    """`plan` through the native runtime on a shared copy of the model, and that copy
    compiled with `backend` (gradients also checked against compiled eager's)."""
    try:
        native = core.apply_plan(shared_copy(model), plan, runtime="native")
    except InvalidPlan as e:  # the optimizer in the step: native execution runs no update
        log(f"ours {method} at {first}: no native row ({str(e).split(':')[0]})")
        return []
    budget = ", ".join(labels)
    handle = native_handle(native)
    assert handle is not None
    predicted = handle.prediction
    rows = [
        Strategy(
            f"native:{method}@{first}",
            f"ours native {method}",
            "ours",
            budget,
            _eager_step(native),
            predicted_peak=predicted.peak,
            predicted_overhead=predicted.overhead,
            note="predicted: the native simulation",
        )
    ]
    if backend is None:
        return rows
    compiled_eager = torch.compile(shared_copy(model), backend=backend)
    rows.append(
        Strategy(
            f"native-compiled:{method}@{first}",
            f"ours native, compiled {backend} {method}",
            "ours",
            budget,
            _eager_step(torch.compile(native, backend=backend)),
            peak_source="profiler" if backend == "inductor" else "tracker",
            reference=_eager_step(compiled_eager),
            reference_name=f"torch.compile {backend} of eager",
        )
    )
    return rows
