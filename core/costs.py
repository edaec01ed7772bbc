"""Op times: estimated from FLOPs and bytes against a device spec, or measured on real tensors.

Solvers trade memory for recompute time, so every op of the graph needs a time. The estimate
needs no compute and works for devices this machine does not have; the measurement runs each
distinct op once on real tensors of the traced shapes, 1 thread, on this machine (identical
transformer layers share one measurement). Both fill `Op.time` through `assign_times`.
"""

from __future__ import annotations

import functools
import math
import operator
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils.flop_counter import flop_registry

from core.graph import Graph, Op
from core.interpret import resolve, run_node
from core.simulator import Link
from core.trace import AtenNode, Ref, Trace
from core.trace.device import DeviceModel

# Host links as measured by others (sources in docs/tuning.md); CPU: a host copy is a memcpy,
# reading and writing each byte once at the 35 GB/s measured below, hence 17.5 GB/s.
PCIE4 = Link(d2h=25e9, h2d=25e9)


@dataclass(frozen=True)
class DeviceSpec:
    """Sustained rates of one device: what the estimate divides FLOPs and bytes by."""

    name: str
    flops: float  # sustained FLOP/s for fp32 matmul-like work
    bandwidth: float  # sustained bytes/s of memory traffic
    launch: float  # fixed seconds per ATen kernel (dispatch/launch overhead)
    half_flops: float = 0.0  # FLOP/s for fp16/bf16 matmul-like work; 0: same as flops
    # Newly allocated outputs above `fresh_threshold` bytes are first-touched at this rate
    # (CPU: glibc serves them with a fresh mmap, so every step pays the page faults again).
    fresh_bandwidth: float = math.inf
    fresh_threshold: int = 0
    link: Link = field(default_factory=lambda: PCIE4)  # host link: offloads and prefetches
    # what the trace is made for (core.trace.device): the device type and, for a GPU, its
    # compute capability, which picks its attention kernels (core.trace.attention)
    type: str = "cuda"
    capability: tuple[int, int] | None = None


# "cpu": this machine (AMD EPYC, 2 cores), 1 thread: matmul rate, memory traffic, page faults
# on large fresh outputs and per-op dispatch, measured 2026-11-21 (docs/tuning.md).
# GPUs: datasheet peaks (NVIDIA A100/H100/V100 and Ada RTX 4090 datasheets, dense, no sparsity)
# derated to 70% of compute and 80% of bandwidth, what large kernels sustain in practice.
# `flops` is plain fp32 (PyTorch leaves TF32 matmuls off by default), `half_flops` the fp16/bf16
# tensor-core rate (RTX 4090: with fp32 accumulate). Launch: ~5 us of eager dispatch per kernel.
_C, _B = 0.7, 0.8
DEVICES: dict[str, DeviceSpec] = {
    "cpu": DeviceSpec(
        "cpu",
        flops=85e9,
        bandwidth=35e9,
        launch=4e-6,
        fresh_bandwidth=1.8e9,
        fresh_threshold=32 << 20,
        link=Link(d2h=17.5e9, h2d=17.5e9),
        type="cpu",
    ),
    # A100 SXM4 80 GB: 19.5 TFLOP/s fp32, 312 bf16, HBM2e 2,039 GB/s.
    "a100": DeviceSpec(
        "a100",
        19.5e12 * _C,
        2039e9 * _B,
        5e-6,
        half_flops=312e12 * _C,
        link=PCIE4,
        capability=(8, 0),
    ),
    # H100 SXM5 80 GB: 67 TFLOP/s fp32, 989 bf16, HBM3 3,350 GB/s.
    "h100": DeviceSpec(
        "h100",
        67e12 * _C,
        3350e9 * _B,
        5e-6,
        half_flops=989e12 * _C,
        link=Link(d2h=52.8e9, h2d=35e9),
        capability=(9, 0),
    ),
    # V100 SXM2 32 GB: 15.7 TFLOP/s fp32, 125 fp16 tensor, HBM2 900 GB/s.
    "v100": DeviceSpec(
        "v100",
        15.7e12 * _C,
        900e9 * _B,
        5e-6,
        half_flops=125e12 * _C,
        link=Link(12e9, 12e9),
        capability=(7, 0),
    ),
    # RTX 4090: 82.6 TFLOP/s fp32, 165.2 fp16 tensor (fp32 accumulate), GDDR6X 1,008 GB/s.
    "rtx4090": DeviceSpec(
        "rtx4090",
        82.6e12 * _C,
        1008e9 * _B,
        5e-6,
        half_flops=165.2e12 * _C,
        link=Link(24.7e9, 24.7e9),
        capability=(8, 9),
    ),
}

MODELS = ("estimated", "measured")


def device_model(device: str, attention: str = "auto") -> DeviceModel:
    """The device model a step is traced for on the preset `device` ("h100"), assuming
    `attention` first ("auto": torch's own order; core.trace.attention)."""
    spec = _device_spec(device)
    return DeviceModel(spec.name, spec.type, spec.capability, attention)


def detected_model(device: torch.device, attention: str = "auto") -> DeviceModel:
    """The device model of a real device tensors sit on: CPU, or a CUDA GPU by its compute
    capability (named by the preset with that capability, else "cuda")."""
    if device.type != "cuda":
        return DeviceModel("cpu", "cpu", None, attention)
    cap = torch.cuda.get_device_capability(device)
    name = next((n for n, s in DEVICES.items() if s.capability == cap), "cuda")
    return DeviceModel(name, "cuda", cap, attention)


def host_link(cost_model: str) -> Link:
    """The host link of a problem's cost model ("estimated:h100", "measured:cuda:0"): its
    device preset's; for costs measured on an accelerator, the link measured there
    (`measure_link`); PCIe 4 x16 for an estimated device without a preset."""
    kind, _, device = cost_model.partition(":")
    spec = DEVICES.get(device)
    if spec is not None:
        return spec.link
    if kind == "measured":
        return measure_link(device)
    return PCIE4


LINK_BYTES = 64 << 20  # per copy: large enough that the fixed cost of a copy is negligible


@functools.cache
def measure_link(device: str, nbytes: int = LINK_BYTES, repeats: int = 5) -> Link:
    """The host link measured on `device`: the median of `repeats` copies of `nbytes` each way
    between a host buffer (pinned on CUDA, as the offload runtime's pool) and the device,
    timed with CUDA events on CUDA and the wall clock elsewhere (on CPU, a memcpy). Once per
    device and process: `remat link` prints it."""
    try:
        dev = torch.device(device)
    except RuntimeError as e:
        raise ValueError(f"{device!r} is not a torch device (e.g. 'cuda', 'cuda:1', 'cpu')") from e
    cuda = dev.type == "cuda"
    if cuda and not torch.cuda.is_available():
        raise ValueError(f"no CUDA device here to measure {device!r} on: use --device cpu")
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=cuda)
    on_device = torch.empty(nbytes, dtype=torch.uint8, device=dev)
    host.fill_(1)
    on_device.fill_(2)

    def seconds(dst: torch.Tensor, src: torch.Tensor) -> float:
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            dst.copy_(src, non_blocking=True)
            end.record()
            end.synchronize()
            return start.elapsed_time(end) / 1e3
        begin = time.perf_counter()
        dst.copy_(src)
        return time.perf_counter() - begin

    def rate(dst: torch.Tensor, src: torch.Tensor) -> float:
        seconds(dst, src)  # warm-up: first touch, driver setup
        return nbytes / statistics.median(seconds(dst, src) for _ in range(repeats))

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as op costs are measured; a CPU copy with 2 threads stalls
    try:
        return Link(d2h=rate(host, on_device), h2d=rate(on_device, host))
    finally:
        torch.set_num_threads(threads)


# Repeats of one op stop once its runs add up to this many seconds: huge ops need no median.
_TIME_BUDGET = 0.5
# Factories that only reserve memory: no traffic beyond first touching it.
_ALLOCATE_ONLY = {
    torch.ops.aten.empty.memory_format,
    torch.ops.aten.empty_like.default,
    torch.ops.aten.empty_strided.default,
    torch.ops.aten.new_empty.default,
    torch.ops.aten.new_empty_strided.default,
}
_HALF = {"float16", "bfloat16"}
# Distinct random values per measured input tensor.
_POOL = 1 << 16


def estimate_times(graph: Graph, device: DeviceSpec | str = "cpu") -> list[float]:
    """Per-op seconds from FLOPs and bytes moved against a device spec (no compute).

    A node takes max(FLOPs / rate, bytes / bandwidth) + launch, plus first-touch time for large
    new outputs where the device has it; getitems cost nothing, views only the launch.
    """
    spec = _device_spec(device)
    trace = graph.trace
    return [sum(_node_time(trace, trace.nodes[n], spec) for n in op.nodes) for op in graph.ops]


def measure_times(
    graph: Graph,
    repeats: int = 5,
    progress: Callable[[int, int], None] | None = None,
    device: str = "cpu",
) -> list[float]:
    """Per-op seconds measured on real tensors on `device`, 1 thread, median of `repeats`.

    Ops with an identical signature (`op_signature`) are timed once, so identical layers cost
    one measurement. Traces record no device: `analyze` passes the model's. Each op runs
    its ATen nodes in order through `run_node`, as the runtime does, on fresh inputs: floats
    random normal, integers zeros (valid indices), bools random. On CPU, time is the measuring
    thread's CPU time, so other processes sharing the cores do not inflate it; on CUDA, wall
    time between synchronizations (kernels run asynchronously). The caller's thread count
    and random state are left as they were. `progress(done, total)` is called after each
    distinct signature is timed; `total` is the number of distinct signatures.
    """
    if repeats < 1:
        raise ValueError(f"repeats must be at least 1, got {repeats}")
    try:
        dev = torch.device(device)
    except RuntimeError:
        raise ValueError(
            f"measured costs run on a torch device (cpu, cuda), not {device!r}"
        ) from None
    trace = graph.trace
    signatures = [op_signature(trace, op) for op in graph.ops]
    first: dict[tuple, Op] = {}
    for sig, op in zip(signatures, graph.ops):
        first.setdefault(sig, op)
    seconds: dict[tuple, float] = {}
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with torch.random.fork_rng(devices=[dev] if dev.type == "cuda" else []):
            torch.manual_seed(0)
            for done, (sig, op) in enumerate(first.items(), 1):
                seconds[sig] = _time_op(trace, op, repeats, dev)
                if progress is not None:
                    progress(done, len(first))
    finally:
        torch.set_num_threads(threads)
    return [seconds[sig] for sig in signatures]


def assign_times(
    graph: Graph, model: str = "estimated", device: DeviceSpec | str = "cpu", **kw: Any
) -> None:
    """Fill op.time for every op of graph.ops by the cost model "estimated" or "measured".

    `device` picks the spec of the estimate, or the torch device measured on; `kw` goes to
    `measure_times` (repeats, progress).
    """
    if model == "estimated":
        times = estimate_times(graph, device, **kw)
    elif model == "measured":
        if not isinstance(device, str):
            raise ValueError(f"measured costs run on a torch device (cpu, cuda), not {device!r}")
        times = measure_times(graph, device=device, **kw)
    else:
        raise ValueError(f"unknown cost model {model!r}; valid: {', '.join(MODELS)}")
    for op, t in zip(graph.ops, times, strict=True):
        op.time = t


def op_signature(trace: Trace, op: Op) -> tuple:
    """What an op's time depends on: its nodes' targets and arguments, inputs as shapes and strides.

    Refs to nodes of the op itself become their position in it, so identical layers match.
    """
    position = {n: i for i, n in enumerate(op.nodes)}

    def key(arg: Any) -> Any:
        if isinstance(arg, Ref):
            if arg.index in position:
                return ("node", position[arg.index])
            read = trace.nodes[arg.index]
            return ("input", read.specs, read.strides)
        if isinstance(arg, (tuple, list)):
            return (type(arg).__name__, *(key(a) for a in arg))
        if isinstance(arg, dict):
            return tuple(sorted((k, key(v)) for k, v in arg.items()))
        return repr(arg)

    return tuple(
        (str(trace.nodes[n].target), key(trace.nodes[n].args), key(trace.nodes[n].kwargs))
        for n in op.nodes
    )


# --- estimate ------------------------------------------------------------------------------


def _device_spec(device: DeviceSpec | str) -> DeviceSpec:
    if isinstance(device, DeviceSpec):
        return device
    if device not in DEVICES:
        raise ValueError(f"unknown device {device!r}; valid: {', '.join(DEVICES)}")
    return DEVICES[device]


def _node_time(trace: Trace, node: AtenNode, spec: DeviceSpec) -> float:
    if node.target is operator.getitem:
        return 0.0
    read_storages = {s for r in node.reads for s in trace.nodes[r].storages}
    new = [s for s in node.storages if s not in read_storages]
    if not new and not node.writes:  # a view: no new storage, no compute
        return spec.launch
    fresh = sum(b for s in new if (b := trace.storage_bytes[s]) > spec.fresh_threshold)
    seconds = spec.launch + fresh / spec.fresh_bandwidth
    if node.target in _ALLOCATE_ONLY:
        return seconds
    moved = sum(_tensor_bytes(trace, trace.nodes[r]) for r in node.reads)
    moved += _tensor_bytes(trace, node)
    half = node.specs and node.specs[0].dtype in _HALF and spec.half_flops
    rate = spec.half_flops if half else spec.flops
    return seconds + max(_flops(trace, node) / rate, moved / spec.bandwidth)


def _tensor_bytes(trace: Trace, node: AtenNode) -> int:
    """Bytes of the tensors a node returns, counting a broadcast (stride 0) storage once."""
    total = 0
    for spec, storage in zip(node.specs, node.storages):
        logical = math.prod(spec.shape) * _dtype(spec.dtype).itemsize
        total += min(logical, trace.storage_bytes[storage])
    return total


def _flops(trace: Trace, node: AtenNode) -> int:
    """FLOPs by PyTorch's own formulas (torch.utils.flop_counter), run on meta tensors."""
    formula = flop_registry.get(getattr(node.target, "overloadpacket", None))
    if formula is None:
        return 0
    env = {r: _make(trace.nodes[r], lambda s, st: _empty(s, st, "meta")) for r in node.reads}
    args, kwargs = resolve(node.args, env), resolve(node.kwargs, env)
    out = node.target(*args, **kwargs)
    return int(formula(*args, **kwargs, out_val=out))


# --- measurement -------------------------------------------------------------------------


def _time_op(trace: Trace, op: Op, repeats: int, device: torch.device) -> float:
    """Median seconds of running the op's nodes on fresh inputs: warm-up once, then repeat.

    A warm-up that already takes `_TIME_BUDGET` is the measurement; the repeats stop once
    their total, warm-up included, does.
    """
    nodes = [trace.nodes[n] for n in op.nodes]
    inside = set(op.nodes)
    outside = sorted({r for node in nodes for r in node.reads if r not in inside})
    inputs = {r: _make(trace.nodes[r], functools.partial(_random, device=device)) for r in outside}
    clock = time.thread_time
    if device.type == "cuda":

        def clock() -> float:
            torch.cuda.synchronize(device)
            return time.perf_counter()

    def run() -> float:
        env = dict(inputs)
        start = clock()
        for node in nodes:
            env[node.index] = run_node(node, env)
        return clock() - start

    warm = run()
    if warm >= _TIME_BUDGET:
        return warm
    runs: list[float] = []
    while len(runs) < repeats and warm + sum(runs) < _TIME_BUDGET:
        runs.append(run())
    return statistics.median(runs)


def _make(node: AtenNode, factory: Callable[[Any, tuple[int, ...]], torch.Tensor]) -> Any:
    """A stand-in for a node's result: one tensor, or a tuple/list as its schema returns."""
    tensors = [factory(s, st) for s, st in zip(node.specs, node.strides)]
    schema = getattr(node.target, "_schema", None)
    if schema is None or node.target is operator.getitem:
        return tensors[0]
    returns = schema.returns
    if len(returns) == 1 and isinstance(returns[0].type, torch.ListType):
        return tensors
    return tensors[0] if len(returns) == 1 else tuple(tensors)


def _random(spec: Any, stride: tuple[int, ...], device: torch.device | str = "cpu") -> torch.Tensor:
    """Floats random normal, integers zeros (valid indices), bools random; any strides.

    Random values repeat with a period of `_POOL`: drawing them is slower than most ops on
    1 thread, and an op's time does not depend on them.
    """
    size = 1 + sum((n - 1) * st for n, st in zip(spec.shape, stride)) if all(spec.shape) else 0
    base = torch.zeros(size, dtype=_dtype(spec.dtype), device=device)
    if size and (base.is_floating_point() or base.is_complex() or base.dtype == torch.bool):
        pool = torch.randn(min(size, _POOL), device=device)
        pool = pool > 0 if base.dtype == torch.bool else pool
        copies, rest = divmod(size, pool.numel())
        base[: size - rest].view(copies, -1).copy_(pool.expand(copies, -1))
        base[size - rest :].copy_(pool[:rest])
    return base.as_strided(spec.shape, stride)


def _empty(spec: Any, stride: tuple[int, ...], device: str) -> torch.Tensor:
    return torch.empty_strided(spec.shape, stride, dtype=_dtype(spec.dtype), device=device)


def _dtype(name: str) -> torch.dtype:
    return getattr(torch, name)
