"""Run a plan inside autograd: `apply_plan(model, plan)` returns a drop-in module.

The wrapped module's forward runs the forward part of the plan's program (the same
instructions the simulator walked) inside one `torch.autograd.Function`, keeping what the plan
keeps; `loss.backward()` then runs the rest of the program, recomputing what the plan
recomputes, and hands autograd the parameter gradients, which land in the model's own `.grad`.
Each part is compiled once to a straight-line Python function (one call per ATen node, `del`
where the plan frees), so a step costs little more than the ops themselves.

Exactness rules kept here:
- a recomputed random op (dropout) replays the random state of its first run, and the global
  random stream moves exactly as in eager PyTorch;
- a recomputed op that updates model state (batch-norm running statistics) writes into a
  throwaway copy, so the state is updated once per step.
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from core.errors import PlanMismatch
from core.graph import Graph, build_graph
from core.interpret import binding, has_ref
from core.schedule import FREE, Plan
from core.trace import AtenNode, Ref, TensorSpec, capture, unflatten_output

# how a node runs: normally, replaying its random state, or on copies of the state it writes
_NORMAL, _REPLAY_RNG, _COPY_STATE = range(3)


class _Program:
    """A plan compiled against a graph: its forward and backward parts as two Python functions."""

    def __init__(self, graph: Graph, plan: Plan) -> None:
        self.graph = graph
        trace = graph.trace
        self.placeholders = [n.index for n in trace.nodes if n.role in ("param", "state", "input")]
        diff = set(trace.diff_outputs)
        self.non_diff = [i for i in range(len(trace.outputs)) if i not in diff]
        self._state = {v.index for v in graph.values if v.is_placeholder}
        self._seen: set[int] = set()
        split = min(plan.backward_start, len(plan.program))
        forward = _Segment(trace.nodes, set(self.placeholders), "forward", {})
        for n in graph.prologue:
            forward.run(n, _NORMAL)
        self._add(forward, plan.program[:split])
        self.forward = forward.function()
        backward = _Segment(
            trace.nodes, forward.live | set(trace.tangents), "backward", forward.bindings
        )
        for n in graph.tangent_prologue:
            backward.run(n, _NORMAL)
        self._add(backward, plan.program[split:])
        self.backward = backward.function()

    def _add(self, segment: _Segment, instructions: Sequence[tuple[str, int]]) -> None:
        """Emit RUN and FREE instructions; a recompute replays random ops and leaves state alone."""
        nodes = self.graph.trace.nodes
        for kind, target in instructions:
            if kind == FREE:
                for n in self.graph.value_nodes.get(target, ()):
                    segment.free(n)
                continue
            op = self.graph.ops[target]
            recompute = target in self._seen
            self._seen.add(target)
            for n in op.nodes:
                node = nodes[n]
                writes_state = any(s in self._state for w in node.writes for s in nodes[w].storages)
                if recompute and node.random:
                    segment.run(n, _REPLAY_RNG)
                elif recompute and writes_state:
                    if op.outputs:
                        segment.run(n, _COPY_STATE)
                else:
                    segment.run(n, _NORMAL)
            for n in op.nodes:  # tuple results: only the op's own getitems read them
                if len(nodes[n].storages) > 1:
                    segment.free(n)


class _Segment:
    """One part of the program as straight-line Python source, compiled once: a local `v<n>`
    per node result, `del` exactly where the plan frees, ops and constants bound as the
    function's globals. The function takes the values it reads from `env` and puts back the
    ones still live when it returns, so memory is held and freed as the program says."""

    def __init__(self, nodes: list[AtenNode], live: set[int], name: str, bindings: dict) -> None:
        self.nodes = nodes
        self.bindings = bindings  # binding() answers, shared by the program's segments
        self.live = live  # results held when the segment has run so far (in env or as locals)
        self.name = name
        self.named: set[int] = set()  # results loaded from env or computed here: locals
        self.loads: list[str] = []
        self.lines: list[str] = []
        self.names: dict[str, Any] = {
            "_get_rng": _get_rng,
            "_tensor_in": _tensor_in,
            "_replay": _replay,
            "_on_copies": _on_copies,
        }
        self._bound: dict[int, str] = {}

    def run(self, n: int, mode: int) -> None:
        node = self.nodes[n]
        if n in self.live:  # a recompute of a held result replaces it, as in env
            self._use(n)
        if node.target is operator.getitem and isinstance(node.args[1], int):
            self.lines.append(f"v{n} = {self._arg(node.args[0])}[{node.args[1]}]")
        else:
            args = [self._arg(a) for a in node.args]
            kwargs = [f"{k}={self._arg(a)}" for k, a in node.kwargs.items()]
            fn = self._bind(binding(node, self.nodes, self.bindings), "f")
            if mode == _NORMAL and node.random:
                self.lines.append(
                    f"rng[{n}] = _get_rng(_tensor_in(({''.join(a + ', ' for a in args)})))"
                )
            if mode == _REPLAY_RNG:
                args = [f"rng[{n}]", fn, *args]
                fn = "_replay"
            elif mode == _COPY_STATE:
                args = [self._bind(node, "node"), fn, *args]
                fn = "_on_copies"
            self.lines.append(f"v{n} = {fn}({', '.join(args + kwargs)})")
        self.named.add(n)
        self.live.add(n)

    def free(self, n: int) -> None:
        if n in self.live:
            self._use(n)
            self.lines.append(f"del v{n}")
            self.live.discard(n)

    def function(self) -> Callable[[dict[int, Any], dict[int, Any]], None]:
        """The compiled segment: `fn(env, rng)` runs it on the values in `env`."""
        body = (
            self.loads + self.lines + [f"env[{n}] = v{n}" for n in sorted(self.named & self.live)]
        )
        source = "def segment(env, rng):\n" + "".join(f"    {line}\n" for line in body or ["pass"])
        exec(compile(source, f"<remat {self.name}>", "exec"), self.names)
        return self.names["segment"]

    def _use(self, n: int) -> str:
        if n not in self.named:
            self.named.add(n)
            self.loads.append(f"v{n} = env.pop({n})")
        return f"v{n}"

    def _arg(self, a: Any) -> str:
        if isinstance(a, Ref):
            return self._use(a.index)
        if isinstance(a, (list, tuple)) and has_ref(a):
            items = "".join(f"{self._arg(x)}, " for x in a)
            return f"[{items}]" if isinstance(a, list) else f"({items})"
        if a is None or type(a) in (bool, int):
            return repr(a)
        return self._bind(a, "c")

    def _bind(self, obj: Any, prefix: str) -> str:
        """A global name for `obj` (one per object)."""
        if id(obj) not in self._bound:
            self._bound[id(obj)] = name = f"{prefix}{len(self._bound)}"
            self.names[name] = obj
        return self._bound[id(obj)]


class _StepState:
    """What the forward leaves for the backward: live values and random states."""

    def __init__(self, env: dict[int, Any], rng: dict[int, Any]) -> None:
        self.env: dict[int, Any] | None = env
        self.rng = rng


class _PlanFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, runner: PlannedModule, n_params: int, *tensors: torch.Tensor):
        program = runner._program
        values = [*tensors[:n_params], *runner._state_tensors(), *tensors[n_params:]]
        env = dict(zip(program.placeholders, values, strict=True))
        rng: dict[int, Any] = {}
        program.forward(env, rng)
        outputs = tuple(env[n] for n in program.graph.trace.outputs)
        ctx.step = _StepState(env, rng)
        ctx.runner = runner
        ctx.n_params = n_params
        ctx.mark_non_differentiable(*[outputs[i] for i in program.non_diff])
        return outputs

    @staticmethod
    def backward(ctx, *grad_outputs):
        step: _StepState = ctx.step
        program = ctx.runner._program
        trace = program.graph.trace
        if step.env is None:
            raise RuntimeError(
                "Trying to backward through the graph a second time (or directly access saved "
                "tensors after they have already been freed). Specify retain_graph=True if you "
                "need to backward through the graph a second time."
            )
        keep_graph = torch._C._autograd._get_current_graph_task_keep_graph()
        env = dict(step.env) if keep_graph else step.env
        if not keep_graph:
            step.env = None
        for t, out in zip(trace.tangents, trace.diff_outputs, strict=True):
            env[t] = grad_outputs[out]
        program.backward(env, step.rng)
        grads = [env[g] if g is not None else None for g in trace.grads]
        env.clear()
        n_params = ctx.n_params
        input_grads: list[torch.Tensor | None] = [None] * len(trace.input_specs)
        for pos, g in zip(trace.grad_inputs, grads[n_params:], strict=True):
            input_grads[pos] = g
        return (None, None, *grads[:n_params], *input_grads)


class PlannedModule(nn.Module):
    """A drop-in for `model` that trains under a plan; eval mode and no_grad run the model."""

    def __init__(self, model: nn.Module, graph: Graph, plan: Plan) -> None:
        super().__init__()
        self.model = model
        self.plan = plan
        self._graph = graph
        self._program = _Program(graph, plan)
        trace = graph.trace
        params = dict(model.named_parameters())
        self._param_names = trace.param_names
        self._state_slots = [_slot(model, name) for name in trace.state_names]
        self._params = [params[n] for n in trace.param_names]
        self._input_specs = trace.input_specs
        self._grad_inputs = set(trace.grad_inputs)

    def _state_tensors(self) -> list[torch.Tensor]:
        """Buffers and frozen parameters, looked up each step (they may be reassigned)."""
        return [getattr(mod, attr) for mod, attr in self._state_slots]

    def forward(self, *inputs: torch.Tensor) -> Any:
        if not (torch.is_grad_enabled() and self.model.training):
            return self.model(*inputs)
        self._check_inputs(inputs)
        outputs = _PlanFunction.apply(self, len(self._params), *self._params, *inputs)
        return unflatten_output(list(outputs), self._graph.trace.output_spec)

    def _check_inputs(self, inputs: Sequence[Any]) -> None:
        if len(inputs) != len(self._input_specs):
            raise PlanMismatch(
                f"the plan was made for {len(self._input_specs)} inputs, got {len(inputs)}"
            )
        for i, (x, spec) in enumerate(zip(inputs, self._input_specs, strict=True)):
            if not isinstance(x, torch.Tensor):
                raise PlanMismatch(f"input {i} is a {type(x).__name__}, the plan expects {spec}")
            got = TensorSpec.of(x)
            if got != spec:
                raise PlanMismatch(
                    f"input {i} is {got}, the plan was made for {spec}: make a plan for these "
                    "shapes (remat plan ... or core.solve on a problem analysed with them)"
                )
            if x.requires_grad != (i in self._grad_inputs):
                need = "requires" if i in self._grad_inputs else "does not require"
                raise PlanMismatch(f"input {i}: the plan was made for an input that {need} grad")


def _slot(model: nn.Module, name: str) -> tuple[nn.Module, str]:
    module, _, attr = name.rpartition(".")
    return model.get_submodule(module), attr


def apply_plan(model: nn.Module, plan: Plan) -> PlannedModule:
    """Wrap `model` so that training steps run `plan`. The model must be the one the plan was
    made for (same parameters, same code); inputs must have the plan's shapes and dtypes."""
    problem = plan.problem
    if problem is not None and problem.model_ref is not None and problem.model_ref() is model:
        return PlannedModule(model, problem.graph, plan)
    _check_params(model, plan)
    device = next((p.device for p in model.parameters()), torch.device("cpu"))
    example = [
        torch.zeros(shape, dtype=getattr(torch, dtype), device=device).requires_grad_(requires_grad)
        for shape, dtype, requires_grad in plan.graph_meta["inputs"]
    ]
    graph = build_graph(capture(model, example))
    from core.problem import fingerprint

    if fingerprint(graph.trace) != plan.fingerprint:
        raise PlanMismatch(
            "the model's traced operations differ from the plan's (same parameter shapes, "
            "different code or dtype): make a new plan for this model"
        )
    return PlannedModule(model, graph, plan)


def _check_params(model: nn.Module, plan: Plan) -> None:
    mine = [[n, str(TensorSpec.of(p))] for n, p in model.named_parameters() if p.requires_grad]
    theirs = plan.graph_meta.get("params", [])
    if mine != theirs:
        names_mine, names_theirs = {m[0] for m in mine}, {t[0] for t in theirs}
        if names_mine != names_theirs:
            extra = sorted(names_mine - names_theirs)[:3]
            missing = sorted(names_theirs - names_mine)[:3]
            raise PlanMismatch(
                f"the model's parameters differ from the plan's: the model has {extra or 'no'} "
                f"extra and lacks {missing or 'none'} of the plan's: this plan is for another model"
            )
        for (n, a), (_, b) in zip(sorted(mine), sorted(theirs)):
            if a != b:
                raise PlanMismatch(
                    f"parameter {n} is {a}, the plan was made for {b}: make a plan for this model"
                )


def _tensor_in(args: Any) -> torch.Tensor | None:
    for a in args:
        if isinstance(a, torch.Tensor):
            return a
        if isinstance(a, (list, tuple)):
            t = _tensor_in(a)
            if t is not None:
                return t
    return None


def _get_rng(t: torch.Tensor | None) -> Any:
    if t is not None and t.device.type == "cuda":
        return torch.cuda.get_rng_state(t.device)
    return torch.get_rng_state()


def _set_rng(t: torch.Tensor | None, state: Any) -> None:
    if t is not None and t.device.type == "cuda":
        torch.cuda.set_rng_state(state, t.device)
    else:
        torch.set_rng_state(state)


def _replay(state: Any, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Any:
    """Run a random op again with the random state of its first run, then restore."""
    device_of = _tensor_in(args)
    now = _get_rng(device_of)
    _set_rng(device_of, state)
    out = fn(*args, **kwargs)
    _set_rng(device_of, now)
    return out


def _on_copies(node: AtenNode, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Any:
    """Recompute an op without touching model state again."""
    args, kwargs = _copy_written(node, args, kwargs)
    return fn(*args, **kwargs)


def _copy_written(node, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """Keep a recompute from updating model state again: batch-norm's running statistics
    (optional, unread in training mode) are passed as None, so nothing is allocated; other
    state an op writes in place is replaced by a copy."""
    from core.trace import aliases_schema_write, undeclared_writes

    args = list(args)
    kwargs = dict(kwargs)
    for pos, _name in undeclared_writes(node.target, args):
        args[pos] = None
    for pos, name in aliases_schema_write(node.target):
        if pos < len(args) and isinstance(args[pos], torch.Tensor):
            args[pos] = args[pos].clone()
        elif isinstance(kwargs.get(name), torch.Tensor):
            kwargs[name] = kwargs[name].clone()
    return tuple(args), kwargs
