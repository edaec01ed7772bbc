"""Run traced ATen nodes on real tensors: shared by the runtime and cost measurement.

Uses private PyTorch APIs: the generated bindings in `torch._C` (to call an overload the
way eager dispatches it) and `TorchDispatchMode`."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from core.trace import AtenNode, Ref, fast_callable

# where PyTorch's generated Python bindings live: functions, torch.nn.functional's, methods
_BINDINGS = (torch._C._VariableFunctions, torch._C._nn, torch._C.TensorBase)


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
        """The call as one closure where its shape is a common one: one to three references
        first, then constants (a view's shape, a sum's dims) and constant keywords. The
        runtime's innermost loop; other calls build their arguments with `args`."""
        fn, n = self.target, len(self.refs)
        if self.nested or self.kwargs_have_refs or not 1 <= n <= 3:
            return self
        if [pos for pos, _ in self.refs] != list(range(n)):
            return self
        index = [node for _, node in self.refs]
        rest, kw = self.template[n:], self.kwargs
        # no-constant shapes get their own closures: `*(), **{}` is a slower call path
        # (remat bench --runtime: mlp-tiny 1.19 -> 1.30, gpt-tiny +5% with one closure each)
        if n == 1:
            (a,) = index
            if rest or kw:
                return lambda env: fn(env[a], *rest, **kw)
            return lambda env: fn(env[a])
        if n == 2:
            a, b = index
            if rest or kw:
                return lambda env: fn(env[a], env[b], *rest, **kw)
            return lambda env: fn(env[a], env[b])
        a, b, c = index
        if rest or kw:
            return lambda env: fn(env[a], env[b], env[c], *rest, **kw)
        return lambda env: fn(env[a], env[b], env[c])


def compile_node(node: AtenNode, target: Callable[..., Any] | None = None) -> Call:
    """The node's call; `target` replaces its OpOverload (see `binding`)."""
    refs, nested = [], []
    for pos, a in enumerate(node.args):
        if isinstance(a, Ref):
            refs.append((pos, a.index))
        elif _has_ref(a):
            nested.append((pos, a))
    return Call(
        node.index,
        target or fast_callable(node.target),
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


def binding(node: AtenNode, nodes: Sequence[AtenNode], known: dict) -> Callable[..., Any]:
    """The quickest callable that runs `node` exactly as its OpOverload does: PyTorch's
    generated Python binding (`torch.mm`, `Tensor.view`...), about 1 us less per call, where
    it dispatches to the same overload with the same arguments on meta tensors of the node's
    shapes; otherwise the OpOverload's own C++ callable. `known` caches the answer per op and
    argument pattern."""
    target = fast_callable(node.target)
    if not isinstance(node.target, torch._ops.OpOverload):
        return target
    key = (node.target, _pattern(node.args, nodes), _pattern(node.kwargs, nodes))
    if key not in known:
        known[key] = target
        try:
            args = [_meta(a, nodes) for a in node.args]
            kwargs = {k: _meta(a, nodes) for k, a in node.kwargs.items()}
        except ValueError:
            return target
        want = _dispatched(target, args, kwargs)
        name = node.target.overloadpacket.__name__
        for fn in (getattr(namespace, name, None) for namespace in _BINDINGS):
            if want and fn and _same(_dispatched(fn, args, kwargs), want):
                known[key] = fn
                break
    return known[key]


class _Dispatched(Exception):
    """Carries the first ATen call a Python call dispatched: (overload, args, kwargs)."""


class _Stop(TorchDispatchMode):
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        raise _Dispatched(func, args, kwargs or {})


def _dispatched(fn: Callable[..., Any], args: list, kwargs: dict) -> tuple | None:
    """The first ATen call `fn(*args, **kwargs)` dispatches, without running it."""
    try:
        with _Stop():
            fn(*args, **kwargs)
    except _Dispatched as call:
        return call.args
    except Exception:  # a binding that does not take these arguments
        return None
    return None


def _meta(arg: Any, nodes: Sequence[AtenNode]) -> Any:
    """The argument with every Ref replaced by a meta tensor shaped like the node's result."""
    if isinstance(arg, Ref):
        node = nodes[arg.index]
        if len(node.specs) != 1:
            raise ValueError("not a single tensor")
        spec, stride = node.specs[0], node.strides[0]
        return torch.empty_strided(
            spec.shape, stride, dtype=getattr(torch, spec.dtype), device="meta"
        )
    if isinstance(arg, (tuple, list)):
        return type(arg)(_meta(a, nodes) for a in arg)
    return arg


def _pattern(arg: Any, nodes: Sequence[AtenNode]) -> Any:
    """What decides which overload a binding calls: argument types, constant values."""
    if isinstance(arg, Ref):
        return Ref, len(nodes[arg.index].specs)
    if isinstance(arg, (tuple, list)):
        return type(arg), tuple(_pattern(a, nodes) for a in arg)
    if isinstance(arg, dict):
        return tuple((k, _pattern(a, nodes)) for k, a in arg.items())
    return type(arg), arg


def _same(a: Any, b: Any) -> bool:
    """Same call arguments: the very same tensors, equal values of the same types."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return a is b
    if isinstance(a, (tuple, list)) and isinstance(b, (tuple, list)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    return type(a) is type(b) and a == b
