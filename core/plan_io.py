"""Plan files: a pickle of plain data (dicts, lists, numbers, strings), read by an unpickler that
refuses every global, so a hostile file can never run code when it is loaded."""

from __future__ import annotations

import io
import pickle
from pathlib import Path
from typing import Any

from core.errors import PlanFileError
from core.schedule import FREE, RUN, Plan

FORMAT = "remat-studio-plan"
VERSION = 1


def plan_to_data(plan: Plan) -> dict[str, Any]:
    """The plan as plain data: what a plan file holds."""
    return {
        "format": FORMAT,
        "version": VERSION,
        "method": plan.method,
        "budget": int(plan.budget),
        "fingerprint": plan.fingerprint,
        "graph_meta": plan.graph_meta,
        "backward_start": int(plan.backward_start),
        "program": [[kind, int(target)] for kind, target in plan.program],
        "predicted": [int(plan.predicted_peak), float(plan.predicted_time), float(plan.overhead)],
        "notes": list(plan.notes),
    }


def plan_to_bytes(plan: Plan) -> bytes:
    return pickle.dumps(plan_to_data(plan), protocol=4)


def save_plan(plan: Plan, path: str | Path) -> None:
    Path(path).write_bytes(plan_to_bytes(plan))


def load_plan(path: str | Path) -> Plan:
    """Read a plan file; never runs code from it. Raises PlanFileError saying what is wrong."""
    try:
        raw = Path(path).read_bytes()
    except OSError as e:
        raise PlanFileError(f"cannot read plan file {path}: {e.strerror}") from None
    return plan_from_bytes(raw, str(path))


def plan_from_bytes(raw: bytes, name: str = "plan") -> Plan:
    try:
        data = _SafeUnpickler(io.BytesIO(raw)).load()
    except PlanFileError:
        raise
    except (EOFError, pickle.UnpicklingError, ValueError, IndexError, KeyError, TypeError) as e:
        kind = "truncated" if isinstance(e, EOFError) else "not a pickle of a plan (corrupt?)"
        raise PlanFileError(
            f"{name} is {kind}: {type(e).__name__}; export the plan again"
        ) from None
    return _plan_from_data(data, name)


class _SafeUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        raise PlanFileError(
            f"refusing to load: the file asks to import {module}.{name}. Plan files hold plain "
            "data only; this one is foreign or hostile, and nothing from it was run"
        )


def _plan_from_data(data: Any, name: str) -> Plan:
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        raise PlanFileError(f"{name} is a pickle, but not a Remat Studio plan file")
    version = data.get("version")
    if not isinstance(version, int):
        raise PlanFileError(f"{name} has no valid format version")
    if version > VERSION:
        raise PlanFileError(
            f"{name} has plan format version {version}, newer than this Remat Studio reads "
            f"({VERSION}): upgrade remat-studio to load it"
        )
    try:
        program = [(str(k), int(t)) for k, t in data["program"]]
        if any(k not in (RUN, FREE) for k, _ in program):
            raise ValueError("unknown instruction")
        predicted = data["predicted"]
        plan = Plan(
            program=program,
            backward_start=int(data["backward_start"]),
            method=str(data["method"]),
            budget=int(data["budget"]),
            fingerprint=str(data["fingerprint"]),
            notes=[str(n) for n in data.get("notes", [])],
            graph_meta=dict(data["graph_meta"]),
        )
        plan.saved_prediction = (int(predicted[0]), float(predicted[1]), float(predicted[2]))
    except (KeyError, TypeError, ValueError, IndexError) as e:
        raise PlanFileError(f"{name} is a damaged plan file ({type(e).__name__}: {e})") from None
    return plan
