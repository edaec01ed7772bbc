"""Callbacks: thin glue from page events to `app.state` (core, cached) and `app.figures`.

One module per concern, each with a `register(app, studio)` (`fit` has none: the slider's
`paint` draws it); outputs are named (dicts), not long tuples.
"""

from __future__ import annotations

from dash import Dash

from app.callbacks import (
    analysis,
    architectures,
    batch,
    budget,
    compare,
    export,
    fresh,
    graph,
    lesson,
    measured,
    memory,
    parallel,
    step_through,
)
from app.callbacks.common import plain_error
from app.state import Studio

__all__ = ["plain_error", "register"]


def register(app: Dash, studio: Studio) -> None:
    """Every callback of the page, by concern."""
    for group in (
        analysis,
        budget,
        graph,
        memory,
        measured,
        step_through,
        export,
        fresh,
        batch,
        lesson,
        compare,
        parallel,
        architectures,
    ):
        group.register(app, studio)
