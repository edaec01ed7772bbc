"""Plan files: a pickle of plain data (dicts, lists, numbers, strings), read by an unpickler that
refuses every global, so a hostile file can never run code when it is loaded. What the data
means is `core.schedule.Plan.to_data` / `Plan.from_data`; this module only moves it to and
from a file."""

from __future__ import annotations

import io
import pickle
from pathlib import Path
from typing import Any

from core.errors import PlanFileError

FORMAT = "remat-studio-plan"
VERSION = 1


def write(data: Any, path: str | Path) -> None:
    """Write plain data (what `Plan.to_data` gives) as a plan file."""
    Path(path).write_bytes(pickle.dumps(data, protocol=4))


def read(path: str | Path) -> Any:
    """The plain data in a plan file; never runs code from it. Raises PlanFileError."""
    try:
        raw = Path(path).read_bytes()
    except OSError as e:
        raise PlanFileError(f"cannot read plan file {path}: {e.strerror}") from None
    return from_bytes(raw, str(path))


def from_bytes(raw: bytes, name: str = "plan") -> Any:
    """The plain data in a plan file's bytes, through the unpickler that refuses globals."""
    try:
        return _SafeUnpickler(io.BytesIO(raw)).load()
    except PlanFileError:
        raise
    except (EOFError, pickle.UnpicklingError, ValueError, IndexError, KeyError, TypeError) as e:
        kind = "truncated" if isinstance(e, EOFError) else "not a pickle of a plan (corrupt?)"
        raise PlanFileError(
            f"{name} is {kind}: {type(e).__name__}; export the plan again"
        ) from None


class _SafeUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        raise PlanFileError(
            f"refusing to load: the file asks to import {module}.{name}. Plan files hold plain "
            "data only; this one is foreign or hostile, and nothing from it was run"
        )
