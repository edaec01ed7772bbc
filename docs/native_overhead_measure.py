"""The native runtime's step time against eager's, two checkouts paired in one run: the
table in docs/native.md ("Per-op overhead of the native runtime").

For each model (bench/current.py's `build`) and each checkout, a worker process analyses
the model, solves `method="native"` at 70% of store-all, applies the plan natively to a copy
of the model and steps it once; the driver then asks the workers in turn, round after
round, for one eager step and one native step each (1 thread), so both checkouts see the
same machine load. It prints the median step times (wall clock and the thread's CPU time,
which a loaded machine disturbs less), native over eager, and the native prediction's
overhead (time over store-all, estimated costs) of each checkout.

    .venv/bin/python docs/native_overhead_measure.py --base /tmp/old-checkout [--rounds 9]
        [hf-gpt2 hf-gpt2-4l gpt-tiny]
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parents[1]
MODELS = ("hf-gpt2", "hf-gpt2-4l", "gpt-tiny")
BUDGET = 0.7
MARK = "@@ "  # a worker's answers (anything else it prints is passed over)


def _worker(name: str) -> None:
    """Serve `step` requests on stdin for model `name`, one JSON line per answer."""
    import core
    from bench.current import build

    torch.set_num_threads(1)
    c = build(name)
    if c.loss_fn is not None:
        problem = core.analyze(
            c.model, c.args, kwargs=c.kwargs, loss_fn=c.loss_fn, targets=c.targets
        )
    else:
        problem = core.analyze(c.model, c.args)
    plan = core.solve(problem, BUDGET, method="native")
    native = core.apply_plan(copy.deepcopy(c.model), plan, runtime="native", loss_fn=c.loss_fn)
    low = core.lower(plan)

    def eager() -> None:
        out = c.model(*c.args, **c.kwargs)
        loss = c.loss_fn(out, *c.targets) if c.loss_fn is not None else out.sum()
        loss.backward()

    def ours() -> None:
        if c.loss_fn is not None:
            loss = native(*c.args, **c.kwargs, targets=c.targets)
        else:
            loss = native(*c.args).sum()
        loss.backward()

    eager(), ours()  # warm up
    info = {"predicted": low.prediction.overhead, "stretches": len(low.stretches)}
    info["core"] = core.__file__
    print(MARK + json.dumps(info), flush=True)
    for line in sys.stdin:
        if line.strip() != "step":
            break
        times = []
        for f in (eager, ours):
            started, cpu = time.perf_counter(), time.thread_time()
            f()
            times += [time.perf_counter() - started, time.thread_time() - cpu]
        print(MARK + json.dumps(times), flush=True)


def _spawn(tree: Path, name: str) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(tree), "OMP_NUM_THREADS": "1"}
    return subprocess.Popen(
        [sys.executable, str(Path(__file__).resolve()), "--worker", name],
        cwd=tree,
        env=env,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )


def _ask(p: subprocess.Popen, line: str | None) -> object:
    """Send `line` (None: nothing) and read the worker's next answer."""
    assert p.stdin is not None and p.stdout is not None
    if line is not None:
        p.stdin.write(line + "\n")
        p.stdin.flush()
    while True:
        got = p.stdout.readline()
        if not got:
            raise RuntimeError("a worker died (its error is above)")
        if got.startswith(MARK):
            return json.loads(got[len(MARK) :])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--base", type=Path, help="the checkout to compare with (required)")
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--worker")
    ap.add_argument("models", nargs="*", default=list(MODELS))
    a = ap.parse_args()
    if a.worker:
        _worker(a.worker)
        return
    if a.base is None:
        ap.error("--base is required")
    print("load before:", os.getloadavg())
    print(
        "model\tcheckout\teager ms\tnative ms\tnative/eager\t"
        "eager CPU ms\tnative CPU ms\tCPU native/eager\tpredicted\tstretches"
    )
    for name in a.models:
        trees = {"base": a.base.resolve(), "this": HERE}
        workers = {k: _spawn(t, name) for k, t in trees.items()}
        info: dict[str, dict] = {}
        for k, p in workers.items():
            info[k] = _ask(p, None)  # type: ignore[assignment]
            assert info[k]["core"].startswith(str(trees[k])), info[k]["core"]
        times: dict[str, list[list[float]]] = {k: [] for k in workers}
        for _ in range(a.rounds):
            for k, p in workers.items():
                times[k].append(_ask(p, "step"))  # type: ignore[arg-type]
        for k, p in workers.items():
            _ask_quit(p)
            eager, cpu_eager, ours, cpu_ours = (
                statistics.median(t[c] for t in times[k]) * 1e3 for c in range(4)
            )
            print(
                f"{name}\t{k}\t{eager:.2f}\t{ours:.2f}\t{ours / eager:.2f}\t"
                f"{cpu_eager:.2f}\t{cpu_ours:.2f}\t{cpu_ours / cpu_eager:.2f}\t"
                f"{info[k]['predicted']:.3f}\t{info[k]['stretches']}",
                flush=True,
            )
    print("load after:", os.getloadavg())


def _ask_quit(p: subprocess.Popen) -> None:
    assert p.stdin is not None
    p.stdin.write("quit\n")
    p.stdin.close()
    p.wait()


if __name__ == "__main__":
    main()
