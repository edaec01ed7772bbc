"""The Hugging Face architectures menu (`app.architectures`): "plan" puts the chosen
architecture at the typed batch and sequence length among the models, selects it and sets
the device it is planned for; the page's analysis then runs as for any model."""

from __future__ import annotations

from dash import Dash, Input, Output, State, no_update

from app import ids
from app.architectures import (
    ARCHITECTURES,
    DEFAULT_GPU,
    GPUS,
    ShapeError,
    add,
    default_seq,
    missing,
    model_options,
)
from app.state import Studio


def register(app: Dash, studio: Studio) -> None:
    @app.callback(
        Output(ids.MODEL, "options"),
        Output(ids.MODEL, "value", allow_duplicate=True),
        Output(ids.DEVICE, "value", allow_duplicate=True),
        Output(ids.COSTS, "value", allow_duplicate=True),
        Output(ids.ARCH_ERROR, "children"),
        Output(ids.ARCH_ERROR, "hidden"),
        Input(ids.ARCH_PLAN, "n_clicks"),
        State(ids.ARCH, "value"),
        State(ids.ARCH_BATCH, "value"),
        State(ids.ARCH_SEQ, "value"),
        State(ids.ARCH_DEVICE, "value"),
        prevent_initial_call=True,
    )
    def plan_architecture(clicks, name, batch, seq, device):
        why = missing()
        if not why:
            try:
                value = add(studio, name, batch, seq)
            except ShapeError as e:
                why = str(e)
        if why:
            return no_update, no_update, no_update, no_update, why, False
        device = device if device in GPUS else DEFAULT_GPU
        # op times estimated for the GPU: a meta-device model cannot be measured here
        return model_options(studio), value, device, "estimated", "", True

    @app.callback(
        Output(ids.ARCH_NOTE, "children"),
        Output(ids.ARCH_SEQ, "max"),
        Output(ids.ARCH_SEQ, "value"),
        Input(ids.ARCH, "value"),
    )
    def describe_architecture(name):
        """The chosen architecture's published numbers, and its sequence length: 8,192
        tokens or its longest (at 1,024 a 1-8B model's peak is its gradients)."""
        arch = ARCHITECTURES.get(name)
        if arch is None:
            return "", no_update, no_update
        dtype = str(arch.dtype).removeprefix("torch.")
        return (
            (
                f"{arch.source}'s config: {arch.layers} layers, {arch.size_words} in {dtype}; "
                f"sequences up to {arch.max_seq:,} tokens"
            ),
            arch.max_seq,
            default_seq(name),
        )
