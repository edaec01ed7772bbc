"""Run traced ATen nodes on real tensors: shared by the runtime and cost measurement."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from core.trace import AtenNode, Ref, fast_callable


def resolve(arg: Any, env: dict[int, Any]) -> Any:
    """Replace every Ref in an argument structure by its value in `env`."""
    if isinstance(arg, Ref):
        return env[arg.index]
    if isinstance(arg, (tuple, list)):
        return type(arg)(resolve(a, env) for a in arg)
    if isinstance(arg, dict):
        return {k: resolve(a, env) for k, a in arg.items()}
    return arg


@dataclass(frozen=True)
class Call:
    """A node's call with its argument building precomputed: the runtime's hot path."""

    index: int
    target: Any
    template: tuple  # positional args with constants in place
    refs: tuple[tuple[int, int], ...]  # (position, node) for top-level references
    nested: tuple[tuple[int, Any], ...]  # (position, structure) holding references deeper
    kwargs: dict
    kwargs_have_refs: bool

    def args(self, env: dict[int, Any]) -> list:
        args = list(self.template)
        for pos, n in self.refs:
            args[pos] = env[n]
        for pos, sub in self.nested:
            args[pos] = resolve(sub, env)
        return args

    def __call__(self, env: dict[int, Any]) -> Any:
        kwargs = resolve(self.kwargs, env) if self.kwargs_have_refs else self.kwargs
        return self.target(*self.args(env), **kwargs)

    def fast(self) -> Callable[[dict[int, Any]], Any]:
        """The call as one closure, specialised for the common shapes (every positional
        argument a reference, no keyword arguments): the runtime's innermost loop."""
        fn, template = self.target, self.template
        if self.nested or self.kwargs_have_refs or self.kwargs:
            return self
        if len(self.refs) == len(template):
            index = [n for _, n in self.refs]
            if len(index) == 1:
                (a,) = index
                return lambda env: fn(env[a])
            if len(index) == 2:
                a, b = index
                return lambda env: fn(env[a], env[b])
            if len(index) == 3:
                a, b, c = index
                return lambda env: fn(env[a], env[b], env[c])
        return self


def compile_node(node: AtenNode) -> Call:
    refs, nested = [], []
    for pos, a in enumerate(node.args):
        if isinstance(a, Ref):
            refs.append((pos, a.index))
        elif _has_ref(a):
            nested.append((pos, a))
    return Call(
        node.index,
        fast_callable(node.target),
        tuple(node.args),
        tuple(refs),
        tuple(nested),
        dict(node.kwargs),
        _has_ref(node.kwargs),
    )


def run_node(node: AtenNode, env: dict[int, Any]) -> Any:
    """Call one ATen node with its arguments taken from `env`; returns its result."""
    return compile_node(node)(env)


def _has_ref(arg: Any) -> bool:
    if isinstance(arg, Ref):
        return True
    if isinstance(arg, (tuple, list)):
        return any(_has_ref(a) for a in arg)
    if isinstance(arg, dict):
        return any(_has_ref(a) for a in arg.values())
    return False
