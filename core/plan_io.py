"""Plan files: a pickle of plain data (dicts, lists, numbers, strings), read with bounded work.

Loading a file takes three steps, each refusing with a PlanFileError that says why:
1. a size cap and a scan of the pickle's opcodes (`pickletools.genops`) that admits only what
   plain data needs: no global, no BUILD or REDUCE, no extension, memo indices in sequence,
   no shared container (the "billion laughs"), bounded nesting and opcode count;
2. an unpickler that refuses every global anyway, so nothing from the file can ever run;
3. a schema check of every field's type, range and size.
What the data means is `core.plan.Plan.to_data` / `Plan.from_data`; the program's meaning
(indices, liveness, budget) is checked against the model's graph by
`core.validate.check_program` when the plan is bound to a model (`core.bind`).
"""

from __future__ import annotations

import io
import math
import pickle
import pickletools
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.utils._pytree as pytree

from core.costs import DEVICES
from core.errors import PlanFileError
from core.optimizer_step import HYPER_FIELDS
from core.simulator import KINDS
from core.trace.attention import KERNELS
from core.trace.autocast import DEVICE_TYPES

FORMAT = "remat-studio-plan"
VERSION = 2  # 2: graph_meta records the cost model, its op times and host link

# Limits far above any real plan (gpt2-small's file: 31 KB, 13,000 opcodes, depth 4) that keep
# the scan of a hostile file under a second.
MAX_FILE_BYTES = 4 * 2**20
MAX_OPCODES = 500_000
MAX_DEPTH = 8
MAX_STACK = 5000  # pickle batches 1000 items per APPENDS, so a plain file needs ~1000
MAX_TEXT = 4096  # characters in one note, name or dtype
MAX_TREE = 2**16  # characters of the call's pytree spec (JSON)
MAX_NOTES = 100
MAX_INPUTS = 256
MAX_RANK = 16
MAX_DIM = 2**31
MAX_PARAMS = 100_000
MAX_OPS = 1_000_000  # op times a cost record carries
MAX_VALUES = 1 << 18  # integers of the example's small integer inputs a plan records
MAX_BYTES_FIELD = 2**62  # budget, predicted peak

_SCALARS = {  # opcodes pushing one plain scalar
    "NONE", "NEWTRUE", "NEWFALSE", "BININT", "BININT1", "BININT2", "LONG1", "BINFLOAT",
    "SHORT_BINUNICODE", "BINUNICODE",
}  # fmt: skip
_EMPTY = {"EMPTY_LIST", "EMPTY_DICT", "EMPTY_TUPLE"}
_FILL = {"APPEND": 1, "SETITEM": 2}  # pop n items into the container below them
_TUPLE_N = {"TUPLE1": 1, "TUPLE2": 2, "TUPLE3": 3}
_PUT = {"MEMOIZE", "BINPUT", "LONG_BINPUT"}
_GET = {"BINGET", "LONG_BINGET"}
_FRAMING = {"PROTO", "FRAME"}


def write(data: Any, path: str | Path) -> None:
    """Write plain data (what `Plan.to_data` gives) as a plan file."""
    Path(path).write_bytes(pickle.dumps(data, protocol=4))


def read(path: str | Path) -> dict[str, Any]:
    """The checked plain data in a plan file; never runs code from it. Raises PlanFileError."""
    try:
        size = Path(path).stat().st_size
        if size > MAX_FILE_BYTES:
            raise PlanFileError(_too_big(str(path), size))
        raw = Path(path).read_bytes()
    except OSError as e:
        raise PlanFileError(f"cannot read plan file {path}: {e.strerror}") from None
    return from_bytes(raw, str(path))


def from_bytes(raw: bytes, name: str = "plan") -> dict[str, Any]:
    """The plain data in a plan file's bytes: scanned, unpickled without globals, then
    schema-checked (`check_data`)."""
    if len(raw) > MAX_FILE_BYTES:
        raise PlanFileError(_too_big(name, len(raw)))
    scan_pickle(raw, name)
    try:
        data = _SafeUnpickler(io.BytesIO(raw)).load()
    except PlanFileError:
        raise
    except (EOFError, pickle.UnpicklingError, ValueError, IndexError, KeyError, TypeError) as e:
        kind = "truncated" if isinstance(e, EOFError) else "not a pickle of a plan (corrupt?)"
        raise PlanFileError(
            f"{name} is {kind}: {type(e).__name__}; export the plan again"
        ) from None
    check_data(data, name)
    return data


def scan_pickle(raw: bytes, name: str = "plan") -> None:
    """Refuse, before unpickling, any pickle that is more than plain nested data of bounded
    size: each opcode is checked against a small stack model (containers and scalars)."""
    stack: list[int] = []  # per item: its nesting depth (0 for scalars); -1 marks a MARK
    memo_is_container: list[bool] = []
    count = 0

    def refuse(why: str) -> PlanFileError:
        return PlanFileError(
            f"refusing to load {name}: {why}. Plan files hold plain data only; this one is "
            "foreign, damaged or hostile, and nothing from it was run"
        )

    try:
        for op, arg, pos in pickletools.genops(raw):
            count += 1
            if count > MAX_OPCODES:
                raise refuse(f"more than {MAX_OPCODES} pickle opcodes")
            kind = op.name
            if kind in _SCALARS:
                stack.append(0)
            elif kind in _EMPTY:
                stack.append(1)
            elif kind == "MARK":
                stack.append(-1)
            elif kind in _FILL or kind in ("APPENDS", "SETITEMS"):
                if kind in _FILL:
                    items = [stack.pop() for _ in range(_FILL[kind])]
                else:
                    items = _pop_mark(stack)
                if not stack or stack[-1] < 1 or -1 in items:
                    raise refuse(f"{kind} at byte {pos} outside a container")
                stack[-1] = max([stack[-1], *(d + 1 for d in items)])
            elif kind in _TUPLE_N or kind == "TUPLE":
                items = (
                    _pop_mark(stack)
                    if kind == "TUPLE"
                    else [stack.pop() for _ in range(_TUPLE_N[kind])]
                )
                if -1 in items:
                    raise refuse(f"{kind} at byte {pos} across a mark")
                stack.append(max([1, *(d + 1 for d in items)]))
            elif kind in _PUT:
                index = len(memo_is_container) if kind == "MEMOIZE" else arg
                if index != len(memo_is_container) or not stack or stack[-1] < 0:
                    raise refuse(f"memo index {index} out of sequence at byte {pos}")
                memo_is_container.append(stack[-1] > 0)
            elif kind in _GET:
                if not isinstance(arg, int) or not 0 <= arg < len(memo_is_container):
                    raise refuse(f"memo index {arg} never stored, at byte {pos}")
                if memo_is_container[arg]:
                    raise refuse(f"a container referenced twice, at byte {pos}")
                stack.append(0)
            elif kind == "STOP":
                if len(stack) != 1 or stack[0] < 0:
                    raise refuse("STOP with an unbalanced stack")
            elif kind in ("GLOBAL", "STACK_GLOBAL"):
                raise refuse(f"it asks to import {arg or 'a global'} (opcode {kind} at byte {pos})")
            elif kind not in _FRAMING:
                raise refuse(f"opcode {kind} at byte {pos}")
            if len(stack) > MAX_STACK:
                raise refuse(f"more than {MAX_STACK} items pending on the pickle's stack")
            if stack and stack[-1] > MAX_DEPTH:
                raise refuse(f"data nested deeper than {MAX_DEPTH} levels")
    except PlanFileError:
        raise
    except IndexError:  # popped an empty stack
        raise refuse("an opcode with too few items on the stack") from None
    except ValueError as e:  # genops: truncated argument, bad opcode byte, no STOP
        kind = "truncated" if "remain" in str(e) or "STOP" in str(e) else "corrupt"
        raise PlanFileError(f"{name} is {kind} ({e}); export the plan again") from None


def _pop_mark(stack: list[int]) -> list[int]:
    """Pop the items above the topmost MARK, and the MARK."""
    mark = len(stack) - 1 - stack[::-1].index(-1)
    items = stack[mark + 1 :]
    del stack[mark:]
    return items


def _too_big(name: str, size: int) -> str:
    return (
        f"{name} is {size} bytes, more than a plan file can be ({MAX_FILE_BYTES} bytes): "
        "it is not a Remat Studio plan, or not one this version can read"
    )


class _SafeUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        raise PlanFileError(
            f"refusing to load: the file asks to import {module}.{name}. Plan files hold plain "
            "data only; this one is foreign or hostile, and nothing from it was run"
        )


_FIELDS = {
    "format", "version", "method", "budget", "fingerprint", "graph_meta", "backward_start",
    "program", "predicted", "notes",
}  # fmt: skip


def check_data(data: Any, name: str = "plan") -> None:
    """Every field of a plan file's data checked for type, range and size; PlanFileError
    says which is wrong."""
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        raise PlanFileError(f"{name} is a pickle, but not a Remat Studio plan file")
    version = data.get("version")
    if type(version) is not int or version < 1:
        raise PlanFileError(
            f"{name} has format version {version!r}; versions are whole numbers from 1 to "
            f"{VERSION}: the file is damaged, export the plan again"
        )
    if version > VERSION:
        raise PlanFileError(
            f"{name} has plan format version {version}, newer than this Remat Studio reads "
            f"({VERSION}): upgrade remat-studio to load it"
        )
    fields = set(data)
    if fields != _FIELDS:
        raise PlanFileError(
            f"{name} is a damaged plan file: missing fields {sorted(_FIELDS - fields)}, "
            f"unknown fields {sorted(map(str, fields - _FIELDS))[:5]}; export the plan again"
        )

    def bad(field: str, why: str) -> PlanFileError:
        return PlanFileError(f"{name} is a damaged plan file: {field} {why}; export the plan again")

    method, fp, notes = data["method"], data["fingerprint"], data["notes"]
    if not _is_text(method) or not re.fullmatch(r"[A-Za-z0-9_.:-]{1,64}", method):
        raise bad("method", "is not a method name")
    if not isinstance(fp, str) or not re.fullmatch(r"[0-9a-f]{32}", fp):
        raise bad("fingerprint", "is not 32 hexadecimal digits")
    budget = data["budget"]
    if not _is_int(budget, 0, MAX_BYTES_FIELD):  # 0: none, a plan built by hand
        raise bad("budget", f"is not a number of bytes from 0 (none) to 2**62 ({budget!r})")
    program = data["program"]
    if not isinstance(program, list) or not program:
        raise bad("program", "is empty or not a list")
    for i, ins in enumerate(program):
        if (
            not isinstance(ins, (list, tuple))
            or len(ins) != 2
            or ins[0] not in KINDS
            or not _is_int(ins[1], 0, MAX_DIM)
        ):
            raise bad(
                f"program step {i}",
                f"is not [run|free|offload|prefetch, index] ({str(ins)[:60]})",
            )
    backward_start = data["backward_start"]
    if not _is_int(backward_start, 1, len(program) - 1):
        raise bad("backward_start", f"must lie inside the program (1..{len(program) - 1})")
    predicted = data["predicted"]
    if (
        not isinstance(predicted, list)
        or len(predicted) != 3
        or not _is_int(predicted[0], 0, MAX_BYTES_FIELD)
        or not all(_is_number(x) for x in predicted[1:])
    ):
        raise bad("predicted", "is not [peak bytes, seconds, overhead]")
    if not isinstance(notes, list) or len(notes) > MAX_NOTES or not all(map(_is_text, notes)):
        raise bad("notes", f"is not a list of at most {MAX_NOTES} short texts")
    check_graph_meta(data["graph_meta"], name)


def check_graph_meta(meta: Any, name: str = "the plan") -> None:
    """The graph description a plan carries (parameters, buffers, input shapes and dtypes),
    checked field by field: `apply_plan` builds example inputs from it."""

    def bad(why: str) -> PlanFileError:
        return PlanFileError(f"{name} has damaged graph metadata: {why}; export the plan again")

    fields = {"params", "state", "inputs", "n_nodes"}
    if (
        not isinstance(meta, dict)
        or set(meta)
        - {
            "call",
            "autocast",
            "loss_head",
            "optimizer",
            "costs",
            "device",
            "values",
            "torch",
            "ops",
            "libraries",
        }
        != fields
    ):
        raise bad("expected params, state, inputs, n_nodes, call and autocast")
    params, state, inputs = meta["params"], meta["state"], meta["inputs"]
    if not _is_int(meta["n_nodes"], 1, MAX_DIM):
        raise bad("n_nodes is not a positive count")
    if not isinstance(params, list) or len(params) > MAX_PARAMS:
        raise bad(f"params is not a list of at most {MAX_PARAMS}")
    for p in params:
        if not (isinstance(p, list) and len(p) == 2 and all(map(_is_text, p))):
            raise bad(f"a parameter entry is not [name, spec] ({str(p)[:60]})")
    if not isinstance(state, list) or len(state) > MAX_PARAMS or not all(map(_is_text, state)):
        raise bad("state is not a list of buffer names")
    if not isinstance(inputs, list) or not 0 < len(inputs) <= MAX_INPUTS:
        raise bad(f"inputs is not a list of 1 to {MAX_INPUTS} entries")
    for i, entry in enumerate(inputs):
        if not (isinstance(entry, list) and len(entry) == 3):
            raise bad(f"input {i} is not [shape, dtype, requires_grad]")
        shape, dtype, requires_grad = entry
        if (
            not isinstance(shape, list)
            or len(shape) > MAX_RANK
            or not all(_is_int(d, 0, MAX_DIM) for d in shape)
            or math.prod(shape) > MAX_DIM**2
        ):
            raise bad(f"input {i}'s shape is not a list of at most {MAX_RANK} sizes")
        if not _is_text(dtype) or not isinstance(getattr(torch, dtype, None), torch.dtype):
            raise bad(f"input {i}'s dtype {str(dtype)[:40]!r} is not a torch dtype")
        if not isinstance(requires_grad, bool):
            raise bad(f"input {i}'s requires_grad is not True or False")

    if "call" in meta:
        _check_call(meta["call"], len(inputs), bad)
    if "autocast" in meta:
        _check_autocast(meta["autocast"], bad)
    if "loss_head" in meta:  # a chunked LM-head loss (core.trace.loss_head.LossHead.to_data)
        head = meta["loss_head"]
        if not (
            isinstance(head, dict)
            and set(head) == {"kind", "rows"}
            and head["kind"] == "chunked"
            and (head["rows"] is None or _is_int(head["rows"], 1, MAX_DIM))
        ):
            raise bad("loss_head is not {kind: 'chunked', rows: a count or None}")
    if "optimizer" in meta:  # run inside the step (core.optimizer_step.optimizer_data)
        _check_optimizer(meta["optimizer"], len(params), bad)
    if "costs" in meta:  # core.graph_meta.CostRecord.to_data
        _check_costs(meta["costs"], bad)
    if "device" in meta:  # core.trace.device.DeviceModel.to_data
        _check_device(meta["device"], bad)
    if "torch" in meta and not (_is_text(meta["torch"]) and len(meta["torch"]) <= 64):
        raise bad("torch is not a version string")
    if "ops" in meta and not (
        isinstance(meta["ops"], list)
        and len(meta["ops"]) <= MAX_OPS
        and all(_is_text(o) and len(o) <= 512 for o in meta["ops"])
    ):
        raise bad("ops is not a list of op names")
    if "libraries" in meta and not (
        isinstance(meta["libraries"], list)
        and len(meta["libraries"]) <= 64
        and all(_is_text(e) and len(e) <= 128 for e in meta["libraries"])
    ):
        raise bad("libraries is not a list of package versions")
    if "values" in meta:  # the example's small integer inputs: [[position, [ints]], ...]
        values = meta["values"]
        if not (
            isinstance(values, list)
            and all(
                isinstance(e, list)
                and len(e) == 2
                and _is_int(e[0], 0, len(inputs) - 1)
                and isinstance(e[1], list)
                and len(e[1]) == math.prod(inputs[e[0]][0])
                and all(type(x) is int for x in e[1])
                for e in values
            )
            and sum(len(e[1]) for e in values) <= MAX_VALUES
        ):
            raise bad("values is not [[input position, that input's integers], ...]")


def _check_device(device: Any, bad: Callable[[str], PlanFileError]) -> None:
    """{name: a preset, type: cpu or cuda, capability: [major, minor] or None, attention}."""
    if not (
        isinstance(device, dict) and set(device) == {"name", "type", "capability", "attention"}
    ):
        raise bad("device is not {name, type, capability, attention}")
    cap = device["capability"]
    if (
        device["name"] not in (*DEVICES, "cuda")
        or device["type"] not in ("cpu", "cuda")
        or device["attention"] not in ("auto", *KERNELS)
        or not (
            cap is None
            or (isinstance(cap, list) and len(cap) == 2 and all(_is_int(c, 0, 99) for c in cap))
        )
    ):
        raise bad(f"device {str(device)[:80]} is not a device preset's model")


def _check_costs(costs: Any, bad: Callable[[str], PlanFileError]) -> None:
    """{model: "estimated:cpu", times: [seconds per op], link: [d2h, h2d bytes/s]}."""
    if not (isinstance(costs, dict) and set(costs) == {"model", "times", "link"}):
        raise bad("costs is not {model, times, link}")
    model, times, link = costs["model"], costs["times"], costs["link"]
    if not _is_text(model) or not re.fullmatch(
        r"(estimated|measured):[A-Za-z0-9_.:-]{1,64}", model
    ):
        raise bad(
            f"costs' model {str(model)[:40]!r} is not 'estimated:<device>' or 'measured:<device>'"
        )
    if not (isinstance(times, list) and 0 < len(times) <= MAX_OPS and all(map(_is_number, times))):
        raise bad(f"costs' times is not a list of 1 to {MAX_OPS} op times in seconds")
    if not (
        isinstance(link, list) and len(link) == 2 and all(_is_number(x) and x > 0 for x in link)
    ):
        raise bad("costs' link is not [device-to-host, host-to-device] bytes per second")


def _check_optimizer(opt: Any, n_params: int, bad: Callable[[str], PlanFileError]) -> None:
    """{kind, groups: [{hyperparameter: number or flag}], of: [group index per parameter]}:
    plain numbers and flags only, never code."""
    if not (isinstance(opt, dict) and set(opt) == {"kind", "groups", "of"}):
        raise bad("optimizer is not {kind, groups, of}")
    if opt["kind"] not in ("sgd", "adam", "adamw"):
        raise bad(f"optimizer kind {str(opt['kind'])[:40]!r} is not sgd, adam or adamw")
    groups, of = opt["groups"], opt["of"]
    if not isinstance(groups, list) or not 0 < len(groups) <= MAX_PARAMS:
        raise bad("optimizer groups is not a list of hyperparameter records")
    for g in groups:
        if not (isinstance(g, dict) and set(g) == set(HYPER_FIELDS)):
            raise bad(f"an optimizer group is not {{{', '.join(HYPER_FIELDS)}}}")
        for k, v in g.items():
            flag = k in ("nesterov", "maximize")
            if not (type(v) is bool if flag else _is_number(v)):
                raise bad(f"optimizer {k} {str(v)[:40]!r} is not a {'flag' if flag else 'number'}")
    if not (
        isinstance(of, list)
        and len(of) == n_params
        and all(_is_int(i, -1, len(groups) - 1) for i in of)
    ):
        raise bad("optimizer's of is not a group index (or -1) per parameter")


def _check_autocast(state: Any, bad: Callable[[str], PlanFileError]) -> None:
    """[[device type, dtype name], ...]: a known device type each, a torch dtype each."""
    if not isinstance(state, list) or len(state) > len(DEVICE_TYPES):
        raise bad("autocast is not a list of [device type, dtype]")
    for entry in state:
        if not (isinstance(entry, list) and len(entry) == 2 and all(map(_is_text, entry))):
            raise bad(f"an autocast entry is not [device type, dtype] ({str(entry)[:60]})")
        device, dtype = entry
        if device not in DEVICE_TYPES or not isinstance(getattr(torch, dtype, None), torch.dtype):
            raise bad(f"autocast entry {str(entry)[:60]} names no device type and dtype")


def _check_call(call: Any, n_inputs: int, bad: Callable[[str], PlanFileError]) -> None:
    """How the model was called (`core.trace.CallSpec.to_data`): the pytree spec of (args,
    kwargs) must parse and have one leaf per recorded tensor input (targets excepted) and
    constant, the constants plain scalars."""
    if not isinstance(call, dict) or set(call) != {"tree", "constants", "targets", "loss"}:
        raise bad("call is not {tree, constants, targets, loss}")
    tree, constants, targets, loss = call["tree"], call["constants"], call["targets"], call["loss"]
    if not isinstance(loss, bool) or not _is_int(targets, 0, n_inputs):
        raise bad("call's loss or targets is out of range")
    if tree is None:  # a call a file cannot carry: apply_plan says so
        return
    if not isinstance(constants, list) or len(constants) > MAX_INPUTS:
        raise bad(f"call's constants is not a list of at most {MAX_INPUTS}")
    for entry in constants:
        if not (isinstance(entry, list) and len(entry) == 2 and _is_int(entry[0], 0, MAX_DIM)):
            raise bad(f"a call constant is not [position, value] ({str(entry)[:60]})")
        if not (entry[1] is None or type(entry[1]) in (bool, int, float) or _is_text(entry[1])):
            raise bad(f"a call constant is not a plain scalar ({str(entry)[:60]})")
    if not isinstance(tree, str) or len(tree) > MAX_TREE:
        raise bad(f"call's tree is not a text of at most {MAX_TREE} characters")
    try:
        spec = pytree.treespec_loads(tree)
    except Exception as e:  # noqa: BLE001 - whatever a damaged spec makes the parser raise
        raise bad(f"call's tree does not parse ({type(e).__name__})") from None
    leaves = n_inputs - targets + len(constants)
    positions = {entry[0] for entry in constants}
    if (
        spec.num_leaves != leaves
        or len(positions) != len(constants)
        or max(positions, default=0) >= max(leaves, 1)
    ):
        raise bad("call's tree does not match the recorded inputs and constants")


def _is_int(x: Any, low: int, high: int) -> bool:
    return type(x) is int and low <= x <= high


def _is_number(x: Any) -> bool:
    return type(x) in (int, float) and math.isfinite(x) and 0 <= x < 1e12


def _is_text(x: Any) -> bool:
    return isinstance(x, str) and 0 < len(x) <= MAX_TEXT
