"""The measurements behind docs/shapes.md's `remat fit` rows: GPT-2 small and the zoo's
12-layer Llama on the meta device, 512 tokens, AdamW, overhead 1.2, h100 costs, 24 GiB then
80 GiB on one Fitter. Per answer: the predicted batch, the answer, and the batch sizes traced.

    PYTHONPATH=. python docs/fit_measure.py gpt2|llama|gpt2-2l [layers]
"""

from __future__ import annotations

import sys
import time

import torch

from core import ModelCall
from core.fit import Fitter
from sample_models.hf_zoo import gpt2_meta, llama_meta

GIB = 1024**3


def main(name: str, layers: int) -> None:
    case = {"gpt2": gpt2_meta, "llama": llama_meta}[name](layers)
    call = ModelCall(case.model, case.args, case.kwargs, case.loss_fn, case.targets)
    fitter = Fitter(call, max_batch=4096)
    start = time.perf_counter()
    for gib in (24, 80):
        before = len(fitter.seconds)
        t = time.perf_counter()
        r = fitter.fit(gib * GIB, overhead=1.2)
        traced = len(fitter.seconds) - before
        print(
            f"{name} {layers}L {gib} GiB: {time.perf_counter() - t:.0f} s, {traced} batch sizes "
            f"traced, params {r.param_bytes / 2**20:.1f} MiB, "
            f"AdamW {r.optimizer_bytes / 2**20:.1f} MiB",
            flush=True,
        )
        for f in r.fits:
            print(
                f"| {name} ({layers} layers) | {gib} GiB | {f.strategy} | {r.guesses[f.strategy]} "
                f"| {f.batch} | {f.peak / GIB:.2f} GiB | {f.total / GIB:.2f} GiB | "
                f"{f.overhead:.3f}x |",
                flush=True,
            )
    print(f"traced: {sorted(fitter.seconds)}")
    print(
        f"trace seconds: {sum(fitter.seconds.values()):.0f}, total {time.perf_counter() - start:.0f}"
    )


if __name__ == "__main__":
    torch.set_num_threads(1)
    main(sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 12)
