"""Stretch regions run: `Stretches(model, stretches)` opens non-reentrant checkpoint at a
stretch's first moment and closes it at its last (`core.native.boundaries`), in the model's
forward hooks, and records the ATen ops the stretch runs so that its recompute can replay
them.

PyTorch's non-reentrant checkpoint is a generator (`_checkpoint_without_reentrant_generator`,
the one `torch.distributed._composable.checkpoint` opens in a module's hooks): between its
two steps its saved-tensor hooks are active, and what it calls to recompute is a function of
our choosing. Here the forward is the model's own code between two hooks, and the recompute
replays the tape a dispatch mode recorded meanwhile: each op with the tensors it read, those
made inside the stretch by reference (weakly: the tape holds none of them), those made
before it held strongly (checkpoint's frame holds them, as it holds a submodule's inputs).
The replay calls the same ATen ops in the same order under autograd, so autograd saves the
same tensors; checkpoint restores the random state first (for a stretch that draws random
numbers), so dropout draws the same numbers. A value the replay made is dropped after the
last op of the tape that reads it. An op of the stretch writing into a buffer made before
it (batch-norm's running statistics) writes into scratch made when the plan was applied, so
eager's update happens once; into any other tensor made before it: PlanMismatch (the
lowering never cuts there).

The same mode is the stretch's selective policy: it asks the region's policy about each op
(PlanMismatch when eager runs another op than the trace) and keeps the outputs of the ops
it saves detached, as `create_selective_checkpoint_contexts`' caching mode does; the replay
hands them back below autograd (a one-op mode), as its cached mode does, and lets go of each
once its op is through, so an early stop leaves the rest to checkpoint's frame. One Python
dispatch per op in the forward, none in the replay but for the saved ops: the tape knows
the order, where SAC's modes count calls per op.

Under torch.compile the stretches are not opened (a dispatch mode cannot be compiled): the
blocks they cover run whole, as eager does.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes
from torch.utils.checkpoint import (
    SAC_IGNORED_OPS,
    _checkpoint_without_reentrant_generator,
    noop_context_fn,
)

from core.errors import PlanMismatch
from core.native.boundaries import END, START
from core.native.stretch import Stretch

Moment = tuple[str, str, int]  # (module, hook, call)


def _detach_helper(x: Any) -> Any:
    """Selective checkpoint's detach of a cached op output (torch.utils.checkpoint's
    `_detach_helper` in torch 2.12+, inline in older ones): a view detached beneath autograd
    keeps its version counter, and the cache holds no graph."""
    if isinstance(x, torch.Tensor):
        with torch._C._SetExcludeDispatchKeyGuard(torch._C.DispatchKey.ADInplaceOrView, False):
            x = x.detach()
    return x


@dataclass(frozen=True)
class _Made:
    """A tensor argument the stretch made: output `out` of tape op `op`."""

    op: int
    out: int


# (op, its positional args, its kwargs, whether they hold a `_Made`): tensors the stretch
# made are `_Made`, tensors made before it are held as they are (the frame holds them)
_Record = tuple[Any, tuple[Any, ...], dict[str, Any], bool]


class Tape(TorchDispatchMode):
    """The ATen ops a stretch's forward dispatches, with their arguments, to replay, and
    the outputs of those its policy saves (detached, as selective checkpoint's cache keeps
    them), which the replay hands back instead of running the op again."""

    def __init__(
        self,
        label: str,
        scratch: dict[int, tuple[torch.Tensor, torch.Tensor]],
        policy: Any,
        anchor: tuple[torch.Tensor, ...] = (),
    ) -> None:
        super().__init__()
        self.label = label
        self.scratch = scratch  # id(buffer) -> (buffer, its scratch)
        self.policy = policy  # `saves(op)`: the next op is saved (PlanMismatch: not traced)
        self.anchor = anchor  # what a stretch nested in this one saves to it as it opens
        # (op, True) a nested stretch opened before tape op `op`, (op, False) it closed there
        self.nested: list[tuple[int, bool]] = []
        self.ops: list[_Record] = []
        self.cache: dict[int, Any] = {}  # tape op -> its outputs, detached, until replayed
        self.made: dict[int, tuple[weakref.ref, int, int]] = {}  # id -> (ref, op, out)
        self.outputs: list[int] = []  # tensors each op returned
        self.last: dict[tuple[int, int], int] = {}  # a made tensor -> the last op reading it
        self.frees: list[list[tuple[int, int]]] = []  # slots each op's replay drops after
        self._reads = False  # the op being recorded reads a tensor the stretch made

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
        kwargs = kwargs or {}
        j = len(self.ops)
        written = _written(func, args, kwargs)
        self._reads = False
        rec_args = tuple(self._arg(func, x, written, j) for x in args)
        rec_kwargs = {k: self._arg(func, x, written, j) for k, x in kwargs.items()}
        self.ops.append((func, rec_args, rec_kwargs, self._reads))
        out = func(*args, **kwargs)
        if id(func) not in _IGNORED and self.policy.saves(func):
            self.cache[j] = _map(_detach_helper, out)
        tensors = _tensors(out)
        self.outputs.append(len(tensors))
        for i, t in enumerate(tensors):
            self.made[id(t)] = (weakref.ref(t), j, i)
        return out

    def _arg(self, func: Any, x: Any, written: tuple[torch.Tensor, ...], j: int) -> Any:
        """`x` as the tape records it for op `j`."""
        if isinstance(x, torch.Tensor):
            made = self.made.get(id(x))
            if made is not None and made[0]() is x:
                self._reads = True
                self.last[(made[1], made[2])] = j
                return _Made(made[1], made[2])
            held = self.scratch.get(id(x))
            if held is not None and held[0] is x:
                # running statistics: batch norm writes them without saying so in its
                # schema (`native_batch_norm`'s running_mean is no `Tensor(a!)`)
                return held[1]
            if any(x is w for w in written):
                raise PlanMismatch(
                    f"{self.label}: {func} writes into a tensor made before this stretch of "
                    "the forward, which its recompute would write again: analyse the model "
                    "as it runs now, or plan it with the interpreter runtime"
                )
            return x
        if type(x) in (list, tuple) and any(isinstance(y, torch.Tensor) for y in x):
            return type(x)(self._arg(func, y, written, j) for y in x)
        return x

    def finish(self) -> None:
        """The forward is done: note when the replay can drop each value (after the last
        op reading it, or at once), forget the stretch's own tensors."""
        self.frees = [[] for _ in self.ops]
        for j, n in enumerate(self.outputs):
            for i in range(n):
                self.frees[self.last.get((j, i), j)].append((j, i))
        self.made.clear()

    def mark(self, opened: bool) -> None:
        """A stretch nested in this one opens (or closes) before the next op."""
        self.nested.append((len(self.ops), opened))

    def replay(self, *_anchor: Any) -> None:
        """Run the tape again (checkpoint's recompute): the same ops on the same inputs,
        autocast off (the tape holds the casts autocast made). A stretch nested in this one
        is opened again where it opened, as a fresh checkpoint (PyTorch's nesting: its
        inputs saved to this one's recompute, its ops' saved tensors to itself, held by
        nothing, since this recompute's graph is never run backward)."""
        slots: dict[tuple[int, int], torch.Tensor] = {}
        marks: dict[int, list[bool]] = {}
        for at, opened in self.nested:
            marks.setdefault(at, []).append(opened)
        with contextlib.ExitStack() as stack:
            for device in ("cpu", "cuda"):
                if torch.amp.is_autocast_available(device):
                    stack.enter_context(torch.autocast(device, enabled=False))
            fresh = _Fresh(self.anchor)
            stack.callback(fresh.abandon)
            for j, (func, args, kwargs, reads) in enumerate(self.ops):
                for opened in marks.get(j, ()):
                    fresh.step(opened)
                if reads:
                    args = tuple(_value(x, slots) for x in args)
                    kwargs = {k: _value(x, slots) for k, x in kwargs.items()}
                if j not in self.cache:
                    out = func(*args, **kwargs)
                else:  # handed back below autograd, which records the op as it did
                    with _Give(func, self.cache, j):
                        out = func(*args, **kwargs)
                del args, kwargs
                for i, t in enumerate(_tensors(out)):
                    slots[(j, i)] = t
                del out
                for key in self.frees[j]:
                    del slots[key]
            for opened in marks.get(len(self.ops), ()):
                fresh.step(opened)


class _Fresh:
    """The stretches nested in a replayed one, opened again as fresh non-reentrant
    checkpoints of nothing to recompute: opening one saves the anchor to the replay's
    recompute (a holder of the forward, filled; early stop may end the replay there), and
    its ops' saved tensors go to the fresh checkpoint's holders, which hold nothing."""

    def __init__(self, anchor: tuple[torch.Tensor, ...]) -> None:
        self.anchor = anchor
        self.open: list[Any] = []

    def step(self, opened: bool) -> None:
        if opened:
            gen = _checkpoint_without_reentrant_generator(
                _nothing, False, noop_context_fn, "default", False, True, *self.anchor
            )
            next(gen)
            self.open.append(gen)
        else:
            _finish(self.open.pop())

    def abandon(self) -> None:
        """Leave the hooks of those still open (the replay stopped or failed)."""
        while self.open:
            self.open.pop().close()


def _nothing(*_: Any) -> None:  # pragma: no cover - a fresh nested checkpoint never recomputes
    raise AssertionError("a stretch opened again in a replay recomputed")


def _finish(gen: Any) -> None:
    """Step a checkpoint generator past its end (it yields once)."""
    try:
        next(gen)
    except StopIteration:
        return
    raise AssertionError("checkpoint's generator yielded twice")  # pragma: no cover


def _value(x: Any, slots: dict[tuple[int, int], torch.Tensor]) -> Any:
    """A recorded argument with the tensors the replay made in place of their `_Made`."""
    if isinstance(x, _Made):
        return slots[(x.op, x.out)]
    if type(x) in (list, tuple):
        return type(x)(_value(y, slots) for y in x)
    return x


class _Give(TorchDispatchMode):
    """A saved op replayed: its forward's outputs taken out of the cache and handed back
    where the op would run, as selective checkpoint's cached mode pops them; other ops run.
    Taken there, not once the op is through: checkpoint's early stop, raised as autograd
    saves the op's inputs, leaves them to the frame, as SAC's cache does; raised as it
    saves its results, autograd has made them outputs of the recompute's graph, and a
    cache still holding them would hold that graph and every value it saved."""

    def __init__(self, func: Any, cache: dict[int, Any], j: int) -> None:
        super().__init__()
        self.func = func
        self.cache = cache
        self.j = j
        self.given = False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
        if func is self.func and not self.given:
            self.given = True
            return self.cache.pop(self.j)
        return func(*args, **(kwargs or {}))


def _map(f: Callable[[Any], Any], out: Any) -> Any:
    """`f` applied to each tensor of an ATen op's outputs, the structure kept."""
    if isinstance(out, torch.Tensor):
        return f(out)
    if type(out) in (list, tuple):
        return type(out)(_map(f, x) for x in out)
    return out


def _tensors(out: Any) -> list[torch.Tensor]:
    """The tensors an ATen op returned, in order (a tensor, or a tuple or list of them)."""
    if isinstance(out, torch.Tensor):
        return [out]
    if type(out) in (list, tuple):
        return [t for x in out for t in _tensors(x)]
    return []


_WRITES: dict[int, tuple[tuple[int, str, bool], ...]] = {}  # id(op) -> its written arguments
_IGNORED = frozenset(map(id, SAC_IGNORED_OPS))  # ops selective checkpoint passes over


def _written(func: Any, args: tuple, kwargs: dict) -> tuple[torch.Tensor, ...]:
    """The tensor arguments `func` writes into (its schema's `Tensor(a!)`)."""
    places = _WRITES.get(id(func))
    if places is None:
        places = tuple(
            (k, arg.name, arg.kwarg_only)
            for k, arg in enumerate(func._schema.arguments)
            if arg.alias_info is not None and arg.alias_info.is_write
        )
        _WRITES[id(func)] = places
    if not places:
        return ()
    out: list[torch.Tensor] = []
    for k, name, kwarg_only in places:
        value = args[k] if k < len(args) and not kwarg_only else kwargs.get(name)
        out += [t for t in _tensors(value) if isinstance(t, torch.Tensor)]
    return tuple(out)


class _Open:
    """A stretch being run: its checkpoint generator, tape and policy. Opened inside
    another (nested), its generator saves the anchor to that one's checkpoint as it opens
    (PyTorch's rule for a nested checkpoint's inputs), outside every dispatch mode (the
    enclosing stretches' tapes record the model's ops only)."""

    def __init__(
        self,
        stretch: Stretch,
        policy: Any,
        scratch: dict[int, tuple[torch.Tensor, torch.Tensor]],
        anchor: tuple[torch.Tensor, ...],
        random: bool,
        nested: bool,
    ) -> None:
        self.stretch = stretch
        self.policy = policy
        self.tape = Tape(stretch.label, scratch, policy, anchor)
        # the random state is kept for the replay only where it draws random numbers
        self.gen = _checkpoint_without_reentrant_generator(
            self.tape.replay, random, noop_context_fn, "default", False, True, *anchor
        )
        with _disable_current_modes() if nested else contextlib.nullcontext():
            next(self.gen)
        self.tape.__enter__()

    def close(self) -> None:
        self.tape.__exit__(None, None, None)
        _finish(self.gen)
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
    start and end). A stretch nested in another opens inside it (after it, at a moment
    both begin at) and closes before it."""

    def __init__(
        self,
        model: nn.Module,
        stretches: tuple[Stretch, ...],
        policy: Callable[[Stretch], Any],
    ) -> None:
        self.stretches = stretches
        self.policy = policy
        self.starts: dict[Moment, list[Stretch]] = {}
        self.ends: dict[Moment, list[Stretch]] = {}
        for s in stretches:  # parents are listed before what they hold
            self.starts.setdefault(_key(s.start), []).append(s)
            self.ends.setdefault(_key(s.end), []).insert(0, s)
        self.random = {id(s): _draws(s) for s in stretches}
        self.scratch = _scratch(model)
        param = next(model.parameters(), None)
        self.anchor = (param,) if param is not None else ()
        self.depth = 0
        self.active = False
        self.calls: dict[tuple[str, str], int] = {}
        self.open: list[_Open] = []  # the stretches open now, the outermost first
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
                if self.open:
                    raise PlanMismatch(
                        f"{self.open[-1].stretch.label}: the step ended before this stretch "
                        "did: the model runs other code than it did when analysed"
                    )
        except BaseException as e:
            if outermost:
                while self.open:
                    self.open.pop().abort(e)
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
        for ending in self.ends.get(moment, ()):
            if self.open and self.open[-1].stretch is ending:
                self.open.pop().close()
                for around in self.open:
                    around.tape.mark(False)
        for starting in self.starts.get(moment, ()):
            parent = None if starting.parent is None else self.stretches[starting.parent]
            top = self.open[-1].stretch if self.open else None
            if top is not parent:
                raise PlanMismatch(
                    f"{starting.label}: begins while "
                    f"{top.label if top is not None else 'no stretch'} runs: the model runs "
                    "other code than it did when analysed"
                )
            for around in self.open:
                around.tape.mark(True)
            self.open.append(
                _Open(
                    starting,
                    self.policy(starting),
                    self.scratch,
                    self.anchor,
                    self.random[id(starting)],
                    bool(self.open),
                )
            )


def _draws(stretch: Stretch) -> bool:
    """Whether the stretch runs a random op (its replay must draw as its forward did)."""
    return any(
        isinstance(op, torch._ops.OpOverload) and torch.Tag.nondeterministic_seeded in op.tags
        for op in stretch.ops
    )


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
