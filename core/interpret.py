"""Run traced ATen nodes on real tensors: shared by the runtime and cost measurement."""

from __future__ import annotations

from typing import Any

from core.trace import AtenNode, Ref


def resolve(arg: Any, env: dict[int, Any]) -> Any:
    """Replace every Ref in an argument structure by its value in `env`."""
    if isinstance(arg, Ref):
        return env[arg.index]
    if isinstance(arg, (tuple, list)):
        return type(arg)(resolve(a, env) for a in arg)
    if isinstance(arg, dict):
        return {k: resolve(a, env) for k, a in arg.items()}
    return arg


def run_node(node: AtenNode, env: dict[int, Any]) -> Any:
    """Call one ATen node with its arguments taken from `env`; returns its result."""
    args = resolve(node.args, env) if node.reads else node.args
    kwargs = resolve(node.kwargs, env) if node.reads and node.kwargs else node.kwargs
    return node.target(*args, **kwargs)
