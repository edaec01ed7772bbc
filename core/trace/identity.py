"""A traced graph's identity: what a plan file records about the graph it was made for
(`graph_meta`), the hash that must match for a plan to apply (`fingerprint`), and what differs
when it does not (`describe_difference`). Plan files carry the fingerprint: changing what it
hashes makes every saved plan refuse to load."""

from __future__ import annotations

import difflib
import hashlib
import importlib.metadata
from typing import Any

import torch
from torch.utils._pytree import tree_map

from core.trace.autocast import Autocast
from core.trace.nodes import Trace


def graph_meta(trace: Trace) -> dict[str, Any]:
    """What a plan file records about its graph, to say what differs on a mismatch."""
    return {
        "params": [[n, str(s)] for n, s in zip(trace.param_names, trace.param_specs)],
        "state": list(trace.state_names),
        "inputs": [
            [list(s.shape), s.dtype, i in trace.grad_inputs]
            for i, s in enumerate(trace.input_specs)
        ],
        "n_nodes": len(trace.nodes),
        "call": trace.call.to_data(),
        "autocast": trace.autocast.to_data(),
    }


def fingerprint(trace: Trace, any_device: bool = False) -> str:
    """Hash of the ops, shapes, dtypes, parameter names and shapes of a traced step. How the
    inputs are passed (the "call") and the autocast state are left out: the planned module
    checks both on every call (autocast's casts are ops of the graph), and plans made before
    either was recorded keep their fingerprint. `any_device`: the devices in op arguments
    are left out too (a GPU plan traced on CPU or meta tensors is bound on the GPU's own
    trace; `core.bind` checks the device model itself)."""
    h = hashlib.sha256()
    meta = graph_meta(trace)
    h.update(repr({k: v for k, v in meta.items() if k not in ("call", "autocast")}).encode())
    for n in trace.nodes:
        args, kwargs = (n.args, n.kwargs) if not any_device else _deviceless((n.args, n.kwargs))
        h.update(repr((n.role, n.label, str(n.target), args, kwargs, n.specs)).encode())
    return h.hexdigest()[:32]


def _deviceless(args: Any) -> Any:
    """`args` with every torch.device as the word "device"."""
    return tree_map(lambda a: "device" if isinstance(a, torch.device) else a, args)


def describe_difference(trace: Trace, meta: dict[str, Any]) -> str:
    """Say what differs between this trace and the `graph_meta` a plan was made for."""
    mine = graph_meta(trace)
    theirs = Autocast.from_data(meta.get("autocast", []))
    if theirs != trace.autocast:
        return f"the plan was made under {theirs.describe()}, this step runs under {trace.autocast.describe()}"
    for key, what in (
        ("params", "parameters"),
        ("inputs", "input shapes or dtypes"),
        ("state", "buffers"),
    ):
        if key in meta and meta[key] != mine[key]:
            return f"{what} differ: plan has {_first_difference(meta[key], mine[key])}"
    count = ""
    if meta.get("n_nodes") not in (None, mine["n_nodes"]):
        count = f"the traced graph has {mine['n_nodes']} ATen ops, the plan's had {meta['n_nodes']}"
    where = _first_op_difference(tuple(meta.get("ops", ())), op_sequence(trace))
    if count and where:
        return f"{count}; {where}"
    return count or where or "the traced operations differ (same shapes, different model code)"


def model_libraries(model: torch.nn.Module) -> tuple[str, ...]:
    """The installed packages the model's modules come from, with their versions
    ("transformers 5.24.0"), torch aside: their code decides the ops a step runs (a plan
    made with one transformers can meet another's mask code)."""
    found: dict[str, str] = {}  # package -> version ("" for the user's own code)
    for module in model.modules():
        top = type(module).__module__.partition(".")[0]
        if top == "torch" or top in found:
            continue
        try:
            found[top] = importlib.metadata.version(top)
        except importlib.metadata.PackageNotFoundError:
            found[top] = ""
    return tuple(sorted(f"{top} {version}" for top, version in found.items() if version))


def other_libraries(recorded: tuple[str, ...], model: torch.nn.Module) -> str:
    """'; the plan was traced with transformers 5.24.0, this is transformers 5.17.0' for
    each recorded package whose installed version differs now ("" when none does)."""
    now = {entry.partition(" ")[0]: entry for entry in model_libraries(model)}
    said = [
        f"; the plan was traced with {entry}, this is {now[entry.partition(' ')[0]]}"
        for entry in recorded
        if entry.partition(" ")[0] in now and now[entry.partition(" ")[0]] != entry
    ]
    return "".join(said)


def op_sequence(trace: Trace) -> tuple[str, ...]:
    """Each ATen op of `trace` as "label@module" ("" module: outside the model's forward):
    what a plan records to name the ops that differ when a trace is not the plan's."""
    return tuple(f"{n.label}@{n.module or ''}" for n in trace.nodes if n.role == "op")


def _first_op_difference(theirs: tuple[str, ...], mine: tuple[str, ...]) -> str:
    """The first stretch where the plan's op sequence and this trace's part ways, in words
    ("" when the plan records no sequence or they are the same)."""
    if not theirs or theirs == mine:
        return ""
    matcher = difflib.SequenceMatcher(a=theirs, b=mine, autojunk=False)
    for tag, i1, i2, j1, j2 in matcher.get_opcodes():
        if tag == "equal":
            continue
        plan, here = _ops_in_words(theirs[i1:i2]), _ops_in_words(mine[j1:j2])
        return (
            f"from op {j1 + 1} on, the plan's trace ran {plan or 'nothing'} where this one "
            f"runs {here or 'nothing'}"
        )
    return ""


def _ops_in_words(ops: tuple[str, ...], most: int = 4) -> str:
    """'aten.mm (in model.h.0.attn), aten.add (...)', at most `most` named."""
    named = []
    for entry in ops[:most]:
        label, _, module = entry.partition("@")
        named.append(f"{label} (in {module})" if module else label)
    more = f" and {len(ops) - most} more" if len(ops) > most else ""
    return ", ".join(named) + more


def _first_difference(theirs: list, mine: list) -> str:
    for i, (a, b) in enumerate(zip(theirs, mine)):
        if a != b:
            return f"{a} where the model has {b} (entry {i})"
    return f"{len(theirs)} entries where the model has {len(mine)}"
