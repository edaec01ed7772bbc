"""The MODEL argument of the command line and the app: a sample model's short name, a zoo name
("hf-gpt2", "timm-resnet", "diffusers-unet", with their library installed) or
`package.module:callable`, resolved to a builder of a `core.ModelCall`.

A builder returns `(model, example_inputs)` (positional inputs; the model returns its loss),
or a `ModelCall`: keyword inputs, and a loss computed outside the model, as Hugging Face
models are trained. The engine knows none of this: only the app's surfaces (CLI, server)
import user code and the sample models.
"""

from __future__ import annotations

import importlib
import os
import sys
from collections.abc import Callable, Sequence
from types import ModuleType
from typing import Any

from torch import nn

from core import ModelCall, RematError

Builder = Callable[[], ModelCall]


class ModelSpecError(RematError, ValueError):
    """A MODEL argument that names nothing loadable."""


def resolve_builder(spec: str) -> Builder:
    """A zero-argument builder for a sample name ("gpt-tiny") or "package.module:callable".

    The module is imported now (so a wrong spec fails at once); the model is built when the
    builder is called, and its result checked to be (model, example_inputs) or a ModelCall.
    """
    import sample_models

    if ":" not in spec:
        if spec in sample_models.REGISTRY:
            return lambda: ModelCall(*sample_models.build(spec))
        if spec.startswith(tuple(_ZOOS)):
            return _zoo_builder(spec)
        raise ModelSpecError(
            f"unknown model {spec!r}: use a sample name ({', '.join(sample_models.names())}), "
            "a zoo name (hf-gpt2, timm-resnet, diffusers-unet, ...) or package.module:callable "
            "returning (model, example_inputs) or a core.ModelCall"
        )
    module_name, _, attr = spec.partition(":")
    if not module_name or not attr:
        raise ModelSpecError(f"model {spec!r}: write package.module:callable")
    module = _import_user_module(module_name, spec)
    fn = getattr(module, attr, None)
    if not callable(fn):
        raise ModelSpecError(f"{module_name} has no callable {attr!r} (from model {spec!r})")

    def build() -> ModelCall:
        try:
            result = fn()
        except Exception as e:  # noqa: BLE001 - any error of the user's builder, named
            raise ModelSpecError(
                f"the model builder {spec} raised {type(e).__name__}: {e} (--debug shows where)"
            ) from e
        except SystemExit as e:
            raise ModelSpecError(
                f"the model builder {spec} called sys.exit({e.code!r}) instead of returning "
                "(model, example_inputs)"
            ) from e
        return as_call(result, spec)

    return build


def _import_user_module(module_name: str, spec: str) -> ModuleType:
    """Import the module of a "package.module:callable" spec, from the working directory first,
    as `python -m` and `python script.py` users expect.

    A console script such as `remat` puts its own bin folder, not the working directory, at
    `sys.path[0]`: without this `remat inspect mymods:build`, run beside mymods.py, could not
    find it. A module that is really missing gets an error naming where it was looked for.
    """
    cwd = os.getcwd()
    if not any(os.path.abspath(p or os.curdir) == cwd for p in sys.path):
        sys.path.insert(0, cwd)
    try:
        return importlib.import_module(module_name)
    except ModuleNotFoundError as e:
        if e.name is None or not _is_prefix(e.name, module_name):
            raise ModelSpecError(
                f"cannot import {module_name!r} for model {spec!r}: {e} (the module itself was "
                "found: install what it imports)"
            ) from None
        top = e.name.split(".")[0]
        raise ModelSpecError(
            f"cannot import {module_name!r} for model {spec!r}: no module named {e.name!r} in "
            f"the current directory ({cwd}) or on sys.path: run from the folder that holds "
            f"{top}.py (or the package {top}/), or add that folder to PYTHONPATH"
        ) from None
    except Exception as e:  # noqa: BLE001 - any import-time error of the user's module
        raise ModelSpecError(f"cannot import {module_name!r} for model {spec!r}: {e}") from None


def _is_prefix(name: str, module_name: str) -> bool:
    """Whether `name` is `module_name` or one of its parent packages."""
    return module_name == name or module_name.startswith(name + ".")


def as_call(result: Any, spec: str) -> ModelCall:
    """A builder's result as a ModelCall: `(model, example_inputs)`, a ModelCall, or an object
    with a ModelCall's fields (the zoo's cases)."""
    if isinstance(result, ModelCall):
        return result
    if all(hasattr(result, f) for f in ("model", "args", "kwargs", "loss_fn", "targets")):
        result = ModelCall(
            result.model,
            tuple(result.args),
            dict(result.kwargs),
            result.loss_fn,
            tuple(result.targets),
        )
    elif (
        isinstance(result, tuple)
        and len(result) == 2
        and isinstance(result[0], nn.Module)
        and isinstance(result[1], Sequence)
    ):
        result = ModelCall(result[0], tuple(result[1]))
    if not isinstance(result, ModelCall) or not isinstance(result.model, nn.Module):
        raise ModelSpecError(
            f"{spec} must return (model, example_inputs) or a core.ModelCall, got {type(result)}"
        )
    return result


# zoo name prefix -> (module, what it needs, how to install it)
_ZOOS = {
    "hf-": ("sample_models.hf_zoo", "transformers", "pip install '.[bench]'"),
    "timm-": (
        "sample_models.timm_zoo",
        "timm",
        "pip install '.[bench]' && pip install --no-deps timm",
    ),
    "diffusers-": ("sample_models.diffusers_zoo", "diffusers", "pip install '.[bench]'"),
}


def _zoo_builder(spec: str) -> Builder:
    prefix = next(p for p in _ZOOS if spec.startswith(p))
    module_name, needs, install = _ZOOS[prefix]
    try:
        zoo = importlib.import_module(module_name).ZOO
    except ImportError as e:
        raise ModelSpecError(
            f"model {spec!r} is in the {needs} zoo, which needs {needs}: {install} ({e})"
        ) from None
    if spec not in zoo:
        raise ModelSpecError(f"unknown zoo model {spec!r}: choose one of {', '.join(zoo)}")
    return lambda: as_call(zoo[spec](), spec)


def load_model(spec: str) -> ModelCall:
    """The model and its call for a MODEL argument."""
    return resolve_builder(spec)()
