"""The block graph as cytoscape elements (preset positions) and stylesheets."""

from __future__ import annotations

import copy
import hashlib
import math
from collections.abc import Mapping, Sequence
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
DX, DY = 70, 34
BLOCKS_PER_ROW = 6
TITLE_WIDTH, TITLE_CHAR = 220, 13  # a block title's widest wrap, and px per character

BASE_STYLE: list[dict] = [
    {
        "selector": "node.op",
        "style": {
            "label": "data(label)",
            "font-size": 9,
            "min-zoomed-font-size": 9,  # ops are named when zoomed in enough to read them
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
) -> list:
    """Cytoscape elements with preset positions: one compound box per block (tinted by kind),
    its forward ops inside in columns, and an edge for each forward value read in the forward.

    `blocks` are `core.blocks.Block`-like (index, name, kind, forward_ops), `ops` and `values`
    the graph's `Op`/`Value` records; every id starts with `prefix` (see `graph_prefix`), and
    the data carry the block and op indices. `names` (per op, `core.naming.OpName`) label
    the ops by what they make ("layer-norm output"), `titles` (per block) the boxes by module.
    """
    elements: list[dict] = []
    forward = set()
    x0, y0, row_height = 0.0, 0.0, 0.0
    for i, block in enumerate(blocks):
        if i and i % BLOCKS_PER_ROW == 0:
            x0, y0, row_height = 0.0, y0 + row_height + 90, 0.0
        label = f"{block.index} · {titles[i] if titles else block.name}"
        elements.append(
            {
                "data": {
                    "id": f"{prefix}b{block.index}",
                    "block": block.index,
                    "label": label,
                    "kind": block.kind,
                },
                "classes": f"block kind{block.kind % len(BLOCK_TINTS)}",
            }
        )
        n = len(block.forward_ops)
        ops_width = max(1, math.ceil(n / ROWS)) * DX
        width = max(ops_width, min(TITLE_WIDTH, len(label) * TITLE_CHAR))  # titles never meet
        left = x0 + (width - ops_width) / 2
        for j, o in enumerate(block.forward_ops):
            forward.add(o)
            position = {"x": left + (j // ROWS) * DX, "y": y0 + (j % ROWS) * DY}
            name = names[o] if names else None
            elements.append(_op_node(ops[o], o, block.index, position, prefix, name))
        x0 += width + 70
        row_height = max(row_height, min(n, ROWS) * DY)
    producer_op = {v.index: v.producer for v in values if v.producer in forward}
    for v, p in producer_op.items():
        for c in values[v].consumers:
            if c in forward:
                elements.append(
                    {
                        "data": {
                            "id": f"{prefix}e{v}-{c}",
                            "source": f"{prefix}o{p}",
                            "target": f"{prefix}o{c}",
                        }
                    }
                )
    return elements


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
) -> list[dict]:
    """Base style, plus: forward ops coloured by their fate in the plan (op indices per fate),
    the op(s) running at the step-through position, ops whose results are alive there, and the
    block running (ids under `prefix`, as in `graph_elements`)."""
    sheet = copy.deepcopy(BASE_STYLE)
    for k, tint in enumerate(BLOCK_TINTS):
        sheet.append({"selector": f".kind{k}", "style": {"background-color": tint}})
    for fate, ids in (fates or {}).items():
        if ids:
            sheet.append(
                {"selector": _ops(ids, prefix), "style": {"background-color": FATE_COLORS[fate]}}
            )
    ringed = {"border-width": 3, "border-color": MARKER_COLOR}
    if live:
        sheet.append({"selector": _ops(live, prefix), "style": ringed})
    if block is not None:
        sheet.append({"selector": f"#{prefix}b{block}", "style": ringed})
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


def _ops(ops: Sequence[int], prefix: str) -> str:
    """A selector for these op nodes."""
    return ", ".join(f"#{prefix}o{o}" for o in ops)
