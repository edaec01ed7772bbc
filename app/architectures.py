"""The page's menu of Hugging Face architectures at their published sizes
(`sample_models.hf_archs`): the choices, and adding one at a shape to the Studio's models.

Only a name of that table and whole numbers in range are accepted, and the builder is the
table's own: nothing typed in the page names code to import. Adding is cheap (a closure);
the model is built, on the meta device, when the page's analysis asks for it.
"""

from __future__ import annotations

import importlib.util
from functools import partial

from app.state import DEVICES, Studio
from sample_models.hf_archs import (
    ARCHITECTURES,
    DEFAULT_BATCH,
    MIN_SEQ,
    ShapeError,
    build,
    check_shape,
    default_seq,
    menu_name,
    parse_menu_name,
)

# where the menu plans: the GPU presets (their memory, capability and attention kernels)
GPUS = tuple(d for d in DEVICES if d != "cpu")
DEFAULT_ARCH = "llama3-8b"
DEFAULT_GPU = "h100"

__all__ = [
    "ARCHITECTURES",
    "DEFAULT_ARCH",
    "DEFAULT_GPU",
    "DEFAULT_BATCH",
    "GPUS",
    "MIN_SEQ",
    "ShapeError",
    "add",
    "arch_options",
    "default_seq",
    "is_architecture",
    "missing",
    "model_options",
]


def missing() -> str:
    """Why the menu cannot build its models here ("" when it can): transformers is the
    `bench` extra's, not the app's."""
    if importlib.util.find_spec("transformers") is None:
        return "The architectures need transformers: pip install '.[bench]'"
    return ""


def arch_options() -> list[dict]:
    """The architecture menu's choices, in the table's order."""
    return [{"label": a.title, "value": a.name} for a in ARCHITECTURES.values()]


def add(studio: Studio, name: object, batch: object, seq: object) -> str:
    """Put architecture `name` at `batch x seq` tokens among `studio`'s models and return its
    name in the model menu ("llama3-8b 1x8192"). A name not in the table, or a shape out of
    its range, is a ShapeError saying what to choose; nothing is imported."""
    if not isinstance(name, str) or name not in ARCHITECTURES:
        raise ShapeError(f"unknown architecture {name!r}: choose one of {', '.join(ARCHITECTURES)}")
    batch, seq = check_shape(name, batch, seq)
    value = menu_name(name, batch, seq)
    studio.builders.setdefault(value, partial(build, name, batch, seq))
    return value


def model_options(studio: Studio) -> list[str]:
    """The model menu's choices: the sample models, the `--model`s and the architectures added
    from the menu, by name ("llama3-8b 1x8192"; the page's watcher reads the name shown)."""
    return list(studio.builders)


def is_architecture(model: str) -> bool:
    """Whether `model` (a model menu's name) is an architecture added from the menu."""
    try:
        parse_menu_name(model)
    except KeyError:
        return False
    return True
