"""The block graph as cytoscape elements (preset positions) and stylesheets."""

from __future__ import annotations

import copy
import hashlib
import math
from collections.abc import Collection, Mapping, Sequence
from typing import Any

from app.figures.palette import (
    BLOCK_BORDER,
    BLOCK_TINTS,
    FATE_COLORS,
    GRAPH_EDGE,
    MARKER_COLOR,
    OP_NODE,
    RUNNING_BORDER,
)

ROWS = 12  # ops per column inside a block box
# Room per op: a label of two lines under its node, apart from its neighbours' (an
# opened block's labels were ~5 px and overlapped at 70 x 34 with the whole model in view)
DX, DY = 110, 44
OP_FONT = 10  # px at zoom 1: opening a block zooms to it, no further out than that
ROW_WIDTH = 900  # a row of blocks wraps past this width (model px)
TITLE_WIDTH, TITLE_CHAR = 220, 13  # a block title's widest wrap, and px per character
LAYER_HEIGHT = 90  # a closed block (a layer): its name and its number of ops

BASE_STYLE: list[dict] = [
    {
        "selector": "node.op",
        "style": {
            "label": "data(label)",
            "font-size": OP_FONT,
            "min-zoomed-font-size": OP_FONT,  # named when they read; hover names the rest
            "text-wrap": "wrap",
            "text-max-width": DX - 8,
            "width": 14,
            "height": 14,
            "background-color": OP_NODE,
            "text-valign": "bottom",
            "text-margin-y": 2,
        },
    },
    {
        "selector": "node.block",
        "style": {
            "label": "data(label)",
            "font-size": 22,  # a layer's name reads at the whole-model zoom
            "font-weight": "bold",
            "text-wrap": "wrap",
            "text-max-width": TITLE_WIDTH,
            "text-valign": "top",
            "text-halign": "center",
            "border-width": 1,
            "border-color": BLOCK_BORDER,
            "padding": 12,
            "shape": "round-rectangle",
        },
    },
    {
        "selector": "node.layer",  # a closed block: one readable node, opened by a click
        "style": {
            "label": "data(text)",
            "font-size": 22,
            "font-weight": "bold",
            "text-wrap": "wrap",
            "text-max-width": TITLE_WIDTH,
            "text-valign": "center",
            "text-halign": "center",
            "width": "data(width)",
            "height": LAYER_HEIGHT,
            "border-width": 1,
            "border-color": BLOCK_BORDER,
            "shape": "round-rectangle",
        },
    },
    {
        "selector": "edge",
        "style": {"width": 1, "line-color": GRAPH_EDGE, "curve-style": "haystack"},
    },
]


def graph_prefix(key: str) -> str:
    """The element-id prefix of one analysed model's graph.

    Ids must differ between models: with `o66` in two models, cytoscape kept the old node
    (under its old parent) while adding the new edges, failed ("nonexistant target 'o66'"),
    and left the first model's skeleton under every later one.
    """
    return "g" + hashlib.sha1(key.encode()).hexdigest()[:8] + "-"


def graph_elements(
    blocks: Sequence[Any],
    ops: Sequence[Any],
    values: Sequence[Any],
    prefix: str = "",
    names: Sequence[Any] | None = None,
    titles: Sequence[str] | None = None,
    expanded: Collection[int] = (),
) -> list:
    """Cytoscape elements with preset positions, at module level: one node per block (a
    layer, tinted by kind, named by module) and an edge where a forward value crosses from
    one block to another. A block in `expanded` opens into a compound box holding its
    forward ops in columns, with an edge for each forward value an op reads.

    `blocks` are `core.Block`-like (index, name, kind, forward_ops), `ops` and `values`
    the graph's `Op`/`Value` records; every id starts with `prefix` (see `graph_prefix`), and
    the data carry the block and op indices. `names` (per op, `core.OpName`) label
    the ops by what they make ("layer-norm output"), `titles` (per block) the boxes by module.
    """
    elements: list[dict] = []
    shown: dict[int, str] = {}  # forward op -> the node drawing it (itself, or its layer)
    x0, y0, row_height = 0.0, 0.0, 0.0
    for i, block in enumerate(blocks):
        label = f"{block.index} · {titles[i] if titles else block.name}"
        n = len(block.forward_ops)
        title_width = min(TITLE_WIDTH, len(label) * TITLE_CHAR)
        width = title_width
        if block.index in expanded:
            width = max(max(1, math.ceil(n / ROWS)) * DX, title_width)
        if x0 and x0 + width > ROW_WIDTH:  # rows of about three layers: readable when fit
            x0, y0, row_height = 0.0, y0 + row_height + 90, 0.0
        node = f"{prefix}b{block.index}"
        data = {"id": node, "block": block.index, "label": label, "kind": block.kind}
        tint = f"kind{block.kind % len(BLOCK_TINTS)}"
        if block.index not in expanded:
            data.update(ops=n, width=title_width, text=f"{label}\n{n} ops")
            centre = {"x": x0 + title_width / 2, "y": y0 + LAYER_HEIGHT / 2}
            elements.append({"data": data, "position": centre, "classes": f"layer {tint}"})
            shown.update(dict.fromkeys(block.forward_ops, node))
            x0 += title_width + 70
            row_height = max(row_height, LAYER_HEIGHT)
            continue
        elements.append({"data": data, "classes": f"block {tint}"})
        ops_width = max(1, math.ceil(n / ROWS)) * DX
        width = max(ops_width, title_width)  # titles never meet
        left = x0 + (width - ops_width) / 2
        for j, o in enumerate(block.forward_ops):
            shown[o] = f"{prefix}o{o}"
            position = {"x": left + (j // ROWS) * DX, "y": y0 + (j % ROWS) * DY}
            name = names[o] if names else None
            elements.append(_op_node(ops[o], o, block.index, position, prefix, name))
        x0 += width + 70
        row_height = max(row_height, min(n, ROWS) * DY)
    edges = {}
    for v in values:
        if v.producer not in shown:
            continue
        for c in v.consumers:
            a, b = shown[v.producer], shown.get(c)
            if b is not None and a != b and (a, b) not in edges:
                edges[a, b] = {"data": {"id": f"{prefix}e{v.index}-{c}", "source": a, "target": b}}
    return elements + list(edges.values())


def _op_node(op: Any, o: int, block: int, position: dict, prefix: str, name: Any) -> dict:
    return {
        "data": {
            "id": f"{prefix}o{o}",
            "parent": f"{prefix}b{block}",
            "block": block,
            "op": o,
            "label": name.kind if name else op.label.removeprefix("aten."),
            "name": op.name,
            "words": name.full if name else op.label,
        },
        "position": position,
        "classes": "op",
    }


def graph_stylesheet(
    fates: Mapping[str, Sequence[int]] | None = None,
    running: Sequence[int] = (),
    live: Sequence[int] = (),
    block: int | None = None,
    prefix: str = "",
    layers: Mapping[str, Sequence[int]] | None = None,
) -> list[dict]:
    """Base style, plus: forward ops coloured by their fate in the plan (op indices per fate),
    closed blocks outlined by the fate that matters most among their ops (`layers`: block
    indices per fate), the op(s) running at the step-through position, ops whose results are
    alive there, and the block running (ids under `prefix`, as in `graph_elements`); a closed
    block running is drawn thick in the marker's colour, since its ops are not drawn."""
    sheet = copy.deepcopy(BASE_STYLE)
    for k, tint in enumerate(BLOCK_TINTS):
        sheet.append({"selector": f".kind{k}", "style": {"background-color": tint}})
    for fate, ids in (fates or {}).items():
        if ids:
            sheet.append(
                {"selector": _ops(ids, prefix), "style": {"background-color": FATE_COLORS[fate]}}
            )
    for fate, blocks in (layers or {}).items():
        if blocks:
            sheet.append(
                {
                    "selector": ", ".join(_layer(b, prefix) for b in blocks),
                    "style": {"border-width": 4, "border-color": FATE_COLORS[fate]},
                }
            )
    ringed = {"border-width": 3, "border-color": MARKER_COLOR}
    if live:
        sheet.append({"selector": _ops(live, prefix), "style": ringed})
    if block is not None:
        sheet.append({"selector": f"#{prefix}b{block}", "style": ringed})
        sheet.append(
            {
                "selector": _layer(block, prefix),
                "style": {"border-width": 8, "border-color": MARKER_COLOR},
            }
        )
    if running:
        sheet.append(
            {
                "selector": _ops(running, prefix),
                "style": {
                    "width": 24,
                    "height": 24,
                    "background-color": MARKER_COLOR,
                    "border-width": 3,
                    "border-color": RUNNING_BORDER,
                },
            }
        )
    return sheet


def _layer(block: int, prefix: str) -> str:
    """A selector for block `block`'s node while closed (cytoscape read `#id.layer` as no
    node at all)."""
    return f'node.layer[id = "{prefix}b{block}"]'


def _ops(ops: Sequence[int], prefix: str) -> str:
    """A selector for these op nodes."""
    return ", ".join(f"#{prefix}o{o}" for o in ops)
