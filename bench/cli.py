"""`remat bench`: the benchmarks' command, which bench/ adds to the `remat` command line
(the entry point "bench" in the group "remat.commands", pyproject.toml), so the app's command
line imports nothing of bench/. Imports here stay light: `remat --help` loads this module."""

from __future__ import annotations

import argparse
import sys

from bench import MissingExtra

HELP = "benchmarks (see `remat bench --help`)"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags that choose a benchmark; the rest of the line goes to that benchmark."""
    parser.add_argument(
        "--runtime",
        action="store_true",
        help="runtime overhead of store_all vs eager, op-cost calibration",
    )
    parser.add_argument(
        "--solvers",
        action="store_true",
        help="solver quality and speed: sample models, then the Hugging Face zoo",
    )
    parser.add_argument(
        "--zoo",
        action="store_true",
        help="only the Hugging Face zoo of --solvers (needs the bench extra's transformers)",
    )
    parser.add_argument("--app", action="store_true", help="app slider latency in a browser")
    parser.add_argument(
        "--app-before",
        metavar="CHECKOUT",
        help="with --app: an older checkout (git worktree add) measured alongside, alternating",
    )
    parser.add_argument(
        "--validate",
        action="store_true",
        help="predicted against measured peaks, gradients and times of our plans "
        "(`remat bench --device cuda --validate`; `--device cpu`: the dry run)",
    )
    parser.add_argument(
        "--tables",
        action="store_true",
        help="published GPU memory tables predicted from their configurations "
        "(`--out docs/gpu-tables.md` writes the document)",
    )


def run(args: argparse.Namespace, rest: list[str]) -> int:
    """Run the benchmark the flags name; the rest of the command line goes to it. A missing
    optional dependency is one line naming the extra, as the CLI's own errors are."""
    try:
        return _run(args, rest)
    except MissingExtra as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


def _run(args: argparse.Namespace, rest: list[str]) -> int:
    if "-h" in rest or "--help" in rest:
        print(
            "remat bench --runtime | --solvers | --zoo | --app | --validate | --tables: runtime "
            "overhead and op-cost calibration, solver quality and speed (--zoo: on the Hugging "
            "Face zoo only), app latency, predictions against a GPU's measurements "
            "(--device cuda --validate), published GPU tables.\nWithout those, the "
            "side-by-side benchmark:\n"
        )
    if args.validate:
        from bench.validate import main as validate_main

        return validate_main(rest)
    if args.tables:
        from bench.gpu_tables import main as tables_main

        return tables_main(rest)
    if args.runtime:
        from bench.runtime import main as runtime_main

        return runtime_main(rest)
    if args.zoo:
        from bench.solvers import bench_zoo

        print(bench_zoo())
        return 0
    if args.solvers:
        from bench.solvers import bench_solvers, bench_zoo

        print(bench_solvers(), flush=True)
        try:
            print(bench_zoo())
        except MissingExtra as e:  # the sample models' part stands on the base install
            print(f"zoo left out: {e}")
        return 0
    if args.app:
        from bench.app import app_table, bench_app

        print(app_table(bench_app(before=args.app_before, report=print)))
        return 0
    from bench.compare import main as bench_main

    return bench_main(rest)
