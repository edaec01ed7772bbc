"""A plan compiled into the instruction loop the runtime walks, and the autograd Function
that walks it: the forward part of the program in `forward`, the rest in `backward`.

Exactness rules kept here:
- a recomputed random op (dropout) replays the random state of its first run, and the global
  random stream moves exactly as in eager PyTorch;
- a recomputed op that updates model state (batch-norm running statistics) writes into a
  throwaway copy, so the state is updated once per step.
Offloading plans run their `offload` and `prefetch` instructions through
`core.runtime.transfers`; a compiled step says which copies it issues and waits for.

Uses one private PyTorch API: autograd's keep-graph flag (`torch._C._autograd`), to free the
step's values after a backward unless `retain_graph=True`.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Protocol

import torch

from core.errors import InvalidPlan
from core.graph import Graph
from core.interpret import Call, binding, compile_node
from core.plan import Plan
from core.runtime.transfers import HostLane, HostStep, HostWork
from core.simulator import FREE, OFFLOAD, PREFETCH, RUN, Simulation
from core.trace import aliases_schema_write, autocast_off, undeclared_writes

# how a node runs: normally, replaying its random state, on copies of the state it writes, or not
_NORMAL, _REPLAY_RNG, _COPY_STATE, _SKIP = range(4)


@dataclass
class _Instr:
    """One RUN (or transfer) with the FREEs that follow it, compiled: the loop the runtime
    walks."""

    calls: tuple  # ((call, mode, random), ...)
    drop: tuple[int, ...]  # env keys to drop afterwards: freed values, tuple results
    host: HostWork | None = None  # transfers and copies done before the calls


class CompiledProgram:
    """A plan compiled against a graph: the instruction list the runtime walks."""

    def __init__(self, graph: Graph, plan: Plan) -> None:
        self.graph = graph
        nodes = graph.trace.nodes
        self._placeholders = {v.index for v in graph.values if v.is_placeholder}
        known: dict = {}  # binding choices, per op and argument pattern
        self._calls = {
            n: compile_node(nodes[n], binding(nodes[n], nodes, known))
            for op in graph.ops
            for n in op.nodes
        }
        self.transfers = any(kind in (OFFLOAD, PREFETCH) for kind, _ in plan.program)
        sim = plan.simulate() if self.transfers else None
        self.host_pool = sim.host_pool if sim else 0  # bytes
        compiled, split = self._compile(plan, sim)
        # trace nodes the step's tensors bind to: parameters, state, then inputs
        self.placeholders = [n.index for n in nodes if n.role in ("param", "state", "input")]
        self.constants = dict(graph.trace.constants)  # lifted constants: bound every step
        self.prologue = [compile_node(nodes[n]) for n in graph.prologue]
        self.tangent_prologue = [compile_node(nodes[n]) for n in graph.tangent_prologue]
        self.forward = compiled[:split]
        self.backward = compiled[split:]
        # the optimizer the step runs (core.optimizer_step), checked before each step
        self.optimizer_step = plan.problem.optimizer_step if plan.problem is not None else None

    def _compile(self, plan: Plan, sim: Simulation | None) -> tuple[list[_Instr], int]:
        """The program's instructions compiled, and where the backward's begin."""
        graph = self.graph
        _check_updates_last(graph, plan)
        seen: set[int] = set()
        compiled: list[_Instr] = []
        split = 0
        released, unparked = sim.releases() if sim else ({}, {})
        slot_of: dict[int, int] = {}
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
            items = self._compile_run(target, recompute=target in seen)
            seen.add(target)
            nodes = graph.trace.nodes
            drop = tuple(n for n in graph.ops[target].nodes if len(nodes[n].storages) > 1)
            copies_done = None
            if i in released or i in unparked:
                copies_done = HostWork(tuple(released.get(i, ())), tuple(unparked.get(i, ())))
            compiled.append(_Instr(items, drop, copies_done))
        for at, values in ready.items():
            compiled[at].host = replace(compiled[at].host or HostWork(), ready=tuple(values))
        if plan.backward_start >= len(plan.program):
            split = len(compiled)
        return compiled, split

    def _compile_run(self, target: int, recompute: bool) -> tuple:
        """The calls of one run of op `target`: ((call, fast call, mode, random), ...)."""
        op, nodes = self.graph.ops[target], self.graph.trace.nodes
        items = []
        for n in op.nodes:
            node = nodes[n]
            writes_state = any(
                s in self._placeholders for w in node.writes for s in nodes[w].storages
            )
            mode = _NORMAL
            if recompute and node.random:
                mode = _REPLAY_RNG
            elif recompute and writes_state:
                mode = _SKIP if not op.outputs else _COPY_STATE
            if mode != _SKIP:
                items.append((self._calls[n], self._calls[n].fast(), mode, node.random))
        return tuple(items)

    def run(
        self, instrs: list[_Instr], env: dict[int, Any], rng: dict[int, Any], host: HostStep | None
    ) -> None:
        """Run compiled instructions on `env` (values by trace node), recording the random
        state of first runs in `rng`; `host` does an offloading plan's transfers."""
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


class Runner(Protocol):
    """What `PlanFunction` needs of the planned module that applies it."""

    _program: CompiledProgram
    host_peak: int  # bytes the last step parked on the host at once (measured)

    def _state_tensors(self) -> list[torch.Tensor]: ...

    def _lane(self, device: torch.device) -> HostLane: ...


class PlanFunction(torch.autograd.Function):
    """One training step under a plan: `forward` runs the program's forward part and keeps
    what the plan keeps; `backward` runs the rest and returns the gradients."""

    @staticmethod
    def forward(ctx, runner: Runner, n_params: int, *tensors: torch.Tensor):
        program, trace = runner._program, runner._program.graph.trace
        if program.optimizer_step is not None:
            program.optimizer_step.check_unchanged()
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
        with autocast_off():  # the graph holds autocast's casts as ops of their own
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
        with autocast_off():
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


def _check_updates_last(graph: Graph, plan: Plan) -> None:
    """An optimizer writes parameters and states in place: each run reading one must see the
    version it read when traced (`Graph.read_versions`): before every write of it (the
    forward, the gradients, recomputations), or after the write it follows (the update)."""
    versions = graph.read_versions
    done: dict[int, list[str]] = {}  # storage -> the updates that wrote it so far
    for i, (kind, target) in enumerate(plan.program):
        if kind != RUN:
            continue
        op = graph.ops[target]
        for v in op.inputs:
            want, have = versions.get((op.index, v), 0), done.get(v, [])
            if len(have) > want:
                raise InvalidPlan(
                    f"step {i}: {op.name} reads {graph.values[v].name} after {have[want]} "
                    "updated it: make a new plan of this problem"
                )
            if len(have) < want:
                raise InvalidPlan(
                    f"step {i}: {op.name} reads {graph.values[v].name} before the update it "
                    "follows has written it: make a new plan of this problem"
                )
        for s in op.writes if op.update else ():
            done.setdefault(s, []).append(op.name)


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
