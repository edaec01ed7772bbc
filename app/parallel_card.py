"""The "Beyond one device" card: a devices control and per-device memory of each
data x tensor-parallel layout (filled by `app.callbacks.parallel`)."""

from __future__ import annotations

from dash import dcc, html

from app import ids
from app.figures.axes import empty_figure
from app.state import PARALLEL_DEVICES


def parallel_card() -> list:
    """The card's children; the card itself carries `data-for`/`data-devices` (a view)."""
    return [
        html.H2("Beyond one device"),
        html.P(
            "Split the step over several devices of this preset: data parallel (each device a "
            "micro-batch; FSDP also shards the parameters) and tensor parallel (each layer's "
            "column → row pairs of linear layers split across devices). Memory per device "
            "for each layout the planner considers, fastest per micro-batch first:",
            className="hint",
        ),
        html.Div(
            className="row",
            children=[
                html.Label("devices", htmlFor=ids.DEVICES_N),
                dcc.RadioItems(
                    id=ids.DEVICES_N,
                    options=[{"label": str(n), "value": n} for n in PARALLEL_DEVICES],
                    value=1,
                    inline=True,
                ),
            ],
        ),
        html.Div(id=ids.PARALLEL_TEXT),
        dcc.Graph(
            id=ids.PARALLEL_FIG,
            figure=empty_figure(60),
            config={"displaylogo": False},
        ),
    ]
