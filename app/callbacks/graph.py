"""The block graph: colours for the plan and the step, the op under the mouse, a block's ops."""

from __future__ import annotations

from typing import Any

from dash import Dash, Input, Output, State, html
from dash.exceptions import PreventUpdate

from app import figures, ids
from app.callbacks.common import block_graph, plan_of, shown
from app.explain import FATE_TEXT, step_view
from app.readback import block_fates, fate_of_ops, op_fates
from app.state import Studio
from core import fmt_bytes, op_name

# An opened block is brought into view at a zoom where its ops' names read (OP_FONT px or
# more): the preset layout fits the whole model, where they were ~5 px. dash-cytoscape
# re-runs that layout 100 ms after the last element change, which under load comes after
# this callback: so the zoom is made now and again after every layout, to the block opened
# last while its ops are in the graph. Centred, or from its top when taller than the view.
ZOOM_JS = """function (opened, node) {
  if (!node || node.block === undefined || node.block === null
      || (node.op !== undefined && node.op !== null)) { return; }
  if (!opened || !opened.includes(node.block)) { return; }
  const host = document.getElementById("GRAPH");
  const el = host && [host, ...host.querySelectorAll("*")].find(e => e._cyreg);
  if (!el) { return; }
  const cy = el._cyreg.cy;
  const zoomIn = () => {
    const block = cy.scratch("opened-last");
    if (!cy.nodes(".op").some(n => n.data("block") === block)) { return; }
    const box = cy.nodes().filter(n => n.data("block") === block
      && (n.data("op") === undefined || n.data("op") === null));
    if (!box.length) { return; }
    const bb = box.boundingBox();
    const z = Math.max(1, Math.min(cy.width() / (bb.w + 40), cy.height() / (bb.h + 40), 2));
    const x = cy.width() / 2 - z * (bb.x1 + bb.w / 2);
    const y = z * bb.h + 40 <= cy.height() ? cy.height() / 2 - z * (bb.y1 + bb.h / 2)
      : 20 - z * bb.y1;
    cy.viewport({zoom: z, pan: {x: x, y: y}});
  };
  cy.scratch("opened-last", node.block);
  if (!cy.scratch("zoom-after-layout")) {
    cy.scratch("zoom-after-layout", true);
    cy.on("layoutstop", zoomIn);
  }
  requestAnimationFrame(() => requestAnimationFrame(zoomIn));
}""".replace("GRAPH", ids.GRAPH)


def register(app: Dash, studio: Studio) -> None:
    app.clientside_callback(  # no output: the graph's viewport is moved in place
        ZOOM_JS,
        Input(ids.GRAPH_OPEN, "data"),
        State(ids.GRAPH, "tapNodeData"),
        prevent_initial_call=True,
    )

    @app.callback(
        output=GRAPH_VIEW,
        inputs=[Input(ids.STEP, "data")],
        state=[State(ids.PLAN, "data")],
        prevent_initial_call=True,
    )
    def colour_graph(step, plan_ref):
        """Graph colours and the step's words for the step-through (a new plan's come with
        it, from `app.callbacks.budget.solve`)."""
        return graph_view(studio, plan_ref, step)

    @app.callback(
        Output(ids.GRAPH_HOVER, "children"),
        Input(ids.GRAPH, "mouseoverNodeData"),
        State(ids.PLAN, "data"),
        prevent_initial_call=True,
    )
    def hover_op(node, plan_ref):
        """Name the op under the mouse: ATen op, bytes it allocates, what the plan does."""
        if not node or node.get("op") is None:
            raise PreventUpdate
        plan, problem = shown(studio, plan_ref)
        graph = problem.graph
        op = graph.ops[int(node["op"])]
        fate = fate_of_ops(problem, plan).get(op.index, "")
        out = fmt_bytes(sum(graph.values[v].nbytes for v in op.outputs))
        said = op_name(graph, op.index).words
        return f"{said} ({op.label}, {op.name}), block {node['block']}, allocates {out}" + (
            f"; {FATE_TEXT[fate]}" if fate else ""
        )

    @app.callback(
        Output(ids.GRAPH, "elements", allow_duplicate=True),
        Output(ids.GRAPH_OPEN, "data", allow_duplicate=True),
        Input(ids.GRAPH, "tapNodeData"),
        State(ids.GRAPH_OPEN, "data"),
        State(ids.CONTEXT, "data"),
        prevent_initial_call=True,
    )
    def open_or_close(node, opened, context):
        """A click on a layer opens it into its ops; on an open block's box, closes it."""
        if not node or node.get("op") is not None or node.get("block") is None:
            raise PreventUpdate
        if not context or not context.get("key") or context.get("error"):
            raise PreventUpdate
        block = int(node["block"])
        opened = sorted(set(opened or []) ^ {block})
        return block_graph(studio, context["key"], opened), opened

    @app.callback(
        Output(ids.BLOCK_PANEL, "children"),
        Input(ids.GRAPH, "tapNodeData"),
        State(ids.PLAN, "data"),
        prevent_initial_call=True,
    )
    def open_block(node, plan_ref):
        if not node:
            raise PreventUpdate
        plan, problem = shown(studio, plan_ref)
        if node.get("block") is None:
            raise PreventUpdate
        return block_panel(problem, plan, int(node["block"]))


# the graph's colours and the step's words: written here on a step, and with each new plan
GRAPH_VIEW = {
    "sheet": Output(ids.GRAPH, "stylesheet", allow_duplicate=True),
    "label": Output(ids.STEP_TEXT, "children", allow_duplicate=True),
    "why": Output(ids.STEP_WHY, "children", allow_duplicate=True),
    "for": Output(ids.STEP_WHY, "data-for", allow_duplicate=True),
}


def graph_view(studio: Studio, plan_ref: dict | None, step: int | None) -> dict[str, Any]:
    """`GRAPH_VIEW`'s values: the graph coloured for the plan and the step-through's step."""
    plan, problem = plan_of(studio, plan_ref)
    sig = plan_ref.get("for") if plan_ref else None
    if plan is None or plan_ref is None:
        return {"sheet": figures.graph_stylesheet(), "label": "", "why": "", "for": sig}
    fates = op_fates(problem, plan)
    layers = block_fates(problem, plan)
    prefix = figures.graph_prefix(plan_ref["key"])
    if step is None or step >= len(plan.program):
        return {
            "sheet": figures.graph_stylesheet(fates, prefix=prefix, layers=layers),
            "label": f"{len(plan.program)} steps",
            "why": "Press play or step to walk through the program.",
            "for": sig,
        }
    view = step_view(problem, plan, step)
    sheet = figures.graph_stylesheet(
        fates, view["running"], view["live"], view["block"], prefix, layers
    )
    return {"sheet": sheet, "label": view["label"], "why": view["why"], "for": sig}


def block_panel(problem: Any, plan: Any, index: int) -> list:
    """One block's ops in a table: name, ATen op, bytes allocated, what the plan does."""
    block = problem.blocks[index]
    fate_of = fate_of_ops(problem, plan)
    graph = problem.graph
    same = [b.index for b in problem.blocks if b.kind == block.kind]

    def row(o: int) -> html.Tr:
        op = graph.ops[o]
        out = sum(graph.values[v].nbytes for v in op.outputs)
        fate = fate_of.get(o, "backward" if op.phase == "backward" else "")
        return html.Tr(
            [
                html.Td(op_name(graph, o).words),
                html.Td(f"{op.label} · {op.name}"),
                html.Td(fmt_bytes(out)),
                html.Td(fate, className=f"fate {fate}"),
            ]
        )

    return [
        html.H3(f"block {block.index} · {block.name}"),
        html.P(
            f"{len(block.forward_ops)} forward and {len(block.backward_ops)} backward ops; "
            f"activations {fmt_bytes(block.activation_bytes)}; same kind as blocks "
            f"{', '.join(map(str, same))}."
        ),
        html.Table(
            [html.Thead(html.Tr([html.Th(h) for h in ("op", "ATen op", "allocates", "plan")]))]
            + [html.Tbody([row(o) for o in block.forward_ops + block.backward_ops])],
            className="ops",
        ),
    ]
