"""Run a plan inside autograd: `apply_plan(model, plan)` returns a drop-in module.

The wrapped module's forward runs the forward part of the plan's program (the same
instructions the simulator walked) inside one `torch.autograd.Function`, keeping what the plan
keeps; `loss.backward()` then runs the rest of the program, recomputing what the plan
recomputes, and hands autograd the parameter gradients, which land in the model's own `.grad`.

Offloading plans run their `offload` and `prefetch` instructions through `core.transfers`: on
CPU into a host pool the device tracker does not count, on CUDA on a side stream into a pinned
pool, with the waits that keep both exact. An offloaded device storage is kept until the run
step at which the simulator says its copy is done; a prefetched value is rebuilt, every view
of it, on a fresh device storage, and the first instruction that touches it waits for its copy.

Exactness rules kept here:
- a recomputed random op (dropout) replays the random state of its first run, and the global
  random stream moves exactly as in eager PyTorch;
- a recomputed op that updates model state (batch-norm running statistics) writes into a
  throwaway copy, so the state is updated once per step.

Uses one private PyTorch API: autograd's keep-graph flag (`torch._C._autograd`), to free the
step's values after a backward unless `retain_graph=True`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode

from core.errors import PlanMismatch, UnsupportedModel
from core.graph import Graph
from core.interpret import Call, binding, compile_node
from core.plan_io import check_graph_meta
from core.problem import Problem, analyze
from core.schedule import Plan
from core.simulator import FREE, OFFLOAD, PREFETCH, RUN
from core.trace import (
    CallSpec,
    TensorSpec,
    aliases_schema_write,
    describe_difference,
    join_call,
    split_call,
    undeclared_writes,
    unflatten_output,
)
from core.transfers import HostLane, HostStep, HostWork, lane_for
from core.validate import check_program

# how a node runs: normally, replaying its random state, on copies of the state it writes, or not
_NORMAL, _REPLAY_RNG, _COPY_STATE, _SKIP = range(4)


@dataclass
class _Instr:
    """One RUN (or transfer) with the FREEs that follow it, compiled: the loop the runtime
    walks."""

    calls: tuple  # ((call, mode, random), ...)
    drop: tuple[int, ...]  # env keys to drop afterwards: freed values, tuple results
    host: HostWork | None = None  # transfers and copies done before the calls


class _Program:
    """A plan compiled against a graph: the instruction list the runtime walks."""

    def __init__(self, graph: Graph, plan: Plan) -> None:
        self.graph = graph
        nodes = graph.trace.nodes
        placeholders = {v.index for v in graph.values if v.is_placeholder}
        known: dict = {}  # binding choices, per op and argument pattern
        calls = {
            n: compile_node(nodes[n], binding(nodes[n], nodes, known))
            for op in graph.ops
            for n in op.nodes
        }
        seen: set[int] = set()
        compiled: list[_Instr] = []
        split = 0
        transfers = any(kind in (OFFLOAD, PREFETCH) for kind, _ in plan.program)
        sim = plan.simulate() if transfers else None
        released, unparked = sim.releases() if sim else ({}, {})
        slot_of: dict[int, int] = {}
        self.transfers = transfers
        self.host_pool = sim.host_pool if sim else 0  # bytes
        arriving: set[int] = set()  # prefetched values no instruction has touched yet
        ready: dict[int, list[int]] = {}  # instruction -> the prefetches it waits for
        for i, (kind, target) in enumerate(plan.program):
            if i == plan.backward_start:
                split = len(compiled)
            touched = {target} if kind != RUN else set(graph.ops[target].inputs)
            if arriving & touched:  # a FREE's wait joins the instruction its drop joins
                at = len(compiled) - (kind == FREE)
                ready.setdefault(at, []).extend(sorted(arriving & touched))
                arriving -= touched
            if kind == FREE:  # a FREE joins the instruction before it (none precedes the first)
                compiled[-1].drop += graph.value_nodes.get(target, ())
                continue
            if kind in (OFFLOAD, PREFETCH):
                assert sim is not None
                if kind == OFFLOAD:
                    slot_of[target] = sim.host_slots[i]
                else:
                    arriving.add(target)
                bound = graph.value_nodes.get(target, ())
                work = HostWork(transfer=kind, value=target, nodes=bound, slot=slot_of[target])
                compiled.append(_Instr((), (), work))
                continue
            op = graph.ops[target]
            recompute = target in seen
            seen.add(target)
            items = []
            for n in op.nodes:
                node = nodes[n]
                writes_state = any(
                    s in placeholders for w in node.writes for s in nodes[w].storages
                )
                mode = _NORMAL
                if recompute and node.random:
                    mode = _REPLAY_RNG
                elif recompute and writes_state:
                    mode = _SKIP if not op.outputs else _COPY_STATE
                if mode != _SKIP:
                    items.append((calls[n], calls[n].fast(), mode, node.random))
            drop = tuple(n for n in op.nodes if len(nodes[n].storages) > 1)
            copies_done = None
            if i in released or i in unparked:
                copies_done = HostWork(tuple(released.get(i, ())), tuple(unparked.get(i, ())))
            compiled.append(_Instr(tuple(items), drop, copies_done))
        for at, values in ready.items():
            compiled[at].host = replace(compiled[at].host or HostWork(), ready=tuple(values))
        if plan.backward_start >= len(plan.program):
            split = len(compiled)
        # trace nodes the step's tensors bind to: parameters, state, then inputs
        self.placeholders = [n.index for n in nodes if n.role in ("param", "state", "input")]
        self.constants = dict(graph.trace.constants)  # lifted constants: bound every step
        self.prologue = [compile_node(nodes[n]) for n in graph.prologue]
        self.tangent_prologue = [compile_node(nodes[n]) for n in graph.tangent_prologue]
        self.forward = compiled[:split]
        self.backward = compiled[split:]

    def run(
        self, instrs: list[_Instr], env: dict[int, Any], rng: dict[int, Any], host: HostStep | None
    ) -> None:
        pop = env.pop
        for ins in instrs:
            if ins.host is not None:
                assert host is not None
                host.work(ins.host, env)
            for call, fast, mode, random in ins.calls:
                if mode == _NORMAL and not random:
                    env[call.index] = fast(env)
                elif mode == _NORMAL:
                    rng[call.index] = _get_rng(_tensor_in(call.args(env)))
                    env[call.index] = call(env)
                elif mode == _REPLAY_RNG:
                    self._replay(call, env, rng[call.index])
                else:  # _COPY_STATE: the recompute must not touch model state again
                    node = self.graph.trace.nodes[call.index]
                    args, kwargs = _copy_written(node, call.args(env), call.kwargs)
                    env[call.index] = call.target(*args, **kwargs)
                    del args, kwargs  # a local reference would outlive the program's FREE
            for n in ins.drop:
                pop(n, None)

    @staticmethod
    def _replay(call: Call, env: dict[int, Any], state: Any) -> None:
        """Run a random node again with the random state of its first run, then restore."""
        device_of = _tensor_in(call.args(env))
        now = _get_rng(device_of)
        _set_rng(device_of, state)
        env[call.index] = call(env)
        _set_rng(device_of, now)


class _StepState:
    """What the forward leaves for the backward: live values and random states."""

    def __init__(self, env: dict[int, Any], rng: dict[int, Any], host: HostStep | None) -> None:
        self.env: dict[int, Any] | None = env
        self.rng = rng
        self.host = host


class _PlanFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, runner: PlannedModule, n_params: int, *tensors: torch.Tensor):
        program, trace = runner._program, runner._program.graph.trace
        env: dict[int, Any] = {}
        state = runner._state_tensors()
        values = list(tensors[:n_params]) + state + list(tensors[n_params:])
        for i, t in zip(program.placeholders, values, strict=True):
            env[i] = t
        env.update(program.constants)
        _run_prologue(program.prologue, env)
        rng: dict[int, Any] = {}
        host = None
        if program.transfers:
            device = tensors[0].device if tensors else torch.device("cpu")
            host = HostStep(runner._lane(device), program.host_pool)
        program.run(program.forward, env, rng, host)
        outputs = tuple(env[n] for n in trace.outputs)
        ctx.step = _StepState(env, rng, host)
        ctx.runner = runner
        ctx.n_params = n_params
        ctx.mark_non_differentiable(
            *[o for i, o in enumerate(outputs) if i not in set(trace.diff_outputs)]
        )
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
        host = step.host.copy() if keep_graph and step.host else step.host
        if not keep_graph:
            step.env = step.host = None
        for t, out in zip(trace.tangents, trace.diff_outputs, strict=True):
            env[t] = grad_outputs[out]
        _run_prologue(program.tangent_prologue, env)
        program.run(program.backward, env, step.rng, host)
        grads = [env[g] if g is not None else None for g in trace.grads]
        if host is not None:
            host.finish()
            ctx.runner.host_peak = host.peak
            del host
        env.clear()
        n_params = ctx.n_params
        input_grads: list[torch.Tensor | None] = [None] * len(trace.input_specs)
        for pos, g in zip(trace.grad_inputs, grads[n_params:], strict=True):
            input_grads[pos] = g
        return (None, None, *grads[:n_params], *input_grads)


class PlannedModule(nn.Module):
    """A drop-in for `model` that trains under a plan; eval mode and no_grad run the model."""

    def __init__(
        self, model: nn.Module, graph: Graph, plan: Plan, loss_fn: Callable | None = None
    ) -> None:
        super().__init__()
        self.model = model
        self.loss_fn = loss_fn
        self.plan = plan
        self._graph = graph
        self._program = _Program(graph, plan)
        self._lanes: dict[torch.device, HostLane] = {}  # an offloading plan's copies, per device
        if self._program.transfers:  # an unsupported device is refused here, not mid-step
            self._lane(next((p.device for p in model.parameters()), torch.device("cpu")))
        self.host_peak = 0  # bytes the last step parked on the host at once (measured)
        trace = graph.trace
        params = dict(model.named_parameters())
        self._param_names = trace.param_names
        self._state_slots = [_slot(model, name) for name in trace.state_names]
        self._params = [params[n] for n in trace.param_names]
        self._input_specs = trace.input_specs
        self._grad_inputs = set(trace.grad_inputs)
        self._call = trace.call

    def _lane(self, device: torch.device) -> HostLane:
        if device not in self._lanes:
            self._lanes[device] = lane_for(device)
        return self._lanes[device]

    def _state_tensors(self) -> list[torch.Tensor]:
        """Buffers and frozen parameters, looked up each step (they may be reassigned)."""
        return [getattr(mod, attr) for mod, attr in self._state_slots]

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """The model's output, as `model(*args, **kwargs)` gives it; with a plan made with a
        loss_fn, the loss `loss_fn(output, *targets)`, targets given as `targets=` (a tensor
        or a tuple of them)."""
        targets: tuple = ()
        if self._call.loss:
            given = kwargs.pop("targets", ())
            targets = (given,) if isinstance(given, torch.Tensor) else tuple(given)
        if not (torch.is_grad_enabled() and self.model.training):
            out = self.model(*args, **kwargs)
            return self.loss_fn(out, *targets) if self.loss_fn is not None else out
        inputs = self._check_call(args, kwargs, targets)
        outputs = _PlanFunction.apply(self, len(self._params), *self._params, *inputs)
        return unflatten_output(list(outputs), self._graph.trace.output_spec)

    def _check_call(self, args: tuple, kwargs: dict, targets: tuple) -> list[Any]:
        """The call's tensors, checked against the plan's call: structure, bound values."""
        inputs, call = split_call(args, kwargs, targets, self._call.loss)
        mine = self._call
        if call.tree != mine.tree or call.n_targets != mine.n_targets:
            raise PlanMismatch(
                f"the plan was made for a call {mine.describe()}, got {call.describe()}"
            )
        for (i, want), (_, got) in zip(mine.constants, call.constants, strict=True):
            if type(want) is not type(got) or want != got:
                raise PlanMismatch(
                    f"argument {mine.leaf_name(i)} is {got!r}, the plan was made with "
                    f"{want!r}: make a plan for this call"
                )
        self._check_inputs(inputs)
        return inputs

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


def apply_plan(
    model: nn.Module, plan: Plan, loss_fn: Callable[..., torch.Tensor] | None = None
) -> PlannedModule:
    """Wrap `model` so that training steps run `plan`. The model must be the one the plan was
    made for (same parameters, same code); inputs must have the plan's shapes and dtypes, and
    be passed the same way (positions, keywords). A plan made with a loss_fn needs it again
    here when loaded from a file (the same function: its ops are checked); the module then
    returns the loss: `loss = planned(*args, **kwargs, targets=y)`.

    Nothing in the plan is trusted: a plan that is not bound to this model is checked against
    the model's own trace (parameters, then the fingerprint), bound to that trace when it has
    none (so its predictions are recomputed, not read from a file), and its program is checked
    by `core.validate.check_program` (InvalidPlan names the step and the reason).
    """
    problem = plan.problem
    if problem is not None and problem.model_ref is not None and problem.model_ref() is model:
        graph, loss_fn = problem.graph, loss_fn or problem.loss_fn
    else:
        mine = _problem_for(model, plan, loss_fn)
        graph = mine.graph
        if problem is None:
            plan.attach(mine)
        elif problem.fingerprint != mine.fingerprint:
            raise PlanMismatch(
                "the plan was made for another graph: "
                + describe_difference(mine.graph.trace, plan.graph_meta)
            )
    check_program(plan, plan.attached_problem())
    return PlannedModule(model, graph, plan, loss_fn)


def _problem_for(
    model: nn.Module, plan: Plan, loss_fn: Callable[..., torch.Tensor] | None
) -> Problem:
    """Trace `model` on fake inputs shaped and passed as the plan records (nothing is
    allocated, however large the recorded shapes) and check the trace is the plan's."""
    check_graph_meta(plan.graph_meta)
    _check_params(model, plan)
    device = next((p.device for p in model.parameters()), torch.device("cpu"))
    with FakeTensorMode():
        example = [
            torch.empty(shape, dtype=getattr(torch, dtype), device=device).requires_grad_(grad)
            for shape, dtype, grad in plan.graph_meta["inputs"]
        ]
    meta = plan.graph_meta.get("call")
    kwargs: dict[str, Any]
    if meta is None:  # plans from before keyword inputs: positional tensors
        args, kwargs, targets = tuple(example), {}, ()
    elif meta["tree"] is None:
        raise PlanMismatch(
            "this plan's call holds arguments a plan file cannot carry (custom containers or "
            "objects): apply the plan in the process that made it (core.apply_plan(model, plan))"
        )
    else:
        args, kwargs, targets = join_call(example, CallSpec.from_data(meta))
        if meta["loss"] and loss_fn is None:
            raise PlanMismatch(
                "this plan was made with a loss_fn: pass the same one, "
                "core.apply_plan(model, plan, loss_fn=...)"
            )
    try:
        problem = analyze(model, args, kwargs, loss_fn if meta and meta["loss"] else None, targets)
    except UnsupportedModel as e:
        raise PlanMismatch(
            f"the model cannot run on the plan's recorded inputs {plan.graph_meta['inputs']} "
            f"({e}): the plan was made for other inputs or another model"
        ) from None
    if problem.fingerprint != plan.fingerprint:
        raise PlanMismatch(
            "the model's traced operations differ from the plan's: "
            + describe_difference(problem.graph.trace, plan.graph_meta)
            + ": make a new plan for this model"
        )
    return problem


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


def _run_prologue(calls: list[Call], env: dict[int, Any]) -> None:
    """Views of placeholders (a weight's transpose): they allocate nothing."""
    for call in calls:
        env[call.index] = call(env)


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


def _copy_written(node, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """Keep a recompute from updating model state again: batch-norm's running statistics
    (optional, unread in training mode) are passed as None, so nothing is allocated; other
    state an op writes in place is replaced by a copy."""
    copied: list[Any] = list(args)
    kwargs = dict(kwargs)
    for pos, _name in undeclared_writes(node.target, copied):
        copied[pos] = None
    for pos, name in aliases_schema_write(node.target):
        if pos < len(copied) and isinstance(copied[pos], torch.Tensor):
            copied[pos] = copied[pos].clone()
        elif isinstance(kwargs.get(name), torch.Tensor):
            kwargs[name] = kwargs[name].clone()
    return tuple(copied), kwargs
