"""A layer's key/value cache under native execution: refused with a clear error.

A Hugging Face decoder layer called with a cache object (`cache`, `past_key_values`, ...)
appends its keys and values to it: a side effect outside autograd. Under checkpoint the
backward re-runs the layer, which appends them a second time (the step then fails on shapes,
or worse, a later read sees doubled entries). Hugging Face's own gradient checkpointing drops
the cache in training with a warning; a native plan cannot do the same silently, since the
plan was traced with the cache's ops, and dropping it would run other ops than planned. So the
call is refused, naming the fix: analyse and call the model with `use_cache=False`.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from core.errors import PlanMismatch

# the names Hugging Face layers take their cache under (GradientCheckpointingLayer's list)
CACHE_KWARGS = ("cache", "past_key_values", "past_key_value", "layer_past")

Guard = Callable[[Sequence[Any], Mapping[str, Any]], None]


def kv_cache_guard(module: str, forward: Callable[..., Any]) -> Guard:
    """A check for each call of the checkpointed layer `module` (its bound `forward`):
    PlanMismatch when a cache object it would update is passed, by keyword or by position
    (GPT-2's blocks take it second). Layers that only read the cache (HF's
    `_can_checkpoint_with_cache`) and forwards without such a parameter get no check."""
    owner = getattr(forward, "__self__", None)
    try:
        params = list(inspect.signature(forward).parameters)
    except (TypeError, ValueError):  # no signature to read: keywords only
        params = []
    at = {name: params.index(name) for name in CACHE_KWARGS if name in params}
    if getattr(owner, "_can_checkpoint_with_cache", False):
        return lambda args, kwargs: None

    def guard(args: Sequence[Any], kwargs: Mapping[str, Any]) -> None:
        for name in CACHE_KWARGS:
            i = at.get(name)
            given = args[i] if i is not None and i < len(args) else kwargs.get(name)
            if given is not None:
                raise PlanMismatch(
                    f"{module}: called with a key/value cache (`{name}`), which the layer's "
                    "recompute in the backward would update a second time: call the model "
                    "with use_cache=False and analyse it so too (or set "
                    "model.config.use_cache = False before core.analyze), as Hugging Face's "
                    "gradient checkpointing does in training"
                )

    return guard
