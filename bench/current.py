"""`remat bench --strategies`: what the strategies users already run cost, predicted and
measured, and our native plan at each one's own measured peak.

Per model, every strategy of `core.strategies` runs by its own mechanism (transformers' or
diffusers' gradient checkpointing, `checkpoint_wrapper` with torchtitan's policy, torchtune's
offload hooks (replicated on CPU), PyTorch's auto-SAC at 50% and 30% of the store-all peak),
plus torch.compile's `activation_memory_budget`, which its partitioner decides inside the
compiled graph: measured only (allocator profile), never predicted. For each strategy's
measured peak P, ours is `core.solve(problem, P - 4, method="native")` (a plan whose native
prediction fits what the strategy used), applied natively to a copy of the model sharing its
parameters, and that copy compiled (`--backend`).

Rows: predicted peak (the native simulation; auto-SAC also its own bound), measured peak
(storage tracker; compiled rows: allocator profile), gradients against eager's (max abs
difference; "equal" when every one is torch.equal), and time over eager's: `reps` rounds, in
each an eager step then every row's step, each ratio against that round's eager step;
medians. One thread (`bench_settings`).
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

import core
from bench.measure import Runner, bench_settings, bit_equal, grad_error
from bench.strategies import _compile_backend, shared_copy
from core import InfeasibleBudget, native_handle, strategies

MODELS = ("gpt-tiny", "hf-gpt2", "hf-llama", "diffusers-unet")
AUTOSAC_BUDGETS = (0.5, 0.3)  # fractions of the store-all peak, as the issue asks
COMPILE_BUDGET = 0.5  # torch._functorch.config.activation_memory_budget

Step = Callable[[Sequence[torch.Tensor]], torch.Tensor]


@dataclass
class Row:
    """One strategy's step on one model, measured."""

    model: str
    key: str
    name: str
    predicted: float = math.nan  # bytes, the native simulation
    bound: float = math.nan  # auto-SAC's own peak bound, less the parameters
    peak: float = math.nan
    peak_source: str = "tracker"
    grad_error: float = math.nan
    grads_equal: bool = False
    ratios: list[float] = field(default_factory=list)
    times: list[float] = field(default_factory=list)
    note: str = ""
    rival: str = ""  # ours rows: the strategy whose measured peak they were planned for

    @property
    def ratio(self) -> float:
        return statistics.median(self.ratios) if self.ratios else math.nan


@dataclass(frozen=True)
class Case:
    """A model as users call it: `loss_fn(model(*args, **kwargs), *targets)`."""

    model: nn.Module
    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    loss_fn: Callable[..., torch.Tensor] | None
    targets: tuple[torch.Tensor, ...]

    def tensors(self) -> tuple[torch.Tensor, ...]:
        kw = tuple(v for v in self.kwargs.values() if isinstance(v, torch.Tensor))
        return (*[a for a in self.args if isinstance(a, torch.Tensor)], *kw, *self.targets)

    def step(self, run: Callable[..., Any]) -> Step:
        """A bench step: forward through `run`, the loss, backward; returns the loss."""

        def fn(_inputs: Sequence[torch.Tensor]) -> torch.Tensor:
            if self.loss_fn is None:
                loss = run(*self.args, **self.kwargs)
            else:  # the output is not held through the backward (its logits would be)
                loss = self.loss_fn(run(*self.args, **self.kwargs), *self.targets)
            loss.backward()
            return loss

        return fn

    def planned_step(self, planned: Callable[..., Any]) -> Step:
        """A bench step of a natively planned model: with a loss_fn, `apply_plan` gives a
        step module taking the targets as `targets=` and returning the loss."""
        if self.loss_fn is None:
            return self.step(planned)

        def fn(_inputs: Sequence[torch.Tensor]) -> torch.Tensor:
            loss = planned(*self.args, **self.kwargs, targets=self.targets)
            loss.backward()
            return loss

        return fn


def build(name: str) -> Case:
    """The bench's models: a sample model by name (`gpt-tiny`, `gpt-small-6l`), Hugging Face
    GPT-2 and Llama (`hf-gpt2`/`hf-llama`: the zoo's 2-layer configs; `hf-gpt2-4l`/
    `hf-llama-4l`: 4 layers, hidden 256, 256 tokens), at their defaults (SDPA attention,
    dropout), the diffusers U-Net of `sample_models.diffusers_zoo`, and `transformer-encoder`:
    torch's `nn.TransformerEncoder`, 4 layers of d256, 4 heads, 4 x 256 tokens, an MSE loss
    outside."""
    if name in ("hf-gpt2", "hf-llama"):  # the zoo's tiny configs (2 layers, hidden 32)
        from sample_models import hf_zoo

        c = hf_zoo.ZOO[name]()
        kwargs = {**c.kwargs, "use_cache": False}
        return Case(c.model, tuple(c.args), kwargs, c.loss_fn, tuple(c.targets))
    if name.startswith("hf-"):
        from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

        from sample_models.hf_zoo import token_loss
        from sample_models.zoo import made

        seq, d = 256, 256
        g = torch.Generator().manual_seed(0)
        ids, labels = (torch.randint(0, 128, (2, seq), generator=g) for _ in range(2))
        if name == "hf-gpt2-4l":
            cfg: Any = GPT2Config(
                vocab_size=128,
                n_positions=seq,
                n_embd=d,
                n_layer=4,
                n_head=4,
                bos_token_id=127,
                eos_token_id=127,
            )
            model: Any = made(lambda: GPT2LMHeadModel(cfg))
        else:
            cfg = LlamaConfig(
                vocab_size=128,
                hidden_size=d,
                intermediate_size=4 * d,
                num_hidden_layers=4,
                num_attention_heads=4,
                num_key_value_heads=2,
                max_position_embeddings=seq,
            )
            model = made(lambda: LlamaForCausalLM(cfg))
        return Case(model, (ids,), {"use_cache": False}, token_loss, (labels,))
    if name == "transformer-encoder":  # torch's own layers at their defaults (dropout 0.1)
        from sample_models.zoo import made

        g = torch.Generator().manual_seed(0)

        def encoder() -> nn.Module:
            layer = nn.TransformerEncoderLayer(256, 4, 1024, batch_first=True)
            return nn.TransformerEncoder(layer, 4, enable_nested_tensor=False)

        x, y = (torch.randn(4, 256, 256, generator=g) for _ in range(2))
        return Case(made(encoder), (x,), {}, nn.functional.mse_loss, (y,))
    if name == "diffusers-unet":
        from sample_models import diffusers_zoo

        c = diffusers_zoo.unet()
        return Case(c.model, tuple(c.args), dict(c.kwargs), c.loss_fn, tuple(c.targets))
    import sample_models

    model, inputs = sample_models.build(name)
    return Case(model, tuple(inputs), {}, None, ())


def _imports(
    case: Case,
    problem: core.Problem,
    log: Callable[[str], None],
    budgets: Sequence[float],
    only: Sequence[str] = (),
) -> list[strategies.Imported]:
    """Every strategy that applies to the model (torchtitan's wraps a transformer's layers:
    not the U-Net; auto-SAC's units there are the resnets diffusers checkpoints)."""
    out: list[strategies.Imported] = []
    makers: list[tuple[str, Callable[[], strategies.Imported]]] = [
        ("hf", lambda: strategies.hf_checkpointing(problem)),
        ("torchtitan", lambda: strategies.torchtitan_selective(problem)),
        ("torchtune", lambda: strategies.torchtune_offload(problem)),
    ]
    diffusers = hasattr(case.model, "enable_gradient_checkpointing")
    units = strategies.diffusers_checkpointed(problem) if diffusers else None
    for b in budgets:

        def autosac(b: float = b) -> strategies.Imported:
            return strategies.autosac(problem, b, case.args, case.kwargs, case.targets, units=units)

        makers.append((f"autosac@{b:.0%}", autosac))
    for key, make in makers:
        if only and not any(key.startswith(k) for k in only):
            continue
        if key == "torchtitan" and diffusers:
            log(f"{key}: not applied (torchtitan wraps a transformer's `layers`)")
            continue
        try:
            started = time.perf_counter()
            imported = make()
            log(f"{key}: imported in {time.perf_counter() - started:.1f} s")
        except strategies.NotApplicable as e:
            log(f"{key}: {e}")
            continue
        except Exception as e:  # the strategy's own code failed on this model: say so
            log(f"{key}: its own code failed: {type(e).__name__}: {str(e)[:160]}")
            continue
        out.append(imported)
    return out


def bench_model(
    name: str,
    reps: int,
    backend: str | None,
    log: Callable[[str], None],
    autosac: Sequence[float] = AUTOSAC_BUDGETS,
    only: Sequence[str] = (),
) -> list[Row]:
    """Every row of one model (see the module's docstring)."""
    torch._dynamo.reset()
    case = build(name)
    model = case.model
    runner = Runner(model, case.tensors())
    started = time.perf_counter()
    problem = core.analyze(
        model, case.args, case.kwargs, case.loss_fn, case.targets, costs="measured", name=name
    )
    log(f"analysed (measured costs) in {time.perf_counter() - started:.1f} s")
    rows: list[tuple[Row, Step]] = [(Row(name, "eager", "eager PyTorch"), case.step(model))]
    for imp in _imports(case, problem, log, autosac, only):
        row = Row(
            name, imp.key if imp.key != "autosac" else f"autosac@{_frac(imp, problem)}", imp.name
        )
        row.predicted = imp.prediction.peak
        if imp.bound is not None:
            row.bound = imp.bound
        if imp.key == "autosac" and not imp.modules:
            row.note = "sac_milp: no solution at this budget (nothing checkpointed)"
        if imp.key == "torchtune" and next(model.parameters()).device.type == "cpu":
            row.note = "torchtune refuses CPU: its single-stream rule replicated"
        rows.append((row, case.step(_under(imp, model))))
    if backend is not None and (not only or any("compile".startswith(k) for k in only)):
        # a copy sharing the parameters: the other strategies swap and flag the model's
        # layers, which would fail dynamo's guards and recompile at every call
        compiled = torch.compile(
            shared_copy(model), backend=_compile_backend(backend, COMPILE_BUDGET)
        )
        rows.append(
            (
                Row(
                    name,
                    f"compile@{COMPILE_BUDGET}",
                    f"torch.compile {backend}, activation_memory_budget {COMPILE_BUDGET}",
                    peak_source="profiler" if backend == "inductor" else "tracker",
                    note="the partitioner decides: measured, not predicted",
                ),
                case.step(compiled),
            )
        )
    eager_grads = runner.grads(rows[0][1])
    for row, step in list(rows):
        _check(runner, row, step, eager_grads, log)
    rivals = [
        (r, s) for r, s in rows[1:] if not math.isnan(r.peak) and not r.note.startswith("failed")
    ]
    for rival, _ in rivals:
        if rival.key.startswith("autosac") and "no solution" in rival.note:
            continue
        rows += _ours(case, problem, rival, backend, runner, eager_grads, log)
    live = [(r, s) for r, s in rows if not math.isnan(r.peak)]
    for rep in range(reps):
        for row, step in live[1:]:
            before = runner.time(rows[0][1])
            rows[0][0].times.append(before)
            row.times.append(runner.time(step))
            row.ratios.append(row.times[-1] / before)
        log(f"timed round {rep + 1}/{reps}")
    return [r for r, _ in rows]


def _under(imp: strategies.Imported, model: nn.Module) -> Callable[..., Any]:
    """The model's forward under the strategy's own mechanism (the loss outside it, as
    `Imported.step` runs it)."""

    def run(*args: Any, **kwargs: Any) -> Any:
        with imp.running(model):
            return model(*args, **kwargs)

    return run


def _frac(imp: strategies.Imported, problem: core.Problem) -> str:
    want = int(imp.name.split(" at ")[1].split(" B")[0].replace(",", ""))
    return f"{want / problem.store_all_peak:.0%}"


def _check(runner: Runner, row: Row, step: Step, eager: list, log: Callable[[str], None]) -> None:
    """Gradients against eager's and the peak, into the row; a failure is noted."""
    try:
        grads = runner.grads(step)
        row.grad_error, _ = grad_error(grads, eager)
        row.grads_equal = bit_equal(grads, eager)
        row.peak = runner.peak(step, row.peak_source)
    except Exception as e:  # a strategy failing must not stop the bench: its row says why
        row.note = f"failed: {type(e).__name__}: {str(e)[:120]}"
        log(f"{row.key} {row.note}")


def _ours(
    case: Case,
    problem: core.Problem,
    rival: Row,
    backend: str | None,
    runner: Runner,
    eager: list,
    log: Callable[[str], None],
) -> list[tuple[Row, Step]]:
    """Our native plan at the rival's measured peak (the tracker's 4-byte seed aside), and
    it compiled."""
    budget = int(rival.peak) - 4
    try:
        plan = core.solve(problem, budget, method="native")
    except InfeasibleBudget as e:
        log(f"ours at {rival.key}'s peak: infeasible (native minimum {e.minimum:,} B)")
        note = f"no native plan fits {budget:,} B (native minimum {e.minimum:,} B)"
        return [
            (
                Row(rival.model, f"ours@{rival.key}", "ours native", note=note, rival=rival.key),
                case.step(case.model),
            )
        ]
    copy = shared_copy(case.model)
    native = core.apply_plan(copy, plan, runtime="native", loss_fn=case.loss_fn)
    handle = native_handle(native)
    assert handle is not None
    row = Row(rival.model, f"ours@{rival.key}", "ours native", rival=rival.key)
    row.predicted = handle.prediction.peak
    out = [(row, case.planned_step(native))]
    if backend is not None:
        crow = Row(
            rival.model,
            f"ours-compiled@{rival.key}",
            f"ours native, torch.compile {backend}",
            peak_source="profiler" if backend == "inductor" else "tracker",
            rival=rival.key,
        )
        out.append((crow, case.planned_step(torch.compile(native, backend=backend))))
    for r, s in out:
        _check(runner, r, s, eager, log)
    log(
        f"ours at {rival.key}'s peak: native predicted {row.predicted:,.0f} B, measured {row.peak:,.0f} B"
    )
    return out


# ---------------------------------------------------------------------------------------------
# Report


def _b(x: float) -> str:
    return "-" if math.isnan(x) else f"{int(x):,}"


def table(rows: Sequence[Row]) -> str:
    """The markdown table: one line per row, ours after the strategies they answer."""
    head = (
        "| model | row | predicted peak | measured peak | measured - predicted | "
        "time / eager | gradients vs eager | note |\n|---|---|---|---|---|---|---|---|\n"
    )
    lines = []
    for r in rows:
        diff = (
            "-"
            if math.isnan(r.predicted) or math.isnan(r.peak)
            else f"{int(r.peak - r.predicted):+,} B"
        )
        if not math.isnan(r.bound):
            diff += f" (its bound {int(r.bound):,})"
        grads = (
            "-"
            if math.isnan(r.grad_error)
            else ("equal" if r.grads_equal else f"{r.grad_error:.1e}")
        )
        ratio = "1.000" if r.key == "eager" else ("-" if math.isnan(r.ratio) else f"{r.ratio:.3f}")
        source = " (profile)" if r.peak_source == "profiler" else ""
        lines.append(
            f"| {r.model} | {r.key} | {_b(r.predicted)} | {_b(r.peak)}{source} | {diff} | "
            f"{ratio} | {grads} | {r.note} |"
        )
    return head + "\n".join(lines) + "\n"


def verdicts(rows: Sequence[Row]) -> list[str]:
    """Per strategy row: ours native (and compiled) at its measured peak, faster or not."""
    out = []
    by = {(r.model, r.key): r for r in rows}
    for r in rows:
        if r.rival:
            continue
        ours = by.get((r.model, f"ours@{r.key}"))
        comp = by.get((r.model, f"ours-compiled@{r.key}"))
        if ours is None or math.isnan(ours.ratio) or math.isnan(r.ratio):
            continue
        fits = "fits" if ours.peak <= r.peak else "ABOVE"
        line = (
            f"{r.model} {r.key}: {r.ratio:.3f} vs ours native {ours.ratio:.3f} "
            f"({'faster' if ours.ratio < r.ratio else 'not faster'}; peak {fits})"
        )
        if comp is not None and not math.isnan(comp.ratio):
            line += f", compiled {comp.ratio:.3f}"
        out.append(line)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="remat bench --strategies", description=__doc__)
    p.add_argument("--models", default=",".join(MODELS))
    p.add_argument("--reps", type=int, default=5)
    p.add_argument(
        "--backend",
        default="inductor",
        help="torch.compile backend of the compiled rows, or 'none' (default inductor)",
    )
    p.add_argument(
        "--autosac",
        default=",".join(str(b) for b in AUTOSAC_BUDGETS),
        help="auto-SAC's budgets, fractions of the store-all peak (default 0.5,0.3)",
    )
    p.add_argument("--out", default="results/strategies")
    p.add_argument("--only", default="", help="strategy keys to keep (prefixes: autosac,hf)")
    args = p.parse_args(argv)
    backend = None if args.backend == "none" else args.backend
    autosac = tuple(float(b) for b in args.autosac.split(",") if b)
    only = tuple(k for k in args.only.split(",") if k)
    rows: list[Row] = []
    load = os.getloadavg()
    started = time.perf_counter()
    with bench_settings():
        for name in args.models.split(","):

            def log(msg: str, name: str = name) -> None:
                print(f"  {name}: {msg}", flush=True)

            rows += bench_model(name, args.reps, backend, log, autosac, only)
            print(table([r for r in rows if r.model == name]), flush=True)
    text = (
        f"torch {torch.__version__}, 1 thread, {args.reps} paired rounds, load average at start "
        f"{load[0]:.1f}/{load[1]:.1f}/{load[2]:.1f} (1/5/15 min), at end "
        f"{'/'.join(f'{x:.1f}' for x in os.getloadavg())}; "
        f"{time.perf_counter() - started:.0f} s\n\n"
        + table(rows)
        + "\n"
        + "\n".join(f"- {v}" for v in verdicts(rows))
        + "\n"
    )
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "strategies.md").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
