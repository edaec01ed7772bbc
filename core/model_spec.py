"""Resolve a MODEL argument: a sample model's short name or `package.module:callable`."""

from __future__ import annotations

import importlib
from collections.abc import Sequence

import torch
from torch import nn

from core.errors import RematError


class ModelSpecError(RematError):
    """A MODEL argument that names nothing loadable."""


def load_model(spec: str) -> tuple[nn.Module, tuple[torch.Tensor, ...]]:
    """(model, example_inputs) for a sample name ("gpt-tiny") or "package.module:callable"."""
    import sample_models

    if ":" not in spec:
        if spec in sample_models.REGISTRY:
            return sample_models.build(spec)
        raise ModelSpecError(
            f"unknown model {spec!r}: use a sample name ({', '.join(sample_models.names())}) "
            "or package.module:callable returning (model, example_inputs)"
        )
    module_name, _, attr = spec.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise ModelSpecError(f"cannot import {module_name!r} for model {spec!r}: {e}") from None
    fn = getattr(module, attr, None)
    if not callable(fn):
        raise ModelSpecError(f"{module_name} has no callable {attr!r} (from model {spec!r})")
    result = fn()
    if (
        not isinstance(result, tuple)
        or len(result) != 2
        or not isinstance(result[0], nn.Module)
        or not isinstance(result[1], Sequence)
    ):
        raise ModelSpecError(f"{spec} must return (model, example_inputs), got {type(result)}")
    return result[0], tuple(result[1])
