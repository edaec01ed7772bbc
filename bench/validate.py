"""`remat bench --device cuda --validate`: the one command to run the day a GPU is at hand.

On a sample GPT and two Hugging Face models (each with its default attention), for fp32 and
bf16 autocast, and for store-all, every block checkpointed and ours (rockmate) at 50% of the
store-all peak, each plan run by the interpreter and natively, it measures one training step
from the same state as eager's and prints one table:

- predicted peak (the plan's, or the native simulation's) against the measured one: on CUDA
  `torch.cuda.max_memory_allocated()` minus the allocation the step started from; on CPU the
  storage tracker (`core.StorageTracker`), where measured = predicted + 4 B (the seed
  of `loss.backward()`);
- the allocator's bound: the plan's program walked with every storage rounded up as the CUDA
  caching allocator rounds it (512 B, `core.allocator`), below which `max_memory_allocated`
  cannot be; an unsplit cached block can make it more (interpreter rows: the plan's program);
- gradients against eager's: bit-equal, or the largest absolute difference;
- step time against eager's: the median of paired ratios (each step right after an eager one).

A row that cannot run (a plan refused, a runtime refusing the model) prints its refusal in
the row; the command never stops on one. `--device cpu` runs the same matrix on the CPU with
the tiny models: its structure is what tests/bench/test_validate.py checks.
"""

from __future__ import annotations

import argparse
import math
import statistics
import time
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

import core
from core import (
    CUDA_CACHING,
    NativeHandle,
    NativeStep,
    Plan,
    Problem,
    SavedPlan,
    StorageTracker,
    native_handle,
    step_tensors,
    step_values,
    walk,
)
from sample_models.zoo import ZooCase

SEED_BYTES = 4  # loss.backward()'s seed gradient, allocated outside the plan
PRECISIONS = ("fp32", "bf16")
STRATEGIES = ("store_all", "checkpoint_blocks", "ours@50%")
RUNTIMES = ("interpreter", "native")
OURS = ("rockmate", 0.5)


@dataclass(frozen=True)
class ModelSpec:
    """A model of the matrix: its name and a builder of its step on a device."""

    name: str
    build: Callable[[torch.device], ZooCase]


def _sample_gpt(name: str) -> Callable[[torch.device], ZooCase]:
    def build(device: torch.device) -> ZooCase:
        import sample_models

        model, (idx, targets) = sample_models.build(name)
        config: Any = sample_models.REGISTRY[name].config
        layers = config.n_layer
        return ZooCase(model.to(device), (idx.to(device), targets.to(device)), {}, None, (), layers)  # type: ignore[arg-type]

    return build


def _hf(
    kind: str, width: int, layers: int, seq: int, batch: int
) -> Callable[[torch.device], ZooCase]:
    """A Hugging Face GPT-2 or Llama of `layers` layers of `width`, from seed 0, with its
    default attention (SDPA), dropout on (GPT-2's 0.1; Llama's attention 0.1), no key/value
    cache (training: the native runtime refuses a layer updating a cache it would recompute),
    one batch of `batch` x `seq` tokens with a padded row, the loss outside the model."""

    def build(device: torch.device) -> ZooCase:
        from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

        from sample_models.hf_zoo import token_loss
        from sample_models.zoo import made

        vocab = 4 * width
        if kind == "gpt2":
            cfg: Any = GPT2Config(
                vocab_size=vocab,
                n_positions=seq,
                n_embd=width,
                n_layer=layers,
                n_head=max(2, width // 64),
                bos_token_id=vocab - 1,
                eos_token_id=vocab - 1,
                use_cache=False,
            )
            model = made(lambda: GPT2LMHeadModel(cfg))
        else:
            heads = max(4, width // 64)
            cfg = LlamaConfig(
                vocab_size=vocab,
                hidden_size=width,
                intermediate_size=2 * width,
                num_hidden_layers=layers,
                num_attention_heads=heads,
                num_key_value_heads=heads // 2,
                max_position_embeddings=seq,
                attention_dropout=0.1,
                use_cache=False,
            )
            model = made(lambda: LlamaForCausalLM(cfg))
        g = torch.Generator().manual_seed(0)
        ids = torch.randint(0, vocab, (batch, seq), generator=g)
        mask = torch.ones(batch, seq, dtype=torch.long)
        mask[-1, -3:] = 0  # a padded row: the mask reaches attention
        labels = torch.randint(0, vocab, (batch, seq), generator=g)
        return ZooCase(
            model.to(device),
            (ids.to(device),),
            {"attention_mask": mask.to(device)},
            token_loss,
            (labels.to(device),),
            layers,
        )

    return build


# CPU: small configs (a dry run); CUDA: a larger sample GPT and wider, deeper models.
MODELS = {
    "cpu": (
        ModelSpec("gpt-tiny", _sample_gpt("gpt-tiny")),
        ModelSpec("hf-gpt2", _hf("gpt2", 64, 2, 64, 2)),
        ModelSpec("hf-llama", _hf("llama", 64, 2, 64, 2)),
    ),
    "cuda": (
        ModelSpec("gpt-small-6l", _sample_gpt("gpt-small-6l")),
        ModelSpec("hf-gpt2", _hf("gpt2", 512, 6, 512, 4)),
        ModelSpec("hf-llama", _hf("llama", 512, 6, 512, 4)),
    ),
}


@dataclass
class Result:
    """One row: a plan of one model, precision and strategy, run by one runtime."""

    model: str
    precision: str
    strategy: str
    runtime: str
    traced: str = "here"  # "here": on the device measured; "cpu": on the CPU for it (a laptop)
    predicted: int | None = None  # bytes
    measured: int | None = None  # bytes beyond the step's starting allocation
    bound: int | None = None  # the allocator's lower bound (512 B rounding), bytes
    grads: str = ""  # "equal" or the max abs difference
    # eager's gradients against a second eager step from the same state: "equal", or the
    # spread of the device's nondeterministic kernels (CUDA's attention backward, atomics)
    eager_spread: str = ""
    time_ratio: float = math.nan  # step time / eager's, median of paired ratios
    note: str = ""  # a refusal or failure, in words

    @property
    def difference(self) -> int | None:
        """measured - predicted: SEED_BYTES on CPU when the prediction is exact."""
        if self.predicted is None or self.measured is None:
            return None
        return self.measured - self.predicted


@dataclass
class _Step:
    """How to run one step of a case: eager or a planned module, under the precision."""

    case: ZooCase
    autocast: Callable[[], AbstractContextManager[Any]]
    run: nn.Module | None = None  # the planned module; None: eager

    def __call__(self) -> torch.Tensor:
        c = self.case
        with self.autocast():
            if self.run is not None:
                if c.loss_fn is None:
                    loss = self.run(*c.args, **c.kwargs)
                else:
                    loss = self.run(*c.args, **c.kwargs, targets=c.targets)
            else:
                out = c.model(*c.args, **c.kwargs)
                loss = out if c.loss_fn is None else c.loss_fn(out, *c.targets)
        loss.backward()
        return loss


@dataclass
class _Bench:
    """Runs steps of one case from one starting state, and measures them on `device`."""

    case: ZooCase
    device: torch.device
    seed: int = 0
    start: dict[str, torch.Tensor] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not self.start:
            self.start = {k: v.detach().clone() for k, v in self.case.model.state_dict().items()}

    def reset(self) -> None:
        model = self.case.model
        model.load_state_dict(self.start)
        model.zero_grad(set_to_none=True)
        torch.manual_seed(self.seed)

    def grads(self, step: _Step) -> dict[str, torch.Tensor]:
        self.reset()
        step()
        return {
            n: p.grad.detach().clone()
            for n, p in self.case.model.named_parameters()
            if p.grad is not None
        }

    def peak(self, step: _Step) -> int:
        self.reset()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            before = torch.cuda.memory_allocated(self.device)
            step()
            torch.cuda.synchronize(self.device)
            return torch.cuda.max_memory_allocated(self.device) - before
        c = self.case
        given = [x for x in (*c.args, *c.kwargs.values(), *c.targets) if torch.is_tensor(x)]
        with StorageTracker(step_tensors(c.model, given)) as tracker:
            step()
        return tracker.peak

    def time(self, step: _Step) -> float:
        self.reset()
        self._sync()
        t = time.perf_counter()
        step()
        self._sync()
        return time.perf_counter() - t

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)


def grads_against(grads: dict[str, torch.Tensor], ref: dict[str, torch.Tensor]) -> str:
    """'equal' when every gradient is torch.equal to eager's, else the largest difference."""
    if grads.keys() != ref.keys():
        return f"different parameters have gradients ({len(grads)} vs eager's {len(ref)})"
    if all(torch.equal(grads[k], ref[k]) for k in ref):
        return "equal"
    worst = max((grads[k].float() - ref[k].float()).abs().max().item() for k in ref)
    return f"max |diff| {worst:.1e}"


def allocator_bound(problem: Problem, plan: Plan | SavedPlan) -> int:
    """The plan's peak with every storage rounded as the CUDA caching allocator rounds it
    (`core.allocator`), plus the rounded seed: the least `max_memory_allocated` can rise by
    on CUDA for this program."""
    graph = problem.graph
    sizes, initial, arriving = step_values(graph)
    rounded = {v: CUDA_CACHING.rounded(n) for v, n in sizes.items()}
    walked = walk(
        graph.ops,
        plan.program,
        plan.backward_start,
        rounded,
        initial=initial,
        arriving=arriving,
        final=graph.final_values,
    )
    return walked.peak + CUDA_CACHING.rounded(SEED_BYTES)


def _plans(problem: Problem) -> dict[str, Plan | str]:
    """Each strategy's plan, or its refusal in words."""
    out: dict[str, Plan | str] = {}
    for name in STRATEGIES:
        try:
            if name == "store_all":
                out[name] = core.solve(problem, problem.store_all_peak, "store_all")
            elif name == "checkpoint_blocks":
                out[name] = core.solve(problem, problem.store_all_peak, "checkpoint_blocks")
            else:
                method, fraction = OURS
                out[name] = core.solve(problem, fraction, method)
        except Exception as e:
            out[name] = _refusal(e)
    return out


def _refusal(e: BaseException) -> str:
    return f"{type(e).__name__}: {' '.join(str(e).split())}"[:400]


def _autocast(device: torch.device, precision: str) -> Callable[[], AbstractContextManager[Any]]:
    if precision == "fp32":
        return nullcontext
    return lambda: torch.autocast(device.type, torch.bfloat16)


def _planned(case: ZooCase, plan: Plan | SavedPlan, runtime: str) -> tuple[nn.Module, int]:
    """The planned module of `runtime` and the peak it predicts."""
    peak = plan.predicted_peak if isinstance(plan, Plan) else plan.prediction.peak
    if runtime == "interpreter":
        return core.apply_plan(case.model, plan, loss_fn=case.loss_fn), peak
    run = core.apply_plan(case.model, plan, runtime="native", loss_fn=case.loss_fn)
    handle = _handle(run)
    return run, handle.prediction.peak if handle is not None else peak


def _handle(run: nn.Module) -> NativeHandle | None:
    """The native wrappers a planned module runs, None for the interpreter."""
    return native_handle(run.model if isinstance(run, NativeStep) else run)


def validate_model(
    spec: ModelSpec,
    device: torch.device,
    preset: str,
    reps: int,
    log: Callable[[str], None] = lambda _: None,
) -> list[Result]:
    """Every row of one model: both precisions, every strategy, both runtimes."""
    rows: list[Result] = []
    for precision in PRECISIONS:
        try:
            case = spec.build(device)
            bench = _Bench(case, device)
            # native plans wrap the analysed model's layers (a plan binds to the model
            # analysed), so eager, the reference and the timing pairs, runs on a second
            # instance from the same state
            plain = _Bench(spec.build(device), device, start=bench.start)
        except Exception as e:
            rows += _failed_rows(spec.name, precision, f"model not built: {_refusal(e)}")
            continue
        autocast = _autocast(device, precision)
        eager = _Step(plain.case, autocast)
        try:
            with autocast():
                problem = _analyzed(case, preset, spec.name)
            ref = plain.grads(eager)
            spread = grads_against(plain.grads(eager), ref)
        except Exception as e:
            rows += _failed_rows(spec.name, precision, f"not analysed: {_refusal(e)}")
            continue
        log(
            f"{spec.name} {precision}: analysed, {len(problem.graph.ops)} ops"
            f"{_attention_ops(problem)}; eager against eager: {spread}"
        )
        for strategy, plan in _plans(problem).items():
            for runtime in RUNTIMES:
                row = Result(spec.name, precision, strategy, runtime, eager_spread=spread)
                rows.append(row)
                if isinstance(plan, str):
                    row.note = plan
                    continue
                _measure(row, bench, plain, eager, ref, problem, plan, reps)
                log(f"  {_line(row)}")
        if device.type == "cuda":
            laptop = _planned_on_cpu(spec, precision, bench, plain, eager, ref, preset, reps, log)
            for r in laptop:
                r.eager_spread = spread
            rows += laptop
    return rows


def _analyzed(case: ZooCase, preset: str, name: str) -> Problem:
    """`core.analyze` of a case's step for the device preset, under the caller's autocast."""
    return core.analyze(
        case.model,
        case.args,
        case.kwargs,
        loss_fn=case.loss_fn,
        targets=case.targets,
        device=preset,
        name=name,
    )


def _planned_on_cpu(
    spec: ModelSpec,
    precision: str,
    bench: _Bench,
    plain: _Bench,
    eager: _Step,
    ref: dict[str, torch.Tensor],
    preset: str,
    reps: int,
    log: Callable[[str], None],
) -> list[Result]:
    """The rows of plans made as a laptop makes them: the model on the CPU, traced for the
    GPU's preset (`core.analyze(..., device=preset)`: its attention kernels, its dropout, its
    autocast, the allocator's rounding), each plan saved, loaded and run on the GPU. The
    prediction is the CPU-traced plan's (native rows: `core.lower` of it)."""
    rows: list[Result] = []
    cpu = torch.device("cpu")
    try:
        case = spec.build(cpu)
        case.model.load_state_dict({k: v.to(cpu) for k, v in bench.start.items()})
        with _autocast(bench.device, precision)():
            problem = _analyzed(case, preset, spec.name)
    except Exception as e:
        note = f"not analysed on the CPU for {preset}: {_refusal(e)}"
        return [
            Result(spec.name, precision, s, r, traced="cpu", note=note)
            for s in STRATEGIES
            for r in RUNTIMES
        ]
    log(
        f"{spec.name} {precision}: analysed on the CPU for {preset}, "
        f"{len(problem.graph.ops)} ops{_attention_ops(problem)}"
    )
    for strategy, plan in _plans(problem).items():
        for runtime in RUNTIMES:
            row = Result(spec.name, precision, strategy, runtime, traced="cpu")
            rows.append(row)
            if isinstance(plan, str):
                row.note = plan
                continue
            try:
                loaded = SavedPlan.from_data(plan.to_data())
                predicted = (
                    plan.predicted_peak
                    if runtime == "interpreter"
                    else core.lower(plan).prediction.peak
                )
            except Exception as e:
                row.note = f"not saved and loaded: {_refusal(e)}"
                continue
            _measure(row, bench, plain, eager, ref, problem, loaded, reps, predicted)
            log(f"  {_line(row)}")
    return rows


def _line(r: Result) -> str:
    """One row as the log prints it while the matrix runs."""
    time_ratio = "-" if math.isnan(r.time_ratio) else f"{r.time_ratio:.2f}x"
    return (
        f"{r.strategy} {r.runtime} traced {r.traced}: predicted {_b(r.predicted)} measured "
        f"{_b(r.measured)} difference {_b(r.difference)} bound {_b(r.bound)} grads "
        f"{r.grads or '-'} (eager vs eager {r.eager_spread or '-'}) time {time_ratio} {r.note}"
    ).rstrip()


def _measure(
    row: Result,
    bench: _Bench,
    eager_bench: _Bench,
    eager: _Step,
    ref: dict[str, torch.Tensor],
    problem: Problem,
    plan: Plan | SavedPlan,
    reps: int,
    predicted: int | None = None,
) -> None:
    """Fill one row: build the runtime's module on `bench`'s model, then gradients, peak and
    times, each paired with an eager step on `eager_bench`'s. `predicted`: the peak to hold
    the measurement to, when not the bound plan's own."""
    try:
        run, row.predicted = _planned(bench.case, plan, row.runtime)
        if predicted is not None:
            row.predicted = predicted
    except Exception as e:
        row.note = f"{row.runtime} refused: {_refusal(e)}"
        return
    step = _Step(bench.case, eager.autocast, run)
    try:
        if row.runtime == "interpreter":
            row.bound = allocator_bound(problem, plan)
        row.grads = grads_against(bench.grads(step), ref)
        row.measured = bench.peak(step)
        ratios = []
        for _ in range(reps):
            before = eager_bench.time(eager)
            ratios.append(bench.time(step) / before)
        row.time_ratio = statistics.median(ratios) if ratios else math.nan
    except Exception as e:
        row.note = f"failed: {_refusal(e)}"
    finally:
        handle = _handle(run)
        if handle is not None:
            handle.remove()


@dataclass(frozen=True)
class KernelRow:
    """One `scaled_dot_product_attention` call: the kernel our rules pick for this device
    (`core.trace.attention.select`, what a plan made on a laptop assumes) and the one torch
    ran here."""

    call: str
    predicted: str
    ran: str


# the ATen ops each backend's kernel runs as (`scaled_dot_product_attention` in attention.cpp)
_KERNEL_OPS = {
    "_scaled_dot_product_flash_attention": "flash",
    "_scaled_dot_product_flash_attention_for_cpu": "flash",
    "_scaled_dot_product_efficient_attention": "efficient",
    "_scaled_dot_product_cudnn_attention": "cudnn",
    "_scaled_dot_product_attention_math": "math",
}


# torch._C._SDPBackend's values
_BACKEND_NAMES = {0: "math", 1: "flash", 2: "efficient", 3: "cudnn", 4: "overrideable"}


def attention_kernels(device: str = "cpu") -> list[KernelRow]:
    """Our attention rules against torch's pick, on calls shaped as training runs them
    (query, key and value needing gradients): dtypes, head dims, masks, causal, dropout,
    grouped heads."""
    from torch.utils._python_dispatch import TorchDispatchMode

    dev = torch.device(device)
    cap = torch.cuda.get_device_capability(dev) if dev.type == "cuda" else None

    class Ran(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.kernels: list[str] = []

        def __torch_dispatch__(
            self, func: Any, types: Any, args: Any = (), kwargs: Any = None
        ) -> Any:
            name = func.overloadpacket.__name__
            if name in _KERNEL_OPS:
                self.kernels.append(_KERNEL_OPS[name])
            return func(*args, **(kwargs or {}))

    rows = []
    g = torch.Generator(device=dev).manual_seed(0)
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        for d in (64, 80, 128, 256):
            for mask in ("none", "causal", "bool", "float"):
                for dropout in (0.0, 0.1):
                    for gqa in (False, True):
                        b, h, s = 2, 8, 256
                        kv = h // 2 if gqa else h
                        q = torch.randn(b, h, s, d, device=dev, dtype=dtype, generator=g)
                        k = torch.randn(b, kv, s, d, device=dev, dtype=dtype, generator=g)
                        v = torch.randn(b, kv, s, d, device=dev, dtype=dtype, generator=g)
                        for t in (q, k, v):  # as training calls it: all need gradients
                            t.requires_grad_(True)
                        m: torch.Tensor | None = None
                        if mask == "bool":
                            m = torch.ones(b, 1, s, s, device=dev, dtype=torch.bool).tril()
                        elif mask == "float":
                            m = torch.zeros(b, 1, s, s, device=dev, dtype=dtype)
                        try:
                            predicted = core.attention_kernel(
                                q,
                                k,
                                v,
                                m,
                                dropout,
                                mask == "causal",
                                enable_gqa=gqa,
                                device_type=dev.type,
                                capability=cap,
                            )
                        except Exception as e:
                            predicted = _refusal(e)
                        mode = Ran()
                        try:
                            with mode:
                                torch.nn.functional.scaled_dot_product_attention(
                                    q, k, v, m, dropout, mask == "causal", enable_gqa=gqa
                                )
                            ran = mode.kernels[0] if mode.kernels else "math (composite)"
                        except Exception as e:
                            ran = _refusal(e)
                        what = (
                            f"{str(dtype).removeprefix('torch.')} d{d} mask={mask} "
                            f"dropout={dropout} gqa={gqa}"
                        )
                        rows.append(KernelRow(what, predicted, ran))
    return rows


def format_kernels(rows: Sequence[KernelRow]) -> str:
    """The calls whose kernel our rules miss, then a count."""
    lines = [f"{r.call}: predicted {r.predicted}, ran {r.ran}" for r in rows if not _same(r)]
    hits = sum(_same(r) for r in rows)
    lines.append(f"attention kernels: {hits} of {len(rows)} calls as predicted")
    return "\n".join(lines)


def _same(r: KernelRow) -> bool:
    return r.ran == r.predicted or (r.predicted == "math" and r.ran.startswith("math"))


def _attention_ops(problem: Problem) -> str:
    """', attention kernels traced: aten._scaled_dot_product_cudnn_attention x 6' (the
    forward kernels the trace holds: on a GPU, torch's own pick at trace time)."""
    found = Counter(
        n.label
        for n in problem.graph.trace.nodes
        if "attention" in n.label and not n.label.endswith("backward")
    )
    said = ", ".join(f"{label} x {count}" for label, count in sorted(found.items()))
    return f", attention kernels traced: {said}" if said else ""


def _failed_rows(model: str, precision: str, note: str) -> list[Result]:
    return [Result(model, precision, s, r, note=note) for s in STRATEGIES for r in RUNTIMES]


def run_matrix(
    device: str = "cpu",
    models: Sequence[ModelSpec] | None = None,
    reps: int | None = None,
    preset: str | None = None,
    log: Callable[[str], None] = lambda _: None,
) -> list[Result]:
    """The whole matrix on `device` ("cpu" or "cuda[:i]"): one Result per model, precision,
    strategy and runtime, in that order."""
    dev = torch.device(device)
    kind = "cuda" if dev.type == "cuda" else "cpu"
    specs = MODELS[kind] if models is None else tuple(models)
    reps = reps if reps is not None else (5 if kind == "cuda" else 1)
    preset = preset or (_preset(dev) if kind == "cuda" else "cpu")
    rows: list[Result] = []
    with _one_thread(kind):
        for spec in specs:
            rows += validate_model(spec, dev, preset, reps, log)
    return rows


@contextmanager
def _one_thread(kind: str) -> Iterator[None]:
    """One CPU thread on the CPU (steady times on a shared machine); as is on a GPU."""
    if kind != "cpu":
        yield
        return
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def _preset(device: torch.device) -> str:
    """The core.costs preset of the GPU at hand (by its name), h100 when unknown."""
    name = torch.cuda.get_device_name(device).lower()
    return next((p for p in ("a100", "h100", "v100", "rtx4090") if p[:4] in name), "h100")


COLUMNS = (
    "model",
    "precision",
    "strategy",
    "runtime",
    "traced",
    "predicted",
    "measured",
    "measured-predicted",
    "allocator bound",
    "grads vs eager",
    "eager vs eager",
    "time / eager",
    "note",
)


def format_table(rows: Sequence[Result]) -> str:
    """One plain-text table of every row, bytes in B (exact) and the note last."""
    cells = [COLUMNS] + [
        (
            r.model,
            r.precision,
            r.strategy,
            r.runtime,
            r.traced,
            _b(r.predicted),
            _b(r.measured),
            _b(r.difference),
            _b(r.bound),
            r.grads or "-",
            r.eager_spread or "-",
            "-" if math.isnan(r.time_ratio) else f"{r.time_ratio:.2f}x",
            r.note,
        )
        for r in rows
    ]
    widths = [max(len(str(c[i])) for c in cells) for i in range(len(COLUMNS) - 1)]
    lines = []
    for c in cells:
        lead = "  ".join(str(x).ljust(w) for x, w in zip(c[:-1], widths))
        lines.append(f"{lead}  {c[-1]}".rstrip())
    lines.insert(1, "-" * len(lines[0]))
    return "\n".join(lines)


def _b(n: int | None) -> str:
    return "-" if n is None else str(n)


def summary(rows: Sequence[Result], device: str) -> str:
    """One line: rows run, exact (CPU) or within the allocator's bound (CUDA), refused."""
    ran = [r for r in rows if r.measured is not None]
    refused = len(rows) - len(ran)
    equal = sum(r.grads == "equal" for r in ran)
    if device.startswith("cuda"):
        within = sum(r.bound is not None and r.measured >= r.bound for r in ran if r.measured)
        memory = f"{within} of {sum(r.bound is not None for r in ran)} at or above the bound"
    else:
        # the seed is allocated as the backward starts: a step peaking in the forward
        # measures its prediction to the byte
        exact = sum(r.difference in (0, SEED_BYTES) for r in ran)
        memory = (
            f"{exact} exact (measured = predicted + {SEED_BYTES} B, or = predicted where the "
            "step peaks before the backward's seed)"
        )
    return (
        f"{len(rows)} rows: {len(ran)} ran ({memory}; {equal} with gradients equal to "
        f"eager's), {refused} refused or failed"
    )


def main(argv: Sequence[str] | None = None) -> int:
    """`remat bench --validate [--device cuda] [--reps N] [--preset h100]`."""
    p = argparse.ArgumentParser(prog="remat bench --validate", description=__doc__)
    p.add_argument("--device", default="cpu", help="cuda (the GPU at hand) or cpu (dry run)")
    p.add_argument("--reps", type=int, help="paired timing repetitions (default cuda 5, cpu 1)")
    p.add_argument("--preset", help="core.costs preset for op times (default: from the GPU)")
    p.add_argument("--models", nargs="+", help="these models of the matrix only (default: all)")
    args = p.parse_args(list(argv) if argv is not None else None)
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        print(f"--device {args.device}: no CUDA device here; `--device cpu` runs the dry run")
        return 2
    if not (args.device == "cpu" or args.device.startswith("cuda")):
        print(f"--device {args.device}: choose cuda or cpu")
        return 2
    start = time.perf_counter()
    where = torch.cuda.get_device_name(args.device) if args.device != "cpu" else "CPU"
    print(f"remat bench --validate on {where}, torch {torch.__version__}", flush=True)
    if args.device != "cpu":
        order = [_BACKEND_NAMES.get(b, str(b)) for b in torch._C._get_sdp_priority_order()]
        print(
            f"CUDA {torch.version.cuda}, cuDNN {torch.backends.cudnn.version()}, capability "
            f"{torch.cuda.get_device_capability(args.device)}, attention order {order}",
            flush=True,
        )
    print(format_kernels(attention_kernels(args.device)), flush=True)
    kind = "cpu" if args.device == "cpu" else "cuda"
    specs = [m for m in MODELS[kind] if args.models is None or m.name in args.models]
    if not specs:
        names = ", ".join(m.name for m in MODELS[kind])
        print(f"--models {' '.join(args.models)}: none of this device's models ({names})")
        return 2
    rows = run_matrix(
        args.device,
        models=specs,
        reps=args.reps,
        preset=args.preset,
        log=lambda text: print(text, flush=True),
    )
    print(format_table(rows))
    print(summary(rows, args.device))
    print(
        f"in {time.perf_counter() - start:.0f} s; bytes in B; allocator bound: "
        f"{CUDA_CACHING.bound()}"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
