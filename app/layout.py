"""The page: controls, numbers, block graph, memory timeline, trade-off curve, export, teaching."""

from __future__ import annotations

import json
from typing import Any

import dash_cytoscape as cyto
from dash import dcc, html

from app import ids
from app.architectures import (
    DEFAULT_ARCH,
    DEFAULT_BATCH,
    DEFAULT_GPU,
    GPUS,
    MIN_SEQ,
    arch_options,
    default_seq,
    missing,
)
from app.explain import FATE_TEXT
from app.figures import graph_stylesheet
from app.figures.axes import empty_figure
from app.figures.palette import FATE_COLORS
from app.panels import compare_card, lesson_card
from app.parallel_card import parallel_card
from app.state import DEVICES, METHOD_LABELS, STEP_LABELS, STEP_OPTIONS
from app.strategies import STRATEGY_LABELS
from app.words import GLOSSARY
from core import OPTIMIZER

TICK_MS = 250  # play's tick; SPEEDS are steps per tick
SPEEDS = (1, 5, 25, 100)

EXPORT_CODE = """import core
plan = core.load_plan("plan.pkl")
model = core.apply_plan(model, plan)
# then train as usual: loss = loss_fn(model(*inputs)); loss.backward(); optimizer.step()
# a model with its loss outside (a core.ModelCall): apply_plan(model, plan, loss_fn=loss_fn)
# returns the loss itself: loss = model(**inputs, targets=labels)"""


def build_layout(
    models: list[str], model: str, method: str, methods: list[str], startup_error: str
) -> html.Div:
    return html.Div(
        className="page",
        children=[
            html.Header(
                className="header",
                children=[
                    html.H1("Remat Studio"),
                    html.Span(
                        "fit training into memory by recomputing activations",
                        className="tagline",
                    ),
                ],
            ),
            html.Div(
                startup_error,
                id=ids.STARTUP_ERROR,
                className="message error",
                role="alert",
                hidden=not startup_error,
            ),
            _controls(models, model, method, methods),
            _architecture_row(),
            _busy_bar(),
            html.Div(id=ids.CANCEL_NOTE, className="message warn", role="status", hidden=True),
            html.Div(id=ids.ERROR, className="message error", role="alert", hidden=True),
            lesson_card(),
            html.Details(
                open=True,
                className="card intro",
                children=[
                    html.Summary("What is rematerialization?"),
                    html.Div(
                        id=ids.INTRO, className="view", children="Analysing the model…", **fresh()
                    ),
                ],
            ),
            _glossary(),
            _budget_row(),
            html.Div(
                className="grid",
                children=[
                    html.Div(
                        className="card view", id=ids.GRAPH_CARD, children=_graph_card(), **fresh()
                    ),
                    html.Div(className="card", children=_timeline_card()),
                ],
            ),
            html.Div(
                className="grid",
                children=[
                    html.Div(className="card", children=_tradeoff_card()),
                    html.Div(className="card", children=_export_card()),
                ],
            ),
            html.Div(className="card", children=compare_card()),
            html.Div(
                className="card view", id=ids.PARALLEL_CARD, children=parallel_card(), **fresh()
            ),
            dcc.Store(id=ids.CONTEXT),
            dcc.Store(id=ids.GRAPH_OPEN, data=[]),
            dcc.Store(id=ids.LESSON),
            dcc.Store(id=ids.LESSON_PENDING),
            dcc.Store(id=ids.LESSON_VIEW),
            dcc.Store(id=ids.PLAN),
            dcc.Store(id=ids.STEP),
            dcc.Store(id=ids.MEASURED),
            dcc.Interval(id=ids.TICKER, interval=TICK_MS, disabled=True),
            dcc.Download(id=ids.DOWNLOAD),
        ],
    )


def fresh() -> dict[str, Any]:
    """A view's `data-for` before anything is drawn: for no controls, so the page is busy."""
    return {"data-for": ""}


def _busy_bar() -> html.Div:
    """The one busy indicator: shown by the page's watcher (assets/app.js) while any view
    differs from the controls; the background job fills its bar and words."""
    return html.Div(
        id=ids.PROGRESS,
        className="progress",
        role="status",
        children=[
            html.Progress(id=ids.PROGRESS_BAR, max="100", value="0"),
            html.Span(id=ids.PROGRESS_TEXT),
            html.Span(className="busy-what"),
            html.Button(
                "cancel",
                id=ids.CANCEL,
                className="small",
                title="stop, and put the controls back to what the page shows",
            ),
        ],
    )


def _controls(models, model, method, methods):
    # the watcher reads the method menu's label: it needs each label's method
    labels: dict[str, Any] = {
        "data-method-labels": json.dumps(
            {label: m for m, label in {**METHOD_LABELS, **STRATEGY_LABELS}.items()}
        )
    }
    return html.Div(
        className="controls card",
        **labels,
        children=[
            html.Label(
                ["model", dcc.Dropdown(models, model, id=ids.MODEL, clearable=False)],
                className="control wide",
            ),
            html.Label(
                [
                    "cost model",
                    dcc.RadioItems(
                        [
                            {"label": "estimated for", "value": "estimated"},
                            {"label": "measured here", "value": "measured"},
                        ],
                        "estimated",
                        id=ids.COSTS,
                        inline=True,
                    ),
                ],
                className="control",
            ),
            html.Label(
                [
                    "device",
                    dcc.Dropdown(list(DEVICES), "cpu", id=ids.DEVICE, clearable=False),
                    html.Span(id=ids.DEVICE_NOTE, className="hint"),
                ],
                className="control",
            ),
            html.Label(
                [
                    "method",
                    dcc.Dropdown(
                        [{"label": METHOD_LABELS.get(m, m), "value": m} for m in methods],
                        method,
                        id=ids.METHOD,
                        clearable=False,
                    ),
                ],
                className="control wide",
            ),
            html.Div(
                dcc.Checklist(
                    [{"label": "offload to host memory", "value": "on"}],
                    [],
                    id=ids.OFFLOAD,
                ),
                className="control offload",
                title="also park activations in host memory and bring them back before the "
                "backward reads them: re-solves with offloading and draws its trade-off curve",
            ),
            html.Div(
                dcc.Checklist(
                    [{"label": STEP_LABELS[o], "value": o} for o in STEP_OPTIONS],
                    [],
                    id=ids.STEP_OPTS,
                ),
                className="control offload",
                title="analyse the step with AdamW's update of each parameter inside the "
                "backward (each gradient freed after its update), and/or the LM head's loss "
                "computed over chunks of rows: both lower the floor no plan goes below",
            ),
        ],
    )


def _architecture_row() -> html.Div:
    """The Hugging Face architectures menu: one at its published size, a batch and a sequence
    length, the GPU to plan for; "plan" adds it to the model menu and analyses it."""
    why = missing()
    return html.Div(
        className="card arch-menu",
        children=[
            html.Label(
                [
                    "Hugging Face architecture (published size, meta device)",
                    dcc.Dropdown(
                        arch_options(),
                        DEFAULT_ARCH,
                        id=ids.ARCH,
                        clearable=False,
                        disabled=bool(why),
                    ),
                ],
                className="control wide",
            ),
            html.Label(
                [
                    "batch",
                    dcc.Input(
                        id=ids.ARCH_BATCH,
                        type="number",
                        style={"width": "8em"},  # on Dash 4's wrapper: room for 6 digits
                        value=DEFAULT_BATCH,
                        min=1,
                        step=1,
                    ),
                ],
                className="control narrow",
            ),
            html.Label(
                [
                    "sequence length",
                    dcc.Input(
                        id=ids.ARCH_SEQ,
                        type="number",
                        style={"width": "8em"},  # on Dash 4's wrapper: room for 6 digits
                        value=default_seq(DEFAULT_ARCH),
                        min=MIN_SEQ,
                        step=1,
                    ),
                ],
                className="control narrow",
            ),
            html.Label(
                [
                    "planned for",
                    dcc.Dropdown(list(GPUS), DEFAULT_GPU, id=ids.ARCH_DEVICE, clearable=False),
                ],
                className="control narrow",
            ),
            html.Button(
                "plan it",
                id=ids.ARCH_PLAN,
                disabled=bool(why),
                title="add this architecture at this shape to the model menu and analyse it for "
                "the GPU: the attention kernel torch picks there, the caching allocator's rounding",
            ),
            html.Span(id=ids.ARCH_NOTE, className="hint"),
            html.Div(
                why, id=ids.ARCH_ERROR, className="message warn", role="alert", hidden=not why
            ),
            html.P(id=ids.ARCH_FIT, className="view arch-fit", **fresh()),
        ],
    )


def _glossary() -> html.Details:
    return html.Details(
        className="card intro glossary",
        children=[
            html.Summary("Words used here"),
            html.Dl([part for term, text in GLOSSARY for part in (html.Dt(term), html.Dd(text))]),
        ],
    )


def _number(label: str, id_: str, title: str | None = None) -> html.Div:
    return html.Div(
        className="number",
        title=title,
        children=[html.Div("–", id=id_, className="value"), html.Div(label)],
    )


def _budget_row():
    return html.Div(
        id=ids.NUMBERS,
        className="card budget view",
        **fresh(),
        children=[
            html.Div(
                className="budget-slider",
                children=[
                    html.Div(
                        ["budget ", html.Span(id=ids.BUDGET_BYTES, className="bytes")],
                        className="budget-label",
                    ),
                    html.Div(
                        className="budget-inputs",
                        children=[
                            dcc.Slider(
                                min=0,
                                max=100,
                                step=0.5,
                                value=None,
                                id=ids.BUDGET,
                                marks=None,
                                allow_direct_input=False,
                                tooltip={
                                    "placement": "top",
                                    "always_visible": False,
                                },  # under it: over the marks
                                className="slider",
                            ),
                            html.Label(
                                [
                                    dcc.Input(
                                        id=ids.BUDGET_INPUT,
                                        type="text",
                                        debounce=True,  # commits on Enter or blur
                                        size="6",
                                        # on the wrapper Dash 4 puts round the box, which
                                        # otherwise shrinks it to one character
                                        style={"width": "6em"},
                                        # a decimal keypad on phones; the stubs miss it
                                        inputMode="decimal",  # type: ignore[arg-type]
                                    ),
                                    " %",
                                ],
                                className="budget-typed",
                                title="type a budget in % of the store-all peak, then Enter",
                            ),
                        ],
                    ),
                    html.Div(
                        id=ids.BUDGET_MESSAGE, className="message warn", role="alert", hidden=True
                    ),
                    html.Div(
                        id=ids.PLAN_ERROR, className="message warn", role="alert", hidden=True
                    ),
                    html.P(id=ids.BUDGET_HINT, className="hint"),
                ],
            ),
            _number("predicted peak", ids.PEAK),
            _number("extra time", ids.OVERHEAD),
            _number("recomputed ops", ids.RECOMPUTED),
            _number("solve time", ids.SOLVE_TIME),
            _number("parked on host", ids.HOST),
            _number(
                "run natively",
                ids.NATIVE_PEAK,
                "the predicted peak when this plan runs as PyTorch's own checkpoints on the "
                "model's layers (apply_plan(..., runtime='native'), for torch.compile and "
                "FSDP2): what native execution can express of it",
            ),
        ],
    )


def _graph_card():
    legend = [
        html.Span([html.I(style={"background": FATE_COLORS[f]}), f], title=FATE_TEXT[f])
        for f in FATE_COLORS
    ]
    legend.append(html.Span([html.I(className="ring"), "alive at the step"]))
    return [
        html.H2("Blocks and their forward ops"),
        html.P(
            "Boxes are blocks (identical blocks share a tint); dots are forward ops, coloured "
            "by what the plan does with their results. Each layer is one box, outlined by "
            "what the plan does with its ops (red: some recomputed); click a layer to open it "
            "into its ops and list them, click again to close it.",
            className="hint",
        ),
        cyto.Cytoscape(
            id=ids.GRAPH,
            elements=[],
            layout={"name": "preset", "fit": True, "padding": 10},
            stylesheet=graph_stylesheet(),
            style={"width": "100%", "height": "420px"},
            minZoom=0.2,
            maxZoom=3,
            boxSelectionEnabled=False,
        ),
        html.Div(legend, id=ids.GRAPH_LEGEND, className="legend"),
        html.Div("Point at an op to name it.", id=ids.GRAPH_HOVER, className="hint"),
        html.Div(id=ids.BLOCK_PANEL, className="block-panel"),
    ]


def _plot(id_: str, height: int, own_busy: bool = False) -> dcc.Graph:
    """An empty zoomable figure the callbacks fill (no lasso or box select: nothing to select).
    `own_busy`: it shows its own busy sign while stale, not the page's (assets/app.js)."""
    return dcc.Graph(
        id=id_,
        # its figure's layout.meta.for: the controls it was drawn for
        className="view plot own-busy" if own_busy else "view plot",
        figure=empty_figure(height),
        config={"displaylogo": False, "modeBarButtonsToRemove": ["lasso2d", "select2d"]},
    )


def _timeline_card():
    return [
        html.H2("Memory timeline"),
        _plot(ids.TIMELINE, 360),
        _stepper(),
        html.Div(
            [
                html.Span(id=ids.STEP_TEXT, className="step-text"),
                html.P(
                    "Press play or step to walk through the program.",
                    id=ids.STEP_WHY,
                    className="why view",
                    **fresh(),
                ),
            ],
            className="step-box",
        ),
        html.Div(id=ids.PEAK_LIST, className="peak-list"),
        html.Div(  # only with offloading on: the copies' own lane
            id=ids.TRANSFER_LANE,
            hidden=True,
            children=[
                html.H3("Transfer lane"),
                html.P(
                    "Copies to host memory and back run on a lane of their own beside "
                    "compute, at the host link's speed; a copy back that arrives late makes "
                    "compute wait (red).",
                    className="hint",
                ),
                _plot(ids.TRANSFERS, 240),
            ],
        ),
        html.Div(
            className="stepper",
            children=[
                html.Button(
                    "measure here",
                    id=ids.MEASURE,
                    title="run this plan's real training step on this machine and draw the "
                    "live bytes it measures over the prediction",
                ),
                html.Span(id=ids.MEASURE_TEXT, className="step-text"),
            ],
        ),
        html.H2("Each tensor alive over the program"),
        html.P(
            "Every storage the step allocates, as a band from the step that makes it to the "
            "step that frees it, stacked in allocation order (as pytorch.org/memory_viz draws "
            "them). Point at a band for the op, the module and the line of Python that made it.",
            className="hint",
        ),
        _plot(ids.TENSORS, 380),
        html.H2("Addresses: one arena for the whole step"),
        html.P(
            "Where each storage would sit if the step ran in one block of memory laid out in "
            "advance (largest storages first, each at the lowest free address). Rectangles span "
            "the steps a storage is alive; the gap between the arena's top and the live-bytes "
            "peak is fragmentation, the memory a static allocator pays beyond the peak.",
            className="hint",
        ),
        _plot(ids.ARENA, 420),
    ]


def _stepper() -> html.Div:
    """Step-through controls, right under the timeline their marker moves on."""
    return html.Div(
        className="stepper",
        children=[
            html.Button("|◀", id=ids.STEP_RESET, title="back to the start"),
            html.Button("◀", id=ids.STEP_BACK, title="previous step"),
            html.Button("▶ play", id=ids.PLAY, title="play / pause"),
            html.Button("▶|", id=ids.STEP_NEXT, title="next step"),
            html.Label(
                [
                    "speed ",
                    dcc.Dropdown(
                        [{"label": f"{n * 4} steps/s", "value": n} for n in SPEEDS],
                        1,
                        id=ids.SPEED,
                        clearable=False,
                        searchable=False,
                    ),
                ],
                className="speed",
            ),
            html.Button("to the peak", id=ids.JUMP_PEAK, title="jump to the peak step"),
            html.Button(
                "next recompute", id=ids.JUMP_RECOMPUTE, title="jump to the next recomputed op"
            ),
            html.Button(
                "next copy",
                id=ids.JUMP_TRANSFER,
                disabled=True,  # until the plan on screen has copies
                title="jump to the next offload or prefetch (offloading plans)",
            ),
        ],
    )


def _tradeoff_card():
    return [
        html.H2("Trade-off: extra time against memory"),
        html.P("Click a point to set the budget.", className="hint"),
        dcc.Graph(
            id=ids.TRADEOFF,
            className="view plot own-busy",  # its own busy sign: the budget does not move it
            figure=empty_figure(300),
            config={"displaylogo": False, "displayModeBar": False},
        ),
        html.P(id=ids.TRADEOFF_NOTE, className="hint"),
    ]


def _export_card():
    return [
        html.H2("Will it fit?"),
        html.P(
            "Training holds more than the step's budget: the parameters, the optimizer's state "
            f"({OPTIMIZER}) and the batch. At the peak step, against the device's memory:",
            className="hint",
        ),
        _plot(ids.FIT, 200),
        html.P(id=ids.FIT_TEXT, className="fit-answer"),
        html.P(
            "Memory against batch size: the whole footprint of plain PyTorch and of the plan "
            "at this budget fraction, each batch size traced and planned again (a background "
            "job), against the device's memory.",
            className="hint",
        ),
        _plot(ids.BATCH_FIG, 260, own_busy=True),
        html.P(id=ids.BATCH_TEXT, className="hint"),
        html.H2("Use this plan"),
        html.P("Download the plan on screen and apply it in your training script:"),
        html.Button("download plan.pkl", id=ids.EXPORT, className="primary"),
        html.Pre(html.Code(EXPORT_CODE), id=ids.EXPORT_CODE),
    ]
