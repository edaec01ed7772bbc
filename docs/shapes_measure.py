"""The measurements behind docs/shapes.md: a training loop over five sequence lengths and a
short last batch on the zoo's tiny GPT-2 and Llama, fp32 and under bf16 autocast, planned
once at 4 x 16 tokens. Per shape: the path taken, exactness against eager, the measured peak
against the prediction and the budget, the seconds to plan it (cold: trace + plan; cached:
the second epoch), and a full solve's seconds for comparison.

    REMAT_CACHE=$(mktemp -d) PYTHONPATH=. python docs/shapes_measure.py
"""

from __future__ import annotations

import contextlib
import sys
import time

import torch

import core
from core.memory import StorageTracker, step_tensors
from sample_models.hf_zoo import VOCAB, gpt2, llama

SHAPES = [(4, 16), (4, 15), (4, 12), (4, 9), (4, 5), (3, 12)]  # the last: a short batch
BUDGET = 0.6  # of the first shape's store-all peak


def batch(b: int, s: int, seed: int) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (b, s), generator=g)
    mask = torch.ones(b, s, dtype=torch.long)
    mask[-1, -2:] = 0  # a padded row
    return ids, mask, torch.randint(0, VOCAB, (b, s), generator=g)


def step(model, run, loss_fn, x, autocast: bool) -> tuple[int, dict]:
    model.zero_grad(set_to_none=True)
    torch.manual_seed(3)
    context = torch.autocast("cpu", torch.bfloat16) if autocast else contextlib.nullcontext()
    with StorageTracker(step_tensors(model, x)) as tracker:
        with context:
            if run is None:
                loss = loss_fn(model(x[0], attention_mask=x[1]), x[2])
            else:
                loss = run(x[0], attention_mask=x[1], targets=(x[2],))
        loss.backward()
    return tracker.peak, {n: p.grad.clone() for n, p in model.named_parameters()}


def measure(name: str, build, autocast: bool) -> None:
    case = build()
    model, loss_fn = case.model, case.loss_fn
    x = batch(*SHAPES[0], 0)
    context = torch.autocast("cpu", torch.bfloat16) if autocast else contextlib.nullcontext()
    with context:
        problem = core.analyze(model, (x[0],), {"attention_mask": x[1]}, loss_fn, (x[2],))
    plan = core.solve(problem, BUDGET)
    run = core.apply_plan(model, plan)
    label = f"{name} {'bf16 autocast' if autocast else 'fp32'}"
    print(
        f"\n{label}: planned at 4x16, budget {plan.budget} B ({BUDGET:.0%} of store-all "
        f"{problem.store_all_peak} B), overhead {plan.overhead:.3f}, solved in "
        f"{plan.solve_seconds:.1f} s"
    )
    print(
        "| shape | path | exact | peak - 4 B = predicted | within budget | store-all | overhead "
        "| trace s | plan s | cached s | full solve s |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for epoch in range(2):
        for i, (b, s) in enumerate(SHAPES):
            x = batch(b, s, 10 + i)
            start = time.perf_counter()
            with context:
                entry = run.plan_for(x[0], attention_mask=x[1], targets=(x[2],))
            seconds = time.perf_counter() - start
            if epoch == 1:
                print(f"  cached {b}x{s}: {seconds * 1e3:.2f} ms")
                continue
            state = {k: v.clone() for k, v in model.state_dict().items()}
            _, eager = step(model, None, loss_fn, x, autocast)
            model.load_state_dict(state)
            peak, grads = step(model, run, loss_fn, x, autocast)
            exact = all(torch.equal(grads[n], eager[n]) for n in eager)
            pred = entry.plan.predicted_peak
            full = ""
            if entry.path in ("carried", "store_all") and entry.path != "planned":
                t = time.perf_counter()
                solved = core.solve(entry.problem, plan.budget)
                full = f"{time.perf_counter() - t:.2f} (overhead {solved.overhead:.3f})"
            print(
                f"| {b}x{s} | {entry.path} | {exact} | {peak - 4 == pred} ({pred}) | "
                f"{pred <= plan.budget} | {entry.store_all_peak} | {entry.plan.overhead:.3f} | "
                f"{entry.analyze_seconds:.2f} | {entry.plan_seconds:.3f} | | {full} |",
                flush=True,
            )


if __name__ == "__main__":
    torch.set_num_threads(1)
    which = sys.argv[1:] or ["gpt2", "llama"]
    for name in which:
        for autocast in (False, True):
            measure(name, {"gpt2": gpt2, "llama": llama}[name], autocast)


def gpt2_meta_2l():
    """GPT-2 small's widths and vocabulary, 2 layers, on the meta device (`remat fit` MODEL)."""
    from sample_models.hf_zoo import gpt2_meta

    return gpt2_meta(2)


def llama_meta_2l():
    """The zoo's 12-layer Llama's widths and vocabulary, 2 layers, on the meta device."""
    from sample_models.hf_zoo import llama_meta

    return llama_meta(2)
