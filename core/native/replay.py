"""Stretch regions run: `Stretches(model, stretches)` opens non-reentrant checkpoint at a
stretch's first moment and closes it at its last (`core.native.boundaries`), in the model's
forward hooks, and records the ATen ops the stretch runs so that its recompute can replay
them.

PyTorch's non-reentrant checkpoint is a generator (`_checkpoint_without_reentrant_generator`,
the one `torch.distributed._composable.checkpoint` opens in a module's hooks): between its
two steps the saved-tensor hooks and the selective policy's caching mode are active, and
what it calls to recompute is a function of our choosing. Here the forward is the model's
own code between two hooks, and the recompute replays the tape a dispatch mode recorded
meanwhile: each op with the tensors it read, those made inside the stretch by reference
(weakly: the tape holds none of them), those made before it held strongly (checkpoint's
frame holds them, as it holds a submodule's inputs). The replay calls the same ATen ops in
the same order under autograd, so autograd saves the same tensors; checkpoint restores the
random state first, so dropout draws the same numbers; the selective policy's cache hands
back what it saved. A value the replay made is dropped after the last op of the tape that
reads it. An op of the stretch writing into a buffer made before it (batch-norm's running
statistics) writes into scratch made when the plan was applied, so eager's update happens
once; into any other tensor made before it: PlanMismatch (the lowering never cuts there).

Under torch.compile the stretches are not opened (a dispatch mode cannot be compiled): the
blocks they cover run whole, as eager does.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_leaves, tree_unflatten
from torch.utils.checkpoint import (
    _checkpoint_without_reentrant_generator,
    create_selective_checkpoint_contexts,
)
from torch.utils.weak import WeakTensorKeyDictionary

from core.errors import PlanMismatch
from core.native.boundaries import END, START
from core.native.stretch import Stretch

Moment = tuple[str, str, int]  # (module, hook, call)


@dataclass(frozen=True)
class _Made:
    """A tensor argument the stretch made: output `out` of tape op `op`."""

    op: int
    out: int


@dataclass(frozen=True)
class _Outer:
    """A tensor argument made before the stretch (held: the frame holds it)."""

    tensor: torch.Tensor


class Tape(TorchDispatchMode):
    """The ATen ops a stretch's forward dispatches, with their arguments, to replay."""

    def __init__(self, label: str, scratch: dict[int, tuple[torch.Tensor, torch.Tensor]]):
        super().__init__()
        self.label = label
        self.scratch = scratch  # id(buffer) -> (buffer, its scratch)
        self.ops: list[tuple[Any, list[Any], Any]] = []
        self.made: WeakTensorKeyDictionary | None = WeakTensorKeyDictionary()
        self.outputs: list[int] = []  # tensors each op returned
        self.frees: list[list[tuple[int, int]]] = []  # slots each op's replay drops after

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
        kwargs = kwargs or {}
        flat, spec = tree_flatten((args, kwargs))
        written = _written(func, args, kwargs)
        assert self.made is not None
        record: list[Any] = []
        for x in flat:
            if not isinstance(x, torch.Tensor):
                record.append(x)
            elif x in self.made:
                record.append(_Made(*self.made[x]))
            elif id(x) in self.scratch and self.scratch[id(x)][0] is x:
                # running statistics: batch norm writes them without saying so in its
                # schema (`native_batch_norm`'s running_mean is no `Tensor(a!)`)
                record.append(_Outer(self.scratch[id(x)][1]))
            elif any(x is w for w in written):
                record.append(_Outer(self._scratch(func, x)))
            else:
                record.append(_Outer(x))
        out = func(*args, **kwargs)
        j = len(self.ops)
        self.ops.append((func, record, spec))
        tensors = [t for t in tree_leaves(out) if isinstance(t, torch.Tensor)]
        self.outputs.append(len(tensors))
        for i, t in enumerate(tensors):
            self.made[t] = (j, i)
        return out

    def _scratch(self, func: Any, x: torch.Tensor) -> torch.Tensor:
        held = self.scratch.get(id(x))
        if held is None or held[0] is not x:
            raise PlanMismatch(
                f"{self.label}: {func} writes into a tensor made before this stretch of the "
                "forward, which its recompute would write again: analyse the model as it "
                "runs now, or plan it with the interpreter runtime"
            )
        return held[1]

    def finish(self) -> None:
        """The forward is done: note when the replay can drop each value (after the last
        op reading it, or at once), forget the stretch's own tensors."""
        last: dict[tuple[int, int], int] = {}
        for j, (_, record, _) in enumerate(self.ops):
            for r in record:
                if isinstance(r, _Made):
                    last[(r.op, r.out)] = j
        self.frees = [[] for _ in self.ops]
        for j, n in enumerate(self.outputs):
            for i in range(n):
                self.frees[last.get((j, i), j)].append((j, i))
        self.made = None

    def replay(self, *_anchor: Any) -> None:
        """Run the tape again (checkpoint's recompute): the same ops on the same inputs,
        autocast off (the tape holds the casts autocast made)."""
        slots: dict[tuple[int, int], torch.Tensor] = {}
        with contextlib.ExitStack() as stack:
            for device in ("cpu", "cuda"):
                if torch.amp.is_autocast_available(device):
                    stack.enter_context(torch.autocast(device, enabled=False))
            for j, (func, record, spec) in enumerate(self.ops):
                flat = [_value(r, slots) for r in record]
                args, kwargs = tree_unflatten(flat, spec)
                del flat
                out = func(*args, **kwargs)
                del args, kwargs
                for i, t in enumerate(t for t in tree_leaves(out) if isinstance(t, torch.Tensor)):
                    slots[(j, i)] = t
                del out
                for key in self.frees[j]:
                    del slots[key]


def _value(r: Any, slots: dict[tuple[int, int], torch.Tensor]) -> Any:
    if isinstance(r, _Made):
        return slots[(r.op, r.out)]
    return r.tensor if isinstance(r, _Outer) else r


def _written(func: Any, args: tuple, kwargs: dict) -> list[torch.Tensor]:
    """The tensor arguments `func` writes into (its schema's `Tensor(a!)`)."""
    out = []
    schema = func._schema
    for k, arg in enumerate(schema.arguments):
        info = arg.alias_info
        if info is None or not info.is_write:
            continue
        value = args[k] if k < len(args) and not arg.kwarg_only else kwargs.get(arg.name)
        out += [t for t in tree_leaves(value) if isinstance(t, torch.Tensor)]
    return out


class _Open:
    """A stretch being run: its checkpoint generator, tape and policy."""

    def __init__(
        self,
        stretch: Stretch,
        policy: Any,
        scratch: dict[int, tuple[torch.Tensor, torch.Tensor]],
        anchor: tuple[torch.Tensor, ...],
    ) -> None:
        self.stretch = stretch
        self.policy = policy
        self.tape = Tape(stretch.label, scratch)

        def contexts() -> tuple[Any, Any]:
            return create_selective_checkpoint_contexts(policy, allow_cache_entry_mutation=True)

        self.gen = _checkpoint_without_reentrant_generator(
            self.tape.replay, True, contexts, "default", False, True, *anchor
        )
        next(self.gen)
        self.tape.__enter__()

    def close(self) -> None:
        self.tape.__exit__(None, None, None)
        try:
            next(self.gen)
        except StopIteration:
            pass
        else:  # pragma: no cover - the generator yields once
            raise AssertionError("checkpoint's generator yielded twice")
        self.policy.check_done()
        self.tape.finish()

    def abort(self, error: BaseException) -> None:
        """The forward failed inside the stretch: leave the mode and the hooks."""
        self.tape.__exit__(type(error), error, error.__traceback__)
        with contextlib.suppress(BaseException):
            self.gen.throw(error)


class Stretches:
    """The stretches of a native plan, opened and closed at their moments: hooks on the
    submodules whose calls begin or end one, and `step()` around the step's forward (its
    start and end)."""

    def __init__(
        self,
        model: nn.Module,
        stretches: tuple[Stretch, ...],
        policy: Callable[[Stretch], Any],
    ) -> None:
        self.stretches = stretches
        self.policy = policy
        self.starts: dict[Moment, Stretch] = {_key(s.start): s for s in stretches}
        self.ends: dict[Moment, Stretch] = {_key(s.end): s for s in stretches}
        self.scratch = _scratch(model)
        param = next(model.parameters(), None)
        self.anchor = (param,) if param is not None else ()
        self.depth = 0
        self.active = False
        self.calls: dict[tuple[str, str], int] = {}
        self.open: _Open | None = None
        self.hooks: list[Any] = []
        wanted = {(m, h) for m, h, _ in (*self.starts, *self.ends) if m}
        for name, sub in model.named_modules():
            if (name, "pre") in wanted:
                self.hooks.append(
                    sub.register_forward_pre_hook(lambda *_, n=name: self._moment(n, "pre"))
                )
            if (name, "post") in wanted:
                self.hooks.append(
                    sub.register_forward_hook(lambda *_, n=name: self._moment(n, "post"))
                )

    def remove(self) -> None:
        for hook in self.hooks:
            hook.remove()
        self.hooks.clear()

    @contextlib.contextmanager
    def step(self) -> Iterator[None]:
        """The step's forward: its start and end are moments; a failure closes what is
        open."""
        self.depth += 1
        outermost = self.depth == 1
        try:
            if outermost:
                self.calls.clear()
                self.active = torch.is_grad_enabled() and not torch.compiler.is_compiling()
                self._fire(("", START, 0))
            yield
            if outermost:
                self._fire(("", END, 0))
                if self.open is not None:
                    raise PlanMismatch(
                        f"{self.open.stretch.label}: the step ended before this stretch "
                        "did: the model runs other code than it did when analysed"
                    )
        except BaseException as e:
            if outermost and self.open is not None:
                self.open.abort(e)
                self.open = None
            raise
        finally:
            self.depth -= 1
            if outermost:
                self.active = False

    def _moment(self, module: str, hook: str) -> None:
        if not self.active:
            return
        k = self.calls.get((module, hook), 0)
        self.calls[(module, hook)] = k + 1
        self._fire((module, hook, k))

    def _fire(self, moment: Moment) -> None:
        if not self.active:
            return
        ending = self.ends.get(moment)
        if ending is not None and self.open is not None and self.open.stretch is ending:
            closing, self.open = self.open, None
            closing.close()
        starting = self.starts.get(moment)
        if starting is not None:
            if self.open is not None:
                raise PlanMismatch(
                    f"{starting.label}: begins while {self.open.stretch.label} runs: the "
                    "model runs other code than it did when analysed"
                )
            self.open = _Open(starting, self.policy(starting), self.scratch, self.anchor)


def _key(b: Any) -> Moment:
    return (b.module, b.hook, b.call)


def _scratch(model: nn.Module) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
    """Scratch for the running statistics of the model's norms, made now (not in a step):
    a replayed batch norm updates these, not the model's."""
    out = {}
    for m in model.modules():
        if isinstance(m, nn.modules.batchnorm._NormBase) and m.track_running_stats:
            for name in ("running_mean", "running_var", "num_batches_tracked"):
                b = m._buffers.get(name)
                if b is not None:
                    out[id(b)] = (b, torch.zeros_like(b))
    return out
