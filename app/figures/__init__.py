"""Figures as plain data: pure functions from numbers to plotly dicts and cytoscape elements.

No Dash and no `core` solving here, so tests call them without a browser. Plotly figures are
plain dicts (faster than `go.Figure`). One module per view; every colour comes from
`app.figures.palette`.
"""

from app.figures.axes import MAX_POINTS, decimate, pick_unit, step_x
from app.figures.graph import graph_elements, graph_prefix, graph_stylesheet
from app.figures.hover import hover_html
from app.figures.palette import FATE_COLORS, KIND_COLORS, PEAK_COLOR
from app.figures.tensors import MAX_BANDS, tensor_figure
from app.figures.timeline import (
    T_ACTIVATIONS,
    T_BUDGET,
    T_GRADIENTS,
    T_MARKER,
    T_PEAK,
    T_RECOMPUTE,
    T_TEMPORARIES,
    marker_trace,
    measured_trace,
    timeline_figure,
)
from app.figures.tradeoff import (
    OFFLOAD_CURVES,
    StrategyMark,
    add_strategy_points,
    budget_shape,
    floor_note,
    floor_shape,
    method_color,
    tradeoff_figure,
)
from app.figures.transfers import transfer_figure

__all__ = [
    "FATE_COLORS",
    "KIND_COLORS",
    "MAX_BANDS",
    "MAX_POINTS",
    "OFFLOAD_CURVES",
    "PEAK_COLOR",
    "T_ACTIVATIONS",
    "T_BUDGET",
    "T_GRADIENTS",
    "T_MARKER",
    "T_PEAK",
    "T_RECOMPUTE",
    "T_TEMPORARIES",
    "StrategyMark",
    "add_strategy_points",
    "budget_shape",
    "decimate",
    "step_x",
    "floor_note",
    "floor_shape",
    "graph_elements",
    "graph_prefix",
    "graph_stylesheet",
    "hover_html",
    "marker_trace",
    "measured_trace",
    "method_color",
    "pick_unit",
    "tensor_figure",
    "timeline_figure",
    "tradeoff_figure",
    "transfer_figure",
]
