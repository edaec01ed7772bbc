"""Every colour the app draws with, in one place: figures, the block graph and the arena
read them from here, so one kind, fate or method has one colour in every view."""

from __future__ import annotations

# live memory by kind (timeline stack, arena bars)
KIND_COLORS = {"activations": "#4c78a8", "temporaries": "#f58518", "gradients": "#54a24b"}
# what the plan does with a forward op's results (graph nodes, the legend under it)
FATE_COLORS = {
    "kept": "#4c78a8",
    "recomputed": "#e45756",
    "offloaded": "#b279a2",
    "freed": "#c9c9c9",
}
# per-tensor bands: the fate of forward storages, the kind of the others
BAND_COLORS = {
    "kept": "#4c78a8",
    "recomputed": "#e45756",
    "offloaded": "#b279a2",
    "freed": "#9ecae9",
    "temporary": "#f58518",
    "gradient": "#54a24b",
    "activation": "#4c78a8",
}
# one colour per method, whichever is selected
METHOD_COLORS = {
    "rockmate": "#4c78a8",
    "rotor": "#f58518",
    "checkmate": "#b279a2",
    "store_all": "#54a24b",
    "checkpoint_blocks": "#9d755d",
    "sqrt_n": "#72b7b2",
    "offload": "#b279a2",
    "pofo": "#b279a2",
}
OTHER_METHOD = "#7f7f7f"  # a method without a colour of its own
# the strategies users run today (imported, `core.strategies`): their points on the chart
STRATEGY_COLORS = {
    "hf": "#d62728",
    "torchtitan": "#6a3d9a",
    "torchtune": "#e377c2",
    "autosac": "#17becf",
}
TRANSFER_COLORS = {"offload": "#b279a2", "prefetch": "#7b4fa0", "stall": "#e45756"}
BLOCK_TINTS = ["#e8f0fb", "#fdf0e2", "#e9f5e8", "#f7e8f2", "#eef0d9", "#e6f4f4", "#f3e9dc"]

RECOMPUTE_COLOR = "#e45756"
BUDGET_COLOR = "#222222"
PEAK_COLOR = "#b279a2"
MARKER_COLOR = "#d4a000"  # the step-through position, in the timeline and the graph
HOST_COLOR = "#b279a2"
UPDATE_COLOR = "#2a9d8f"  # an optimizer's update inside the step
MEASURED_COLOR = "#111111"
ARENA_COLOR = "#222222"

BACKGROUND = "white"
EDGE = "white"  # outlines between bars and bands
REST = "#d9d9d9"  # summed smaller storages; budgets under the floor
UNKNOWN = "#888888"  # a band of no known fate
PHASE_LINE = "#888888"  # the forward/backward boundary line
FORWARD_SHADE = "rgba(76,120,168,0.07)"
BACKWARD_SHADE = "rgba(84,162,75,0.07)"
LABEL_TEXT = "#666"
FLOOR_TEXT = "#595959"

# the block graph (cytoscape)
OP_NODE = "#9aa5b1"
BLOCK_BORDER = "#8a94a0"
GRAPH_EDGE = "#c3cad3"
RUNNING_BORDER = "#000"
