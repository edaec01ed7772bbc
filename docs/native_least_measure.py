"""Native least peak against interpreted least peak, measured: the table in docs/native.md
("Regions that are no submodule").

For each sample model (but the big ones) and each zoo model: store-all's peak, Rockmate's
least peak (the interpreter's, its InfeasibleBudget minimum), the native method's least
peak (`solve(..., method="native")`'s minimum), that native plan applied and run once
(measured peak, which must be the prediction + 4 B, loss and gradients `torch.equal` to
eager's), and how many stretches it has. One line per model, tab-separated, on stdout.

    .venv/bin/python docs/native_least_measure.py [names...]
"""

from __future__ import annotations

import sys
import time

import torch

import core
from core.memory import StorageTracker, step_tensors
from core.native.lowering import lower
from sample_models import build, names

BIG = {"gpt2-small", "resnet50", "vit-small", "regnet-small", "mlp", "resnet18", "unet-small"}
BIG |= {"gpt-small-6l", "two-tower-small"}


def _case(name: str) -> tuple:
    """(model, args, kwargs, loss_fn, targets) of a sample or zoo model."""
    for module in ("hf_zoo", "timm_zoo", "diffusers_zoo"):
        zoo = __import__(f"sample_models.{module}", fromlist=["ZOO"]).ZOO
        if name in zoo:
            c = zoo[name]()
            cached = name in ("hf-gpt2", "hf-llama", "hf-t5", "hf-mixtral")  # a KV cache
            kwargs = {**c.kwargs, "use_cache": False} if cached else c.kwargs
            return c.model, c.args, kwargs, c.loss_fn, c.targets
    model, inputs = build(name)
    return model, inputs, {}, None, ()


def _step(model, run, args, kwargs, loss_fn, targets):  # noqa: ANN001, ANN202
    model.zero_grad(set_to_none=True)
    torch.manual_seed(3)
    tensors = [v for v in kwargs.values() if isinstance(v, torch.Tensor)]
    with StorageTracker(step_tensors(model, (*args, *tensors, *targets))) as tracker:
        if loss_fn is None:
            loss = run(*args, **kwargs)
        elif run is model:
            loss = loss_fn(model(*args, **kwargs), *targets)
        else:
            loss = run(*args, **kwargs, targets=targets)
        loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return tracker.peak, loss.detach(), grads


def _minimum(problem: core.Problem, method: str) -> int:
    try:
        core.solve(problem, 1, method=method)
    except core.InfeasibleBudget as e:
        return e.minimum
    raise AssertionError("a 1-byte budget fits")


def measure(name: str) -> str:
    torch.set_num_threads(1)
    start = time.time()
    model, args, kwargs, loss_fn, targets = _case(name)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    problem = core.analyze(model, args, kwargs, loss_fn, targets)
    _, eager_loss, eager_grads = _step(model, model, args, kwargs, loss_fn, targets)
    interp = _minimum(problem, "rockmate")
    native = _minimum(problem, "native")
    try:
        plan = core.solve(problem, native, method="native")
    except core.InfeasibleBudget as e:  # the ILPs' time limits: another plan under load
        plan = core.solve(problem, e.minimum, method="native")
    low = lower(plan)
    native = low.prediction.peak
    model.load_state_dict(state)
    run = core.apply_plan(model, plan, loss_fn=loss_fn, runtime="native")
    peak, loss, grads = _step(model, run, args, kwargs, loss_fn, targets)
    equal = torch.equal(loss, eager_loss) and all(
        torch.equal(grads[n], g) for n, g in eager_grads.items()
    )
    store = problem.store_all_peak
    return "\t".join(
        str(x)
        for x in (
            name,
            store,
            interp,
            f"{interp / store:.3f}",
            native,
            f"{native / store:.3f}",
            f"{native / interp:.3f}",
            peak - low.prediction.peak,
            equal,
            len(low.stretches),
            len(low.regions),
            f"{time.time() - start:.0f}s",
        )
    )


def main(argv: list[str]) -> None:
    if not argv:
        from sample_models import diffusers_zoo, hf_zoo, timm_zoo

        argv = [n for n in names() if n not in BIG]
        argv += [*hf_zoo.ZOO, *timm_zoo.ZOO, *diffusers_zoo.ZOO]
    for name in argv:
        try:
            print(measure(name), flush=True)
        except Exception as e:  # noqa: BLE001 - one model's failure is a row, not the end
            print(f"{name}\tfailed: {type(e).__name__}: {str(e)[:200]}", flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
