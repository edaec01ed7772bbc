"""The page's words: the glossary, the teaching introduction with a model's own numbers,
and the cost model in words."""

from __future__ import annotations

from dash import html

from core import fmt_bytes

COST_WORDS = {
    "cpu": "a CPU",
    "a100": "an A100",
    "h100": "an H100",
    "v100": "a V100",
    "rtx4090": "an RTX 4090",
}

GLOSSARY = (
    (
        "activation",
        "an op's output that the backward reads: a matmul's weight gradient needs its input, "
        "so that input stays alive from the forward until its backward runs.",
    ),
    (
        "temporaries",
        "values an op needs only briefly (the forward's short-lived results, the backward's "
        "intermediate gradients): they add on top of the activations, most at the start of "
        "the backward, which is why the peak sits there.",
    ),
    (
        "checkpoint",
        "a value kept through the forward so the ops after it can be run again from it; "
        "torch.utils.checkpoint keeps only each wrapped module's input.",
    ),
    (
        "block",
        "a run of forward ops between two values that separate the graph (usually one "
        "layer), with their backward ops; identical blocks are solved once.",
    ),
    (
        "budget",
        "the most memory the step may hold at once beyond parameters and inputs: "
        "activations, temporaries and the gradients it produces. 100% is plain PyTorch's peak.",
    ),
    (
        "recompute",
        "running a forward op again in the backward because its result was freed to save "
        "memory: the plan pays the op's time to avoid keeping its bytes.",
    ),
    (
        "store-all peak",
        "the most memory plain PyTorch's training step holds beyond parameters and inputs, "
        "keeping every activation: the 100% of the budget slider.",
    ),
    (
        "program step",
        "one instruction of the plan's program: run an op (forward, backward or a "
        "recompute), free a value, or start a copy to or from host memory. The timeline's x-axis.",
    ),
    (
        "storage",
        "one block of memory an op allocates; views and in-place ops share their input's "
        "storage, so the tensor view draws storages, not tensors.",
    ),
    (
        "extra time",
        "how much longer the plan's step takes than plain PyTorch's, in % (recomputed ops "
        "and stalls waiting for copies): the price of the memory saved.",
    ),
    (
        "solve time",
        "how long the solver took to find the plan on this machine (not part of training).",
    ),
    (
        "Rockmate, Rotor, ILP, chain DP",
        "solvers. Rotor treats the model as a chain of blocks and finds the best checkpoints "
        "by dynamic programming (chain DP); Rockmate also picks what to keep inside each "
        "block with a small integer linear program (ILP) per block; Checkmate solves one ILP "
        "for the whole graph (small graphs only).",
    ),
    (
        "√n checkpoints",
        "Chen et al.'s rule of thumb: keep every √n-th block's input, recompute the rest; "
        "memory grows as √n blocks instead of n.",
    ),
    (
        "offload",
        "copying an activation to host memory after its last forward use and back before "
        "the backward reads it: the copies run beside compute, so they cost time only when "
        "a copy back arrives late.",
    ),
    (
        "prefetch",
        "the copy of an offloaded activation back to the device, started early enough that "
        "the backward op reading it need not wait.",
    ),
    (
        "stall",
        "time compute waits for a prefetch that arrives late: it counts in the extra time.",
    ),
)


def intro(name: str, description: str, numbers: dict) -> list:
    """The teaching introduction, with this model's own numbers."""
    sa_peak, sa_time = numbers["store_all_peak"], numbers["store_all_time"]
    parts = [
        html.P(
            [
                "Training keeps every activation of the forward pass alive until the backward "
                "pass uses it. For ",
                html.B(name),
                f" ({description}) that is a peak of {fmt_bytes(sa_peak)} beyond parameters "
                f"and inputs, for a step of {_fmt_time(sa_time)} "
                f"({cost_words(numbers['cost_model'])}).",
            ]
        )
    ]
    if numbers.get("attention"):  # e.g. "attention: flash attention (assumed for h100, ...)"
        parts.append(html.P(f"Planned with {numbers['attention']}."))
    if numbers.get("ckpt_peak"):
        saved = 100 * (1 - numbers["ckpt_peak"] / sa_peak)
        extra = 100 * (numbers["ckpt_time"] / sa_time - 1)
        parts.append(
            html.P(
                "Rematerialization frees some activations after the forward and recomputes them "
                "when the backward needs them: memory for time. Checkpointing every one of its "
                f"{numbers['n_blocks']} blocks (keeping only each block's input) brings the peak "
                f"to {fmt_bytes(numbers['ckpt_peak'])} ({saved:.0f}% less) for {extra:.0f}% more "
                "time. A solver picks what to keep inside each block and finds cheaper plans "
                "for any budget: move the slider."
            )
        )
    return parts + _step_words(numbers)


def _step_words(numbers: dict) -> list:
    """What the step switches save: plain PyTorch's peak and the floor, against the step
    without them (analysed beside it)."""
    if "plain_step_peak" not in numbers:
        return []
    plain, now = numbers["plain_step_peak"], numbers["store_all_peak"]
    said = [
        f"Analysed with the step's options on: plain PyTorch's peak is {fmt_bytes(now)} "
        f"against {fmt_bytes(plain)} for the plain step "
        + (
            f"({fmt_bytes(plain - now)} saved), "
            if plain > now
            else "(nothing saved at the peak: activations, not gradients, set it), "
        )
        + f"and the floor no plan goes below is {fmt_bytes(numbers['floor'])} against "
        f"{fmt_bytes(numbers['plain_floor'])}."
    ]
    if numbers.get("updates"):
        said.append(
            f" The {numbers['updates']} ops of AdamW's updates run inside the backward (marked "
            "on the timeline): each parameter is updated once its gradient is complete and the "
            "gradient is freed, so the gradients are never all held at once and no "
            "optimizer.step() follows."
        )
    return [html.P(said, className="hint")]


def cost_words(cost_model: str) -> str:
    """The cost model in words: "estimated:cpu" -> "op times estimated for a CPU"."""
    kind, _, device = cost_model.partition(":")
    if kind == "measured":
        return "op times measured on this machine"
    return f"op times estimated for {COST_WORDS.get(device, device)}"


def _fmt_time(seconds: float) -> str:
    if seconds >= 1:
        return f"{seconds:.2f} s"
    if seconds >= 1e-3:
        return f"{seconds * 1e3:.1f} ms"
    return f"{seconds * 1e6:.0f} µs"
