"""The LM-head loss, chunked over rows: a planner choice that goes below the floor.

A language model's last linear (`lm_head`) feeding a cross-entropy over its last dim makes
the step's largest tensors: the logits, their log-softmax and its gradient, rows x vocabulary
each, all alive at once in the log-softmax backward. `LossHeadMode`, entered while a step is
traced (or run eagerly), finds that pattern at the Python level (`F.linear` whose output, or
a view of it keeping the last dim, goes to `F.cross_entropy`) and substitutes
`ChunkedHead`: the head's matmul and the loss over chunks of rows, each chunk's logits freed
after its loss, and recomputed chunk by chunk in the backward (one more head matmul in all).
The chunked form is made of ordinary ATen ops, so it is traced, simulated, solved and run
like any other part of the step.

Numerics: each row's log-softmax and its gradient are the same ATen ops on the same row, so
they are bit-identical; the input gradient of a chunk is a row block of the same matmul
(bit-identical when the chunk's rows suit the matmul kernel, see docs/floor.md); the head's
weight and bias gradients and the loss are summed chunk by chunk, so they differ from the
unchunked step by summation order.

A bfloat16 head (bf16 autocast, or a bf16 model) whose loss runs in float32 (the logits
upcast, `logits.float()`, or autocast's own cast before the cross-entropy) is chunked too,
with the casts eager makes: the operands cast to bf16, each chunk's logits cast up before its
log-softmax, their gradient cast back to bf16. Eager computes the weight gradient in one bf16
matmul, which accumulates in fp32 and rounds once; rounding each chunk's product would not be
summation order, so each chunk's weight gradient is an fp32 matmul of the bf16 operands (their
products are exact in fp32), summed in fp32 and rounded once to bf16 (the bias gradient
likewise). A head whose loss runs in bf16 (no upcast) is left plain: each chunk's partial loss
would round to bf16.

Models that call `F.linear_cross_entropy` themselves are traced through it: its chunked path
is one opaque custom op whose buffers no trace sees, so the mode runs its reference path
(plain) or `ChunkedHead` (chunked) instead.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch._C import DispatchKey, DispatchKeySet
from torch.overrides import TorchFunctionMode
from torch.utils.weak import WeakIdKeyDictionary

from core.trace.autocast import autocast_off

aten = torch.ops.aten
_REDUCTIONS = {"sum": 2, "mean": 1}  # ATen's reduction enum
_VIEWS = {
    torch.Tensor.view,
    torch.Tensor.reshape,
    torch.reshape,
    torch.Tensor.flatten,
    torch.flatten,
    torch.Tensor.contiguous,
}
# dtype casts of the logits between the head and its loss (bf16 recipes upcast to fp32)
_CASTS = {
    torch.Tensor.float,
    torch.Tensor.double,
    torch.Tensor.half,
    torch.Tensor.bfloat16,
    torch.Tensor.to,
    torch.Tensor.type,
}
# a head's matmul dtype whose weight gradient is summed in fp32 and rounded once, as the
# matmul kernel does, when its loss runs in fp32 (docs/floor.md, the numerical contract)
_ROUNDED = torch.bfloat16


# F.linear_cross_entropy, new in torch 2.12 (None before: no model calls it there)
_LINEAR_CROSS_ENTROPY = getattr(F, "linear_cross_entropy", None)


@dataclass(frozen=True)
class LossHead:
    """How a step computes an LM-head loss: "plain" (as the model writes it) or "chunked"
    (`rows` rows per chunk; None: `default_rows`)."""

    kind: str = "plain"
    rows: int | None = None

    def __post_init__(self) -> None:
        if self.kind not in ("plain", "chunked"):
            raise ValueError(f"unknown loss head {self.kind!r}: use 'plain' or 'chunked'")
        if self.rows is not None and (not isinstance(self.rows, int) or self.rows < 1):
            raise ValueError(f"rows per chunk must be a positive int or None, not {self.rows!r}")

    def to_data(self) -> dict[str, Any] | None:
        """What a plan file records (None: plain, recorded by omission)."""
        return None if self.kind == "plain" else {"kind": self.kind, "rows": self.rows}

    @staticmethod
    def from_data(data: dict[str, Any] | None) -> LossHead:
        """The head `to_data` wrote."""
        return PLAIN if data is None else LossHead(str(data["kind"]), data["rows"])


PLAIN = LossHead()


@dataclass(frozen=True)
class Head:
    """One LM head the mode found: its shape and what it did with it."""

    rows: int  # N: tokens
    features: int  # d
    classes: int  # V
    chunk_rows: int  # 0 when left plain
    logits_bytes: int  # the full logits, rows x classes


def default_rows(n: int, d: int, v: int) -> int:
    """Rows per chunk: the largest power of two at most max(d, 64), so a chunk's logits
    are no larger than the head's weight (V x d); at least 64 rows, a size the matmul
    kernels handle as they handle the whole."""
    cap = max(d, 64)
    return min(n, 1 << (cap.bit_length() - 1))


class ChunkedHead(torch.autograd.Function):
    """loss = cross_entropy(x @ w.T + b, target) over chunks of `rows` rows of x (N x d), the
    log-softmax in `loss_dtype` (the logits cast up to it where the head runs in bf16)."""

    @staticmethod
    def forward(
        ctx: Any,
        x: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        target: torch.Tensor,
        rows: int,
        reduction: int,
        ignore_index: int,
        loss_dtype: torch.dtype,
    ) -> torch.Tensor:
        total = count = None
        with _dtypes_as_written():
            for start in range(0, x.shape[0], rows):
                logp = _log_probs(x[start : start + rows], weight, bias, loss_dtype)
                part, n = aten.nll_loss_forward(
                    logp, target[start : start + rows], None, 2, ignore_index
                )
                del logp
                total = part if total is None else aten.add(total, part)
                count = n if count is None else aten.add(count, n)
            assert total is not None and count is not None
            ctx.save_for_backward(x, weight, bias, target, count)
            ctx.rows, ctx.reduction, ctx.ignore_index = rows, reduction, ignore_index
            ctx.loss_dtype = loss_dtype
            return aten.div(total, count) if reduction == 1 else total

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        x, weight, bias, target, count = ctx.saved_tensors
        rows, need = ctx.rows, ctx.needs_input_grad
        wide = weight.dtype == _ROUNDED  # the weight and bias gradients summed in fp32
        parts: list[torch.Tensor] = []
        grad_wt = grad_b = None  # the weight's gradient transposed (d x V), as eager's mm
        with _dtypes_as_written():
            for start in range(0, x.shape[0], rows):
                xc, tc = x[start : start + rows], target[start : start + rows]
                logp = _log_probs(xc, weight, bias, ctx.loss_dtype)
                g = aten.nll_loss_backward(
                    grad, logp, tc, None, ctx.reduction, ctx.ignore_index, count
                )
                gl = aten._log_softmax_backward_data(g, logp, 1, logp.dtype)
                del g, logp
                if gl.dtype != weight.dtype:  # the upcast's backward: back to the head's dtype
                    gl = aten._to_copy(gl, dtype=weight.dtype)
                if need[0]:
                    parts.append(aten.mm(gl, weight))
                if need[1]:
                    xt = aten.t(xc)
                    if wide:  # bf16 x bf16 products are exact in fp32
                        xt = aten._to_copy(xt, dtype=torch.float32)
                        g32 = aten._to_copy(gl, dtype=torch.float32)
                        grad_wt = (
                            aten.mm(xt, g32) if grad_wt is None else aten.addmm(grad_wt, xt, g32)
                        )
                        del g32
                    else:
                        grad_wt = (
                            aten.mm(xt, gl) if grad_wt is None else aten.addmm(grad_wt, xt, gl)
                        )
                if bias is not None and need[2]:
                    s = aten.sum(gl, [0], dtype=torch.float32) if wide else aten.sum(gl, [0])
                    grad_b = s if grad_b is None else aten.add(grad_b, s)
                del gl
            grad_x = aten.cat(parts) if need[0] else None
            if wide:  # one rounding to the head's dtype, as the unchunked matmul's
                grad_wt = (
                    aten._to_copy(grad_wt, dtype=weight.dtype) if grad_wt is not None else None
                )
                grad_b = aten._to_copy(grad_b, dtype=weight.dtype) if grad_b is not None else None
            grad_w = aten.t(grad_wt) if grad_wt is not None else None
        return grad_x, grad_w, grad_b, None, None, None, None, None


def _log_probs(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, dtype: torch.dtype
) -> torch.Tensor:
    """log_softmax(x @ w.T + b) in `dtype`, with the ATen ops `F.linear`, the logits' cast
    and `F.cross_entropy` use."""
    wt = aten.t(weight)
    logits = aten.mm(x, wt) if bias is None else aten.addmm(bias, x, wt)
    if logits.dtype != dtype:
        logits = aten._to_copy(logits, dtype=dtype)
    return aten._log_softmax(logits, 1, False)


@contextlib.contextmanager
def _dtypes_as_written() -> Iterator[None]:
    """The chunked head's ops in the dtypes it gives them: no autocast (a step's own, or the
    CUDA lists `core.trace.cuda_autocast` applies to CPU tensors through the AutocastCPU key)
    casts them again."""
    with autocast_off(), torch._C._ExcludeDispatchKeyGuard(DispatchKeySet(DispatchKey.AutocastCPU)):
        yield


@dataclass(frozen=True)
class _Linear:
    """A tracked linear output: what made it, and the leading dims the logits now have."""

    x: torch.Tensor
    weight: torch.Tensor
    bias: torch.Tensor | None
    lead: tuple[int, ...]
    dtype: torch.dtype  # the matmul's (autocast's where it casts the operands)

    def rows(self) -> torch.Tensor:
        """x shaped as the logits' leading dims (a view where x is contiguous)."""
        return self.x if tuple(self.x.shape[:-1]) == self.lead else self.x.reshape(*self.lead, -1)


class LossHeadMode(TorchFunctionMode):
    """Within it, LM-head losses run as `head` says; `found` lists the heads met, `refused`
    why a head's loss was left plain (what a user can act on)."""

    def __init__(self, head: LossHead = PLAIN) -> None:
        super().__init__()
        self.head = head
        self.found: list[Head] = []
        self.refused: list[str] = []
        self._linears: WeakIdKeyDictionary = WeakIdKeyDictionary()

    def __enter__(self) -> LossHeadMode:
        """Each entry starts afresh: a step traced twice reports its heads once."""
        self.found = []
        self.refused = []
        self._linears = WeakIdKeyDictionary()
        return super().__enter__()

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if func is _LINEAR_CROSS_ENTROPY:  # torch 2.12+
            return self._linear_cross_entropy(*args, **kwargs)
        out = func(*args, **kwargs)
        if self.head.kind == "plain":
            return out
        if func is F.linear and isinstance(out, torch.Tensor):
            x, weight = args[0], args[1] if len(args) > 1 else kwargs["weight"]
            bias = args[2] if len(args) > 2 else kwargs.get("bias")
            self._linears[out] = _Linear(x, weight, bias, tuple(out.shape[:-1]), out.dtype)
        elif func in _VIEWS and args and args[0] in self._linears and isinstance(out, torch.Tensor):
            src = self._linears[args[0]]
            if out.dim() >= 1 and out.shape[-1] == src.weight.shape[0]:
                self._linears[out] = dataclasses.replace(src, lead=tuple(out.shape[:-1]))
        elif func in _CASTS and args and args[0] in self._linears and isinstance(out, torch.Tensor):
            src, was = self._linears[args[0]], args[0].dtype
            if out.dtype == was or (was == _ROUNDED and out.dtype == torch.float32):
                self._linears[out] = src  # what the loss runs in is read at the loss
            else:
                self.refused.append(
                    f"the logits are cast from {_name(was)} to {_name(out.dtype)} between the "
                    "head and the loss; the chunked head casts them only from bfloat16 to "
                    "float32"
                )
        elif func is F.cross_entropy and args and args[0] in self._linears:
            lin = self._linears[args[0]]
            chunked = self._chunked(lin, out.dtype, *args[1:], **kwargs)
            if chunked is not None:
                return chunked
        return out

    def _chunked(
        self,
        lin: _Linear,
        loss_dtype: torch.dtype,
        target: torch.Tensor,
        weight: torch.Tensor | None = None,
        size_average: Any = None,
        ignore_index: int = -100,
        reduce: Any = None,
        reduction: str = "mean",
        label_smoothing: float = 0.0,
    ) -> torch.Tensor | None:
        """The chunked loss of a tracked head whose cross-entropy runs in `loss_dtype` (its
        plain loss's dtype), or None where the form does not apply."""
        if (
            len(lin.lead) != 1
            or lin.weight.dim() != 2
            or lin.x.shape[-1] != lin.weight.shape[1]
            or weight is not None
            or size_average is not None
            or reduce is not None
            or reduction not in _REDUCTIONS
            or label_smoothing != 0.0
            or target.dtype != torch.int64
            or tuple(target.shape) != lin.lead
        ):
            self.refused.append(
                "the loss is not a plain cross-entropy over 2-d logits (class weights, label "
                "smoothing, reduction 'none' or other targets)"
            )
            return None
        why = _dtypes_refused(lin.dtype, loss_dtype)
        if why:
            self.refused.append(why)
            return None
        x = lin.rows()
        n, d = x.shape
        v = lin.weight.shape[0]
        rows = self.head.rows or default_rows(n, d, v)
        if rows >= n:
            self.refused.append(
                f"the loss has {n} rows, which fit in one chunk of {rows}: nothing to chunk "
                "(more tokens, or LossHead('chunked', rows) with fewer rows per chunk)"
            )
            return None
        self.found.append(Head(n, d, v, rows, n * v * lin.dtype.itemsize))
        # the operands in the matmul's dtype: autocast's casts, made where it makes them
        x, weight, bias = (_cast(t, lin.dtype) for t in (x, lin.weight, lin.bias))
        return ChunkedHead.apply(
            x, weight, bias, target, rows, _REDUCTIONS[reduction], ignore_index, loss_dtype
        )

    def _linear_cross_entropy(
        self,
        input: torch.Tensor,
        linear_weight: torch.Tensor,
        target: torch.Tensor,
        *,
        linear_bias: torch.Tensor | None = None,
        weight: torch.Tensor | None = None,
        reduction: str = "mean",
        ignore_index: int | None = None,
        label_smoothing: float = 0.0,
        options: Any = None,
    ) -> torch.Tensor:
        """`F.linear_cross_entropy` as traceable ops: chunked where the head is, else its
        reference path (`options=None`), never the opaque chunked custom op."""
        if self.head.kind != "plain" and input.dim() == 2:
            # its reference path, linear then cross-entropy, as this mode sees them
            logits = self.__torch_function__(F.linear, (), (input, linear_weight, linear_bias))
            ii = -100 if ignore_index is None else ignore_index
            kw: dict[str, Any] = {"weight": weight, "reduction": reduction}
            kw.update(ignore_index=ii, label_smoothing=label_smoothing)
            return self.__torch_function__(F.cross_entropy, (), (logits, target), kw)
        return F.linear_cross_entropy(
            input,
            linear_weight,
            target,
            linear_bias=linear_bias,
            weight=weight,
            reduction=reduction,
            ignore_index=ignore_index,
            label_smoothing=label_smoothing,
            options=None,
        )


def _dtypes_refused(head: torch.dtype, loss: torch.dtype) -> str:
    """Why a head whose matmul runs in `head` and whose cross-entropy in `loss` is left plain
    ('' where the chunked head keeps the contract for them)."""
    if head == loss and head in (torch.float32, torch.float64):
        return ""
    if head == _ROUNDED and loss == torch.float32:
        return ""
    if head == loss:
        return (
            f"the loss runs in {_name(loss)}: each chunk's partial loss would round to "
            f"{_name(loss)}; upcast the logits before the loss (logits.float(), as Hugging "
            "Face's loss does)"
        )
    return (
        f"the head's matmul runs in {_name(head)} and its loss in {_name(loss)}; the chunked "
        "head keeps float32 throughout, or a bfloat16 head with a float32 loss"
    )


def _cast(t: Any, dtype: torch.dtype) -> Any:
    """`t` in `dtype` (None stays None)."""
    return t if t is None or t.dtype == dtype else t.to(dtype)


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


@contextlib.contextmanager
def chunked_head(head: LossHead = LossHead("chunked")) -> Iterator[LossHeadMode]:
    """Run eager code with its LM-head losses as `head` says: the eager twin of a step
    analysed with `core.analyze(..., loss_head="chunked")`, for comparing numbers."""
    with LossHeadMode(head) as mode:
        yield mode
