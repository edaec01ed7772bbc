"""Two panels of the page: the lesson path's card and the compare view."""

from __future__ import annotations

from dash import dcc, html

from app import ids
from app.figures.axes import empty_figure
from app.state import METHOD_LABELS


def plot(id_: str, height: int) -> dcc.Graph:
    """An empty figure the callbacks fill, stamped later with what it is drawn for."""
    return dcc.Graph(
        id=id_,
        className="view plot",
        figure=empty_figure(height),
        config={"displaylogo": False, "modeBarButtonsToRemove": ["lasso2d", "select2d"]},
    )


def lesson_card() -> html.Details:
    """The lesson path's card: a step's title and question, back/next, reveal."""
    return html.Details(
        open=True,
        className="card lesson",
        children=[
            html.Summary("Lesson: from plain PyTorch to the floor, in five steps"),
            html.Div(
                className="lesson-bar",
                children=[
                    html.Button("start the lesson", id=ids.LESSON_START, className="primary"),
                    html.Button("◀ back", id=ids.LESSON_BACK, disabled=True),
                    html.Button("next ▶", id=ids.LESSON_NEXT, disabled=True),
                    html.B(id=ids.LESSON_TITLE),
                ],
            ),
            html.P(id=ids.LESSON_QUESTION, className="lesson-question"),
            html.Button(
                "reveal the answer",
                id=ids.LESSON_REVEAL,
                className="small",
                disabled=True,  # until a step asks its question
            ),
            html.P(id=ids.LESSON_ANSWER, className="lesson-answer", hidden=True),
        ],
    )


def compare_card() -> list:
    """Two plans side by side: the one on screen and another method or budget."""
    return [
        html.H2("Compare: the plan on screen (A) beside another (B)"),
        html.Div(
            className="compare-controls",
            children=[
                html.Label(
                    [
                        "B's method",
                        dcc.Dropdown(
                            [
                                {"label": label, "value": m}
                                for m, label in METHOD_LABELS.items()
                                if m != "checkmate"
                            ],
                            "checkpoint_blocks",
                            id=ids.COMPARE_METHOD,
                            clearable=False,
                        ),
                    ],
                    className="control wide",
                ),
                html.Label(
                    [
                        "B's budget (% of the store-all peak)",
                        dcc.Input(id=ids.COMPARE_BUDGET, type="number", value=100, min=0, max=100),
                    ],
                    className="control",
                ),
            ],
        ),
        html.Div(
            className="compare",
            children=[plot(ids.COMPARE_A, 260), plot(ids.COMPARE_B, 260)],
        ),
        html.Div(id=ids.COMPARE_DIFF, className="compare-diff"),
    ]
