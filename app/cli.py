"""`remat` (the console script): inspect a model's chain, make and show plans, run benchmarks
(`bench/`), serve the app."""

# torch, dash and the engine are imported by the commands that need them, never here: `remat
# --help` and an argument error answer at once (7 s of imports here before).

from __future__ import annotations

import argparse
import re
import sys
import time
import traceback
from collections.abc import Callable
from importlib.metadata import entry_points
from typing import Any

FIT_DEVICE = "h100"  # `remat fit`'s op times when no --device is given (said in its output)
FIT_DEVICES = ("h100", "a100", "v100", "rtx4090", "cpu")
# `remat fit`'s largest batch by default: each batch size tried is a trace (seconds); 1024
# reaches any sample model's answer on a 24 GiB device, and a capped answer says "N+"
FIT_MAX_BATCH = 1024


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    try:
        args, rest = parser.parse_known_args(argv)
    except SystemExit as done:  # --help (0) or a usage error, already printed (2)
        return done.code if isinstance(done.code, int) else 2
    if rest and not getattr(args, "passes_rest", False):
        parser.error(f"unrecognized arguments: {' '.join(rest)}")
    try:
        _check_args(args)  # before any import of the engine or analysis
        return args.run(args, rest)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except Exception as e:
        if not _user_error(e):
            raise
        if args.debug:
            traceback.print_exc()
        print(f"error: {e}", file=sys.stderr)
        return 2


def _user_error(e: BaseException) -> bool:
    """An error in words for the user (the engine's `RematError`s, a missing extra, a bad
    value, a file): one line, no traceback. The engine's class is looked up only where it was
    imported, so a command that never needed it pays nothing."""
    kinds: list[type] = [ValueError, OSError]
    errors = sys.modules.get("core.errors")
    if errors is not None:
        kinds.append(errors.RematError)
    return isinstance(e, tuple(kinds))


def fmt_bytes(n: float) -> str:
    """Bytes in words (`core.fmt_bytes`, imported when first needed)."""
    from core import fmt_bytes as words

    return words(n)


_AMOUNT = r"([0-9]*\.?[0-9]+(?:e[+-]?\d+)?)"
_MEMORY_UNITS = {"b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12}
_MEMORY_UNITS |= {"kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def _check_args(args: argparse.Namespace) -> None:
    """Read --budget and --memory before anything is analysed (the command line's forms;
    --memory becomes bytes), or raise a ValueError saying what a valid one looks like."""
    budget = getattr(args, "budget", None)
    if budget is not None:
        spelled = budget.strip().lower().replace(" ", "")
        m = re.fullmatch(_AMOUNT + r"(%|[kmgt]?i?b)?", spelled)
        if not m or float(m.group(1)) <= 0:
            raise ValueError(
                f"cannot read the budget {budget!r}: write bytes with a unit ('2GB', "
                "'512MiB'), a percentage of the store-all peak ('50%') or a fraction of it "
                "('0.5')"
            )
    memory = getattr(args, "memory", None)
    if isinstance(memory, list):
        args.memory = [_memory(m) for m in memory]
    elif memory is not None:
        args.memory = _memory(memory)


def _memory(text: str) -> int:
    """An amount of memory with its unit ('24GiB', '80GB'), in bytes."""
    m = re.fullmatch(_AMOUNT + r"([kmgt]?i?b)", text.strip().lower().replace(" ", ""))
    if not m or float(m.group(1)) <= 0:
        raise ValueError(
            f"--memory takes bytes with a unit, e.g. 24GiB, 80GB or 512MiB, not {text!r}"
        )
    return int(float(m.group(1)) * _MEMORY_UNITS[m.group(2)])


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="remat", description=__doc__)
    p.add_argument("--debug", action="store_true", help="show tracebacks on errors")
    sub = p.add_subparsers(dest="command", required=True)

    def model_args(s: argparse.ArgumentParser) -> None:
        s.add_argument(
            "model",
            help="sample name (e.g. gpt-tiny) or package.module:callable (the working "
            "directory is searched first, as by python -m)",
        )
        s.add_argument("--costs", default="estimated", choices=["estimated", "measured"])
        s.add_argument("--device", default="cpu", help="device preset for estimated costs")

    s = sub.add_parser("inspect", help="print the chain of blocks of a model")
    model_args(s)
    s.set_defaults(run=_inspect)

    s = sub.add_parser("plan", help="solve for a budget and write a plan file")
    model_args(s)
    s.add_argument(
        "--budget",
        help="bytes ('2GB', '512MiB', '4096'), a percentage ('50%%') or a fraction ('0.5') "
        "of the store-all peak (required unless --devices)",
    )
    s.add_argument(
        "--method",
        default="rockmate",
        help="rockmate (default), native, rotor, checkmate, checkpoint_blocks, sqrt_n, "
        "store_all, offload, pofo; or what a strategy you run costs: hf, torchtitan, "
        "torchtune, autosac (docs/results.md)",
    )
    s.add_argument("--devices", type=int, help="plan a parallel layout instead: `remat parallel`")
    s.add_argument("--memory", help="with --devices: memory of each device ('80GiB')")
    s.add_argument("--link", default=None, help="with --devices: nvlink4, pcie4, ...")
    s.add_argument("-o", "--output", default="plan.pkl")
    s.add_argument(
        "-v",
        "--verbose",
        action="store_true",
        help="also print the solver's notes (where its searches stopped, what it tried)",
    )
    s.set_defaults(run=_plan)

    s = sub.add_parser(
        "parallel", help="choose a data x tensor-parallel layout for N devices (docs/parallel.md)"
    )
    model_args(s)
    s.add_argument("--devices", type=int, required=True, help="number of devices")
    s.add_argument("--memory", required=True, help="memory of each device ('80GiB', '24GB')")
    s.add_argument("--link", default=None, help="nvlink4, nvlink3, pcie4, ... (default: device's)")
    s.set_defaults(run=_parallel)

    _fit_parser(sub, model_args)

    s = sub.add_parser("show", help="describe a plan file")
    s.add_argument("path")
    s.add_argument("-v", "--verbose", action="store_true", help="also print the solver's notes")
    s.set_defaults(run=_show)

    for name, command in _plugins().items():  # `remat bench`, registered by bench/
        s = sub.add_parser(name, help=command.HELP, add_help=False)
        command.add_arguments(s)
        s.set_defaults(run=command.run, passes_rest=True)

    s = sub.add_parser("link", help="measure the host link offloading plans copy over")
    s.add_argument("--device", default=None, help="torch device (default: cuda if present)")
    s.set_defaults(run=_link)

    s = sub.add_parser("app", help="serve the Dash app")
    s.add_argument("--host", default="127.0.0.1")
    s.add_argument("--port", type=_port, default=8050, help="TCP port, 0-65535")
    s.add_argument(
        "--model",
        action="append",
        default=[],
        help="add package.module:callable to the models; give it several times for several "
        "(the page opens on the first)",
    )
    s.add_argument("--app-debug", action="store_true", help="Dash debug mode (reloader, dev tools)")
    s.add_argument(
        "--offload-method",
        default="offload",
        help="the offloading solver the page's offload switch re-solves with (default: offload)",
    )
    s.set_defaults(run=_app)
    return p


def _analyze(args: argparse.Namespace):
    from rich.progress import Progress

    from app.models import load_model

    call = load_model(args.model)
    with Progress(transient=True) as bar:
        task = bar.add_task("analysing", total=1.0)

        def report(stage: str, frac: float) -> None:
            bar.update(task, completed=frac, description=stage)

        start = time.perf_counter()
        problem = call.analyze(
            costs=args.costs, device=args.device, name=args.model, progress=report
        )
    return call.model, problem, time.perf_counter() - start


def _inspect(args: argparse.Namespace, rest: list[str]) -> int:
    from rich.console import Console
    from rich.table import Table

    _, problem, seconds = _analyze(args)
    kinds: dict[int, list[int]] = {}
    for b in problem.blocks:
        kinds.setdefault(b.kind, []).append(b.index)
    table = Table(title=f"{args.model}: chain of {len(problem.blocks)} blocks")
    for col in ("block", "module", "fwd ops", "bwd ops", "activations", "fwd time", "bwd time"):
        table.add_column(col, justify="left" if col == "module" else "right")
    table.add_column("identical to")
    for b in problem.blocks:
        same = [i for i in kinds[b.kind] if i != b.index]
        table.add_row(
            str(b.index),
            b.name,
            str(len(b.forward_ops)),
            str(len(b.backward_ops)),
            fmt_bytes(b.activation_bytes),
            f"{b.forward_time * 1e3:.2f} ms",
            f"{b.backward_time * 1e3:.2f} ms",
            _ranges(same) if same else "",
        )
    console = Console(width=max(120, Console().width))
    console.print(table)
    graph = problem.graph
    console.print(
        f"ops: {len(graph.ops)} ({len(graph.trace.nodes)} ATen nodes), "
        f"parameters: {fmt_bytes(problem.param_bytes)}, inputs: {fmt_bytes(problem.input_bytes)}\n"
        f"store_all_peak: {fmt_bytes(problem.store_all_peak)} ({problem.store_all_peak} bytes), "
        f"store-all time: {problem.store_all_time * 1e3:.1f} ms ({problem.cost_model} costs)\n"
        f"floor: {problem.floor.nbytes / problem.store_all_peak:.1%} of store-all, no plan goes "
        f"below it: {problem.floor.describe()}\n"
        + (f"{problem.attention}\n" if problem.attention else "")
        + f"core.analyze took {seconds:.1f} s"
    )
    return 0


def _plan(args: argparse.Namespace, rest: list[str]) -> int:
    import core

    if args.devices is not None:
        if args.memory is None:
            raise ValueError("--devices needs --memory, each device's memory (e.g. 80GiB)")
        return _parallel(args, rest)
    if args.method in ("hf", "torchtitan", "torchtune", "autosac"):  # what it costs today
        from core import parse_budget, strategies

        model, problem, _ = _analyze(args)  # the strategy runs on the model: keep it
        budget = args.budget and parse_budget(args.budget, problem.store_all_peak)
        print(strategies.describe(strategies.by_method(problem, args.method, budget)))
        return 0
    if args.budget is None:
        raise ValueError("remat plan needs --budget (e.g. 50%, 2GiB), or --devices N --memory M")
    model, problem, _ = _analyze(args)  # kept: native lowering runs the model again
    method = args.method
    plan = core.solve(problem, args.budget, method=method)
    plan.save(args.output)
    if args.verbose:  # the solver's own bookkeeping: for whoever tunes it
        for note in plan.notes:
            print(f"note: {note}")
    # a native plan runs as selective checkpoints: its peak and time are the native step's
    native = core.lower(plan) if method == "native" else None
    ran = native.prediction if native else plan.prediction
    recomputed = native.recomputed_ops if native else plan.recomputed_ops
    runtime = " (runtime='native')" if native else ""
    print(
        f"{method} plan for {args.model} at {fmt_bytes(plan.budget)}: predicted peak{runtime} "
        f"{fmt_bytes(ran.peak)} ({ran.peak / problem.store_all_peak:.0%} of "
        f"store-all), overhead {ran.overhead - 1:+.1%}, {recomputed} recomputed ops; "
        f"solved in {plan.solve_seconds:.2f} s; written to {args.output}"
    )
    if plan.predicted_host_bytes:
        sim = plan.simulate()
        print(
            f"  offloads {sum(t.kind == 'offload' for t in sim.transfers)} values: at most "
            f"{fmt_bytes(sim.host_peak)} on the host (pool {fmt_bytes(sim.host_pool)}), "
            f"compute waits {sim.stall * 1e3:.2f} ms for prefetches"
        )
    return 0


def _parallel(args: argparse.Namespace, rest: list[str]) -> int:
    from rich.console import Console
    from rich.table import Table

    import core

    model, problem, _ = _analyze(args)
    start = time.perf_counter()
    pp = core.parallel_plan(
        problem, args.devices, args.memory, args.device, model=model, link=args.link
    )
    seconds = time.perf_counter() - start
    console = Console(width=max(120, Console().width))
    best = pp.best
    head = (
        f"{args.model} on {args.devices} x {fmt_bytes(pp.memory)} ({args.device}, {pp.link.name})"
    )
    if best is None:
        console.print(f"{head}: no layout fits; the closest:")
    else:
        console.print(f"{head}: {best.name} (dp {best.dp}, tp {best.tp}, {best.data})")
        for line in best.kinds:
            console.print(f"  {line}")
    first = [x for x in (best, pp.baseline("ddp"), pp.baseline("fsdp")) if x is not None]
    shown = list({id(x): x for x in (*first, *pp.layouts)}.values())
    table = Table(title="per device: memory stacked by kind, predicted step time")
    table.add_column("layout", justify="left")
    for name, _ in shown[0].memory.rows():
        table.add_column(name)
    for col in ("total", "fits", "step", "per micro-batch", "of which comms"):
        table.add_column(col)
    for x in shown:
        comms = x.time.tensor_parallel + x.time.data_parallel
        table.add_row(
            x.name + (" (chosen)" if x is best else ""),
            *(fmt_bytes(n) for _, n in x.memory.rows()),
            fmt_bytes(x.memory.total),
            "yes" if x.fits else "no",
            f"{x.time.total * 1e3:.1f} ms",
            f"{x.per_micro_batch * 1e3:.2f} ms",
            f"{comms * 1e3:.1f} ms",
        )
    console.print(table)
    for why in dict.fromkeys(pp.refused):
        console.print(f"replicated: {why}")
    console.print(f"core.parallel_plan took {seconds:.1f} s")
    return 0


def _fit_parser(sub: Any, model_args: Callable[[argparse.ArgumentParser], None]) -> None:
    """`remat fit MODEL --memory 24GiB`: the largest batch per strategy (core.fit)."""
    s = sub.add_parser("fit", help="the largest batch whose training step fits a memory")
    model_args(s)
    s.set_defaults(device=None)
    s.add_argument(
        "--memory",
        action="append",
        required=True,
        help="device memory ('24GiB', '80GiB'); repeat it for several devices",
    )
    s.add_argument("--overhead", type=float, default=1.2, help="most predicted time over eager's")
    s.add_argument(
        "--optimizer",
        default="adamw",
        help="optimizer states per parameter: adamw/adam 2, sgd 1 (momentum), none 0",
    )
    s.add_argument("--seq", type=int, default=None, help="sequence length (dimension 1)")
    s.add_argument(
        "--max-batch",
        type=int,
        default=FIT_MAX_BATCH,
        help=f"largest batch tried (default {FIT_MAX_BATCH}); a batch shown as N+ reached it",
    )
    s.set_defaults(run=_fit)


def _fit(args: argparse.Namespace, rest: list[str]) -> int:
    from app.models import load_model
    from core import Fitter

    device = args.device or FIT_DEVICE
    fitter = Fitter(
        load_model(args.model),
        seq=args.seq,
        device=device,
        optimizer=args.optimizer,
        max_batch=args.max_batch,
    )
    chosen = "" if args.device else f", the default: --device {', '.join(FIT_DEVICES)}"
    start = time.perf_counter()
    for memory in args.memory:
        report = fitter.fit(memory, args.overhead)
        print(
            f"{args.model} on {fmt_bytes(memory)}, op times estimated for {report.device}"
            f"{chosen}; inputs at batch 1: {report.shapes}\n  parameters "
            f"{fmt_bytes(report.param_bytes)}, optimizer {report.optimizer} "
            f"{fmt_bytes(report.optimizer_bytes)}; overhead limit {report.overhead_limit:.2f}x"
        )
        print(f"  {'strategy':<24}{'batch':>8}{'step peak':>12}{'total':>12}{'overhead':>10}")
        for f in report.fits:
            batch = f"{f.batch}{'+' if f.capped else ''}" if f.batch else "none"
            print(
                f"  {f.strategy:<24}{batch:>8}{fmt_bytes(f.peak):>12}{fmt_bytes(f.total):>12}"
                f"{f.overhead:>9.2f}x"
            )
        if any(f.capped for f in report.fits):
            print(
                f"  N+: the search stopped at --max-batch {args.max_batch}; a larger batch may "
                "fit too (raise --max-batch to look further)"
            )
    print(
        f"{len(fitter.seconds)} batch sizes traced in {sum(fitter.seconds.values()):.1f} s; "
        f"{time.perf_counter() - start:.1f} s in all"
    )
    return 0


def _link(args: argparse.Namespace, rest: list[str]) -> int:
    import torch

    from core import LINK_BYTES, measure_link

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    link = measure_link(device)
    print(
        f"{device}: device-to-host {link.d2h / 1e9:.1f} GB/s, host-to-device "
        f"{link.h2d / 1e9:.1f} GB/s (median of 5 copies of {fmt_bytes(LINK_BYTES)} each way"
        + (", pinned host buffer, CUDA events)" if device.startswith("cuda") else ", a memcpy)")
    )
    if not device.startswith("cuda"):
        print("on CPU, host and device are one memory: plans use the cpu preset's link")
    return 0


def _show(args: argparse.Namespace, rest: list[str]) -> int:
    import core

    plan = core.load_plan(args.path)
    runs = sum(1 for k, _ in plan.program if k == "run")
    moved = sum(1 for k, _ in plan.program if k == "offload")
    meta = plan.graph_meta
    print(
        f"plan {args.path}: method {plan.method}, budget {fmt_bytes(plan.budget)}\n"
        f"  recorded prediction: peak {fmt_bytes(plan.predicted_peak)}, overhead "
        f"{plan.overhead - 1:+.1%} (apply_plan walks it again under these costs and checks it)\n"
        f"  program: {len(plan.program)} instructions ({runs} op runs, {moved} offloads), "
        "backward from "
        f"{plan.backward_start}\n"
        f"  for a graph of {meta.n_nodes} ATen nodes, {len(meta.params)} parameters, inputs "
        f"{[list(shape) for shape, _, _ in meta.inputs]}, "
        + (f"{meta.costs.model} costs" if meta.costs else "costs not recorded (version 1)")
    )
    native = [n for n in plan.notes if n.startswith("native execution:")]
    if plan.method == "native" and native:  # what runtime="native" runs, not the program
        print(f"  {native[0]}")
    if args.verbose:
        for note in plan.notes:
            print(f"  note: {note}")
    return 0


def _plugins() -> dict[str, Any]:
    """Commands other packages add to `remat` (entry points in the group "remat.commands":
    bench/ adds `remat bench`), so the app's command line imports none of them: each is a
    module with HELP, add_arguments(parser) and run(args, rest) -> exit status."""
    return {ep.name: ep.load() for ep in entry_points(group="remat.commands")}


def _app(args: argparse.Namespace, rest: list[str]) -> int:
    from app.server import serve

    serve(  # a bad --model or --offload-method is a ValueError: main's one error line
        host=args.host,
        port=args.port,
        models=args.model,
        debug=args.app_debug,
        offload_method=args.offload_method,
    )
    return 0


def _port(text: str) -> int:
    """argparse type for --port: a whole number from 0 to 65535."""
    if not text.isdigit() or int(text) > 65535:
        raise argparse.ArgumentTypeError(f"{text!r} is not a TCP port (0-65535)")
    return int(text)


def _ranges(ids: list[int]) -> str:
    return ", ".join(str(i) for i in ids[:6]) + (" ..." if len(ids) > 6 else "")


if __name__ == "__main__":
    sys.exit(main())
