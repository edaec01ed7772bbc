"""Resolve a MODEL argument: a sample model's short name or `package.module:callable`."""

from __future__ import annotations

import importlib
from collections.abc import Callable, Sequence

import torch
from torch import nn

from core.errors import RematError

Builder = Callable[[], tuple[nn.Module, tuple[torch.Tensor, ...]]]


class ModelSpecError(RematError, ValueError):
    """A MODEL argument that names nothing loadable."""


def resolve_builder(spec: str) -> Builder:
    """A zero-argument builder for a sample name ("gpt-tiny") or "package.module:callable".

    The module is imported now (so a wrong spec fails at once); the model is built when the
    builder is called, and its result checked to be (model, example_inputs).
    """
    import sample_models

    if ":" not in spec:
        if spec in sample_models.REGISTRY:
            return sample_models.REGISTRY[spec]
        raise ModelSpecError(
            f"unknown model {spec!r}: use a sample name ({', '.join(sample_models.names())}) "
            "or package.module:callable returning (model, example_inputs)"
        )
    module_name, _, attr = spec.partition(":")
    if not module_name or not attr:
        raise ModelSpecError(f"model {spec!r}: write package.module:callable")
    try:
        module = importlib.import_module(module_name)
    except Exception as e:  # noqa: BLE001 - any import-time error of the user's module
        raise ModelSpecError(f"cannot import {module_name!r} for model {spec!r}: {e}") from None
    fn = getattr(module, attr, None)
    if not callable(fn):
        raise ModelSpecError(f"{module_name} has no callable {attr!r} (from model {spec!r})")

    def build() -> tuple[nn.Module, tuple[torch.Tensor, ...]]:
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
        if (
            not isinstance(result, tuple)
            or len(result) != 2
            or not isinstance(result[0], nn.Module)
            or not isinstance(result[1], Sequence)
        ):
            raise ModelSpecError(f"{spec} must return (model, example_inputs), got {type(result)}")
        return result[0], tuple(result[1])

    return build


def load_model(spec: str) -> tuple[nn.Module, tuple[torch.Tensor, ...]]:
    """(model, example_inputs) for a MODEL argument."""
    return resolve_builder(spec)()
