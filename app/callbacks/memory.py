"""The memory views of the plan on screen: the step marker on the timeline, the per-tensor
view, the transfer lane, the arena (drawn with the timeline by `app.callbacks.budget`'s one
request), and what is alive at the peak."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from dash import Dash, Input, Output, Patch, State, html
from dash.exceptions import PreventUpdate

from app import figures, ids
from app.arena import arena_figure
from app.callbacks.common import blank, no_plan_words, plan_of, shown, stamp
from app.explain import link_text
from app.readback import alive_at, fate_at, peak_step
from app.reasons import peak_reason
from app.state import Studio
from core import arena, fmt_bytes

PEAK_ROWS = 10  # storages listed at the peak


def register(app: Dash, studio: Studio) -> None:
    @app.callback(
        Output(ids.TIMELINE, "figure", allow_duplicate=True),
        Input(ids.STEP, "data"),
        State(ids.PLAN, "data"),
        prevent_initial_call=True,
    )
    def move_marker(step, plan_ref):
        plan, problem = shown(studio, plan_ref)
        patch = Patch()
        _, size = figures.pick_unit(plan_ref and problem.store_all_peak)
        height = max(plan.predicted_peak, plan_ref["budget"]) / size
        patch["data"][figures.T_MARKER] = figures.marker_trace(step, height)
        return patch

    @app.callback(
        Output(ids.PEAK_LIST, "children"),
        Input(ids.STEP, "data"),
        State(ids.PLAN, "data"),
        prevent_initial_call=True,
    )
    def list_peak(step, plan_ref):
        """At the peak step: what is alive there, largest first."""
        return peak_items(studio, plan_ref, step)


def tensors_view(studio: Studio, plan_ref: dict | None) -> dict:
    """The per-tensor view of the plan on screen."""
    ref = plan_ref or {}

    def draw(plan, problem):
        rows = studio.tensors(ref["key"], ref["method"], ref["budget"])
        return figures.tensor_figure(
            rows,
            len(plan.program),
            plan.backward_start,
            unit=figures.pick_unit(problem.store_all_peak),
        )

    return plan_view(studio, plan_ref, draw)


def transfers_view(studio: Studio, plan_ref: dict | None) -> dict:
    """The transfer lane of the plan on screen: copies and compute stalls over time."""

    def draw(plan, problem):
        sim, values = plan.simulate(), problem.graph.values
        return figures.transfer_figure(
            sim.transfers,
            sim.waits,
            [v.name for v in values],
            [v.nbytes for v in values],
            link_text(problem),
        )

    return plan_view(studio, plan_ref, draw)


def arena_view(studio: Studio, plan_ref: dict | None) -> dict:
    """The address-by-time view of the plan on screen (`core.arena`)."""
    return plan_view(
        studio,
        plan_ref,
        lambda plan, problem: arena_figure(arena(plan), problem.graph, plan.backward_start),
    )


def plan_view(studio: Studio, plan_ref: dict | None, draw: Callable[[Any, Any], dict]) -> dict:
    """`draw(plan, problem)` for the plan on screen, stamped with the controls it is for; a
    blank figure saying so when no plan fits the budget."""
    plan, problem = plan_of(studio, plan_ref)
    sig = plan_ref.get("for") if plan_ref else None
    if sig is None:
        raise PreventUpdate
    if plan is None:
        return blank(sig, no_plan_words(plan_ref))
    return stamp(draw(plan, problem), sig)


def peak_items(studio: Studio, plan_ref: dict | None, step: int | None) -> list:
    """The peak list's children at `step`: empty unless `step` is the peak of the plan on
    screen. Each storage says what it is at the peak (`fate_at`), not its op's fate over the
    whole program: an offloaded op's storage alive at the peak is on the device."""
    plan, problem = plan_of(studio, plan_ref)
    if plan is None or plan_ref is None or step is None or step != peak_step(plan.timeline):
        return []
    sim = plan.simulate()
    rows = studio.tensors(plan_ref["key"], plan_ref["method"], plan_ref["budget"])
    here = [{**r, "fate": fate_at(sim, r["value"], r["fate"], step)} for r in alive_at(rows, step)]
    return [html.P(peak_reason(problem, plan), className="peak-why"), *peak_list(here)]


def peak_list(rows: list[dict]) -> list:
    """The storages alive at the peak, largest first (`PEAK_ROWS` of them, then a count);
    each one's description in its tooltip."""
    total = sum(r["nbytes"] for r in rows)
    items = [
        html.Li(
            [
                html.B(fmt_bytes(r["nbytes"])),
                " ",
                html.Span(r.get("words") or r["name"]),
                html.Span(f" ({r['name']})", className="aten"),
                f" · {r['fate']}",
            ],
            title=str(r["text"]),
        )
        for r in rows[:PEAK_ROWS]
    ]
    more = len(rows) - len(items)
    return [
        html.P(
            f"This is the peak: {fmt_bytes(total)} in {len(rows)} storages set it. Largest first:"
        ),
        html.Ol(items + ([html.Li(f"… and {more} smaller")] if more > 0 else [])),
    ]
