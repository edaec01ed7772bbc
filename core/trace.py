"""Capture the joint forward+backward graph of one training step at ATen level.

The step is `outputs = model(*inputs)` followed by `autograd.grad(outputs, params, tangents)`,
traced with `make_fx` under fake tensors: no real compute, no real memory, so a model larger
than this machine can still be analysed. The graph mirrors eager PyTorch op for op (in-place
`bernoulli_` dropout masks, in-place batch-norm running statistics), which is what makes the
simulated peak equal the eager peak.

Capture's private PyTorch APIs (fake tensors, op schemas, pytree internals) live here. Three
other modules use private APIs too, each for one purpose: `core.interpret` (the generated
`torch._C` bindings it calls ops through, `TorchDispatchMode`), `core.memory`
(`TorchDispatchMode`, pytree, storage `_cdata` ids) and `core.runtime` (autograd's
keep-graph flag). A torch upgrade should touch these four files and no other.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import logging
import operator
import os
import re
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx.traceback as fx_traceback
import torch.utils._pytree as pytree
from torch import nn
from torch._functorch._aot_autograd.logging_utils import (
    setup_stacktrace_preservation_hooks_from_tensors,
)
from torch._subclasses.fake_tensor import (
    DataDependentOutputException,
    DynamicOutputShapeException,
    FakeTensorMode,
    UnsupportedOperatorException,
)
from torch.func import functional_call
from torch.fx.experimental.proxy_tensor import make_fx

from core.errors import UnsupportedModel

ROLES = ("param", "state", "input", "tangent", "constant", "op")


@dataclass(frozen=True)
class Ref:
    """A reference to another node's result inside an op's arguments."""

    index: int


@dataclass(frozen=True)
class TensorSpec:
    """Shape and dtype of one tensor: what the fingerprint and error messages compare."""

    shape: tuple[int, ...]
    dtype: str

    @staticmethod
    def of(t: torch.Tensor) -> TensorSpec:
        return TensorSpec(tuple(int(s) for s in t.shape), str(t.dtype).removeprefix("torch."))

    def __str__(self) -> str:
        return f"{self.dtype}{list(self.shape)}"


@dataclass
class AtenNode:
    """One node of the traced graph: a placeholder (role param/state/input/tangent) or an op."""

    index: int
    name: str
    role: str
    target: Any = None  # the ATen OpOverload, or operator.getitem
    args: tuple = ()
    kwargs: dict = field(default_factory=dict)
    reads: tuple[int, ...] = ()  # nodes whose results this node reads
    specs: tuple[TensorSpec, ...] = ()  # tensors it returns
    storages: tuple[int, ...] = ()  # storage of each returned tensor (aliases share one)
    strides: tuple[tuple[int, ...], ...] = ()  # stride of each returned tensor
    writes: tuple[int, ...] = ()  # nodes it mutates in place
    random: bool = False  # draws from the random generator
    module: str | None = None  # module path that ran it (forward ops only)
    source: str | None = None  # the model's Python line that made it: "file.py:12 in forward: ..."
    seq_nr: int = -1  # autograd sequence number: a backward node shares its forward op's

    @property
    def label(self) -> str:
        """Short op name for people: 'aten.mm', 'getitem', or the placeholder role."""
        if self.target is None:
            return self.role
        if self.target is operator.getitem:
            return "getitem"
        return f"aten.{self.target._opname}"


@dataclass
class Trace:
    """The captured step: nodes in execution order and how they map to the model."""

    nodes: list[AtenNode]
    storage_bytes: dict[int, int]
    param_names: list[str]  # trainable parameters, in placeholder order
    param_specs: list[TensorSpec]
    state_names: list[str]  # buffers and frozen parameters
    input_specs: list[TensorSpec]
    grad_inputs: list[int]  # positions of inputs that require grad
    outputs: list[int]  # node of each flattened model output
    output_spec: Any  # pytree spec rebuilding the model's output structure
    diff_outputs: list[int]  # positions in `outputs` that receive a tangent
    tangents: list[int]  # tangent placeholder for each of diff_outputs
    grads: list[int | None]  # gradient node per param, then per grad input (None: unused)
    call: CallSpec  # how the model is called: what the planned module checks
    # tensors the model creates from Python data (`torch.tensor(0)`, a scalar written into a
    # slice): make_fx lifts them into constants; node -> its value, on the traced device
    constants: dict[int, torch.Tensor] = field(default_factory=dict)


def graph_meta(trace: Trace) -> dict[str, Any]:
    """What a plan file records about its graph, to say what differs on a mismatch."""
    return {
        "params": [[n, str(s)] for n, s in zip(trace.param_names, trace.param_specs)],
        "state": list(trace.state_names),
        "inputs": [
            [list(s.shape), s.dtype, i in trace.grad_inputs]
            for i, s in enumerate(trace.input_specs)
        ],
        "n_nodes": len(trace.nodes),
        "call": trace.call.to_data(),
    }


def fingerprint(trace: Trace) -> str:
    """Hash of the ops, shapes, dtypes, parameter names and shapes of a traced step. How the
    inputs are passed (the "call") is left out: the planned module checks it on every call,
    and plans made before keyword inputs keep their fingerprint."""
    h = hashlib.sha256()
    h.update(repr({k: v for k, v in graph_meta(trace).items() if k != "call"}).encode())
    for n in trace.nodes:
        h.update(repr((n.role, n.label, str(n.target), n.args, n.kwargs, n.specs)).encode())
    return h.hexdigest()[:32]


def describe_difference(trace: Trace, meta: dict[str, Any]) -> str:
    """Say what differs between this trace and the `graph_meta` a plan was made for."""
    mine = graph_meta(trace)
    for key, what in (
        ("params", "parameters"),
        ("inputs", "input shapes or dtypes"),
        ("state", "buffers"),
    ):
        if key in meta and meta[key] != mine[key]:
            return f"{what} differ: plan has {_first_difference(meta[key], mine[key])}"
    if meta.get("n_nodes") not in (None, mine["n_nodes"]):
        return f"the traced graph has {mine['n_nodes']} ATen ops, the plan's had {meta['n_nodes']}"
    return "the traced operations differ (same shapes, different model code)"


def _first_difference(theirs: list, mine: list) -> str:
    for i, (a, b) in enumerate(zip(theirs, mine)):
        if a != b:
            return f"{a} where the model has {b} (entry {i})"
    return f"{len(theirs)} entries where the model has {len(mine)}"


@dataclass(frozen=True)
class CallSpec:
    """How a step calls the model: the structure of (args, kwargs), the non-tensor values in
    it (bound when traced, checked on every call), how many targets follow for `loss_fn`."""

    tree: Any  # pytree spec of (args, kwargs)
    constants: tuple[tuple[int, Any], ...]  # (leaf position, value) of non-tensor leaves
    n_targets: int = 0
    loss: bool = False  # a loss_fn(output, *targets) follows the model

    def to_data(self) -> dict[str, Any]:
        """Plain data for a plan file; `tree` is None when the call holds values a plan file
        cannot carry (custom containers, non-plain constants)."""
        try:
            tree = pytree.treespec_dumps(self.tree)
        except Exception:  # noqa: BLE001 - a custom container pytree cannot serialise
            tree = None
        if not all(isinstance(v, (type(None), bool, int, float, str)) for _, v in self.constants):
            tree = None
        constants = [[i, v] for i, v in self.constants] if tree is not None else []
        return {"tree": tree, "constants": constants, "targets": self.n_targets, "loss": self.loss}

    def describe(self) -> str:
        """'with 1 positional arguments and keywords ['attention_mask']': for error messages."""
        args, kwargs = pytree.tree_unflatten([None] * self.tree.num_leaves, self.tree)
        out = f"with {len(args)} positional arguments and keywords {sorted(kwargs)}"
        return out + (f" and {self.n_targets} targets" if self.loss else "")

    def leaf_name(self, leaf: int) -> str:
        """The argument a leaf is: 'use_cache', '#2' (position), or 'leaf 5' (nested)."""
        args, kwargs = pytree.tree_unflatten(list(range(self.tree.num_leaves)), self.tree)
        names = {v: repr(k) for k, v in kwargs.items() if isinstance(v, int)}
        names |= {v: f"#{p}" for p, v in enumerate(args) if isinstance(v, int)}
        return names.get(leaf, f"leaf {leaf}")

    @staticmethod
    def from_data(data: dict[str, Any]) -> CallSpec:
        tree = pytree.treespec_loads(data["tree"])
        constants = tuple((int(i), v) for i, v in data["constants"])
        return CallSpec(tree, constants, int(data["targets"]), bool(data["loss"]))


def split_call(
    args: Sequence[Any], kwargs: dict[str, Any] | None, targets: Sequence[Any] = (), loss=False
) -> tuple[list[Any], CallSpec]:
    """The tensors of a call, in order (targets last), and what rebuilds the call from them."""
    leaves, tree = pytree.tree_flatten((tuple(args), dict(kwargs or {})))
    tensors = [x for x in leaves if isinstance(x, torch.Tensor)]
    constants = tuple((i, x) for i, x in enumerate(leaves) if not isinstance(x, torch.Tensor))
    return tensors + list(targets), CallSpec(tree, constants, len(targets), loss)


def join_call(tensors: Sequence[Any], call: CallSpec) -> tuple[tuple, dict, tuple]:
    """(args, kwargs, targets) from the tensors `split_call` gave."""
    n = len(tensors) - call.n_targets
    fixed = dict(call.constants)
    it = iter(tensors[:n])
    leaves = [fixed[i] if i in fixed else next(it) for i in range(call.tree.num_leaves)]
    args, kwargs = pytree.tree_unflatten(leaves, call.tree)
    return args, kwargs, tuple(tensors[n:])


def capture(
    model: nn.Module,
    args: Sequence[Any],
    kwargs: dict[str, Any] | None = None,
    loss_fn: Callable[..., torch.Tensor] | None = None,
    targets: Sequence[torch.Tensor] = (),
) -> Trace:
    """Trace one forward+backward of `model(*args, **kwargs)` (then `loss_fn(output,
    *targets)` when given) on inputs shaped like these. Non-tensor arguments are bound as
    they are."""
    with _tensors_restored(model):
        return _capture(model, args, kwargs, loss_fn, targets)


@contextlib.contextmanager
def _tensors_restored(model: nn.Module) -> Iterator[None]:
    """Put every parameter and buffer back afterwards: `functional_call` leaves its fake
    substitutes in a submodule registered under two names (a Siamese network's shared tower:
    `self.tower_b = self.tower_a`), and the model would then run on fake tensors."""
    saved = [
        (m, n, t)
        for m in model.modules()
        for n, t in [*m.named_parameters(recurse=False), *m.named_buffers(recurse=False)]
    ]
    try:
        yield
    finally:
        for m, n, t in saved:
            setattr(m, n, t)


def _capture(
    model: nn.Module,
    args: Sequence[Any],
    kwargs: dict[str, Any] | None,
    loss_fn: Callable[..., torch.Tensor] | None,
    targets: Sequence[torch.Tensor],
) -> Trace:
    inputs, call = split_call(args, kwargs, targets, loss_fn is not None)
    for i, x in enumerate(inputs[len(inputs) - call.n_targets :]):
        if not isinstance(x, torch.Tensor):
            raise UnsupportedModel(f"target {i} of type {type(x).__name__}", "", "pass tensors")
    named = list(model.named_parameters())
    params = [(n, p) for n, p in named if p.requires_grad]
    state = [(n, p) for n, p in named if not p.requires_grad] + list(model.named_buffers())
    grad_inputs = [i for i, x in enumerate(inputs) if x.requires_grad]

    fake_mode = FakeTensorMode(allow_non_fake_inputs=True)
    with fake_mode:
        fparams = [_fake(fake_mode, p) for _, p in params]
        fstate = [_fake(fake_mode, b) for _, b in state]
        finputs = _distinct([_fake(fake_mode, x) for x in inputs])

    def forward(ps, ss, xs):
        names = [n for n, _ in params] + [n for n, _ in state]
        tensors = dict(zip(names, [*ps, *ss], strict=True))
        args, kwargs, targets = join_call(xs, call)
        out = functional_call(model, tensors, args, kwargs)
        return out if loss_fn is None else _loss(loss_fn, out, targets)

    with _ModuleScope(model) as scope, fake_mode:
        out = _guard(scope, lambda: forward(fparams, fstate, finputs))
        leaves, out_spec = _flatten_output(out, scope)
        diff = [i for i, t in enumerate(leaves) if t.requires_grad]
        ftangents = [torch.empty_like(leaves[i]) for i in diff]

    n_p, n_s, n_i = len(params), len(state), len(inputs)

    def step(*flat):
        ps, ss = flat[:n_p], flat[n_p : n_p + n_s]
        xs, ts = flat[n_p + n_s : n_p + n_s + n_i], flat[n_p + n_s + n_i :]
        leaves, _ = pytree.tree_flatten(forward(ps, ss, xs))
        # tag each backward node with the sequence number of the forward op it differentiates
        setup_stacktrace_preservation_hooks_from_tensors([leaves[i] for i in diff])
        wrt = list(ps) + [xs[i] for i in grad_inputs]
        grads = torch.autograd.grad([leaves[i] for i in diff], wrt, ts, allow_unused=True)
        return list(leaves), list(grads)

    with _ModuleScope(model) as scope, fake_mode:
        gm = _guard(
            scope,
            lambda: make_fx(step, record_stack_traces=True)(
                *fparams, *fstate, *finputs, *ftangents
            ),
        )
        _functionalize_late_writes(gm.graph)

    roles = ["param"] * n_p + ["state"] * n_s + ["input"] * n_i + ["tangent"] * len(diff)
    nodes, storage_bytes, out_nodes, grad_nodes, constants = _convert(gm, roles)
    return Trace(
        nodes=nodes,
        storage_bytes=storage_bytes,
        param_names=[n for n, _ in params],
        param_specs=[TensorSpec.of(p) for _, p in params],
        state_names=[n for n, _ in state],
        input_specs=[TensorSpec.of(x) for x in inputs],
        grad_inputs=grad_inputs,
        outputs=out_nodes,
        output_spec=out_spec,
        diff_outputs=diff,
        tangents=[i for i, n in enumerate(nodes) if n.role == "tangent"],
        grads=grad_nodes,
        constants=constants,
        call=call,
    )


def _loss(loss_fn: Callable[..., Any], out: Any, targets: tuple) -> torch.Tensor:
    loss = loss_fn(out, *targets)
    if not isinstance(loss, torch.Tensor) or loss.dim() != 0:
        raise UnsupportedModel(
            f"a loss_fn returning {type(loss).__name__}"
            + (f" of shape {list(loss.shape)}" if isinstance(loss, torch.Tensor) else ""),
            "",
            "loss_fn(output, *targets) must return a scalar tensor (reduce it with .mean())",
        )
    return loss


def unflatten_output(leaves: list[Any], spec: Any) -> Any:
    """Rebuild the model's output structure (tuple, dict, dataclass...) from flat leaves."""
    return pytree.tree_unflatten(leaves, spec)


def fast_callable(target: Any) -> Any:
    """The C++ callable behind an ATen OpOverload (skips one Python frame per call)."""
    return getattr(target, "_op", target)


def aliases_schema_write(target: Any) -> list[tuple[int, str]]:
    """(position, name) of every argument an op writes in place, from its schema."""
    schema = getattr(target, "_schema", None)
    if schema is None:
        return []
    return [
        (i, a.name)
        for i, a in enumerate(schema.arguments)
        if a.alias_info is not None and a.alias_info.is_write
    ]


# --- internals ---------------------------------------------------------------------------


def _distinct(fakes: list[torch.Tensor]) -> list[torch.Tensor]:
    """One fake tensor per input position. A tensor passed twice (`targets=(input_ids,)`, as
    causal language models are trained) is one fake object, which the trace would record as
    one placeholder: every use would read the last position, and a later call passing two
    different tensors would feed the labels to the embedding. Call under the fake mode."""
    seen: set[int] = set()
    out = []
    for f in fakes:
        if id(f) in seen:
            twin = f
            f = torch.empty_strided(f.shape, f.stride(), dtype=f.dtype, device=f.device)
            f.requires_grad_(twin.requires_grad)
        seen.add(id(f))
        out.append(f)
    return out


def _fake(mode: FakeTensorMode, t: torch.Tensor) -> torch.Tensor:
    f = mode.from_tensor(t, static_shapes=True)
    if t.requires_grad and f.is_leaf and not f.requires_grad:
        f.requires_grad_(True)
    return f


def _flatten_output(out: Any, scope: _ModuleScope) -> tuple[list[torch.Tensor], Any]:
    _register_dataclasses(out)
    leaves, spec = pytree.tree_flatten(out)
    for leaf in leaves:
        if not isinstance(leaf, torch.Tensor):
            raise UnsupportedModel(
                f"an output of type {type(leaf).__name__}",
                "",
                "the model must return tensors (alone, or in a tuple, list, dict or dataclass): "
                "turn that output off (Hugging Face: use_cache=False) or give analyze a "
                "loss_fn, whose scalar is then the step's only output",
            )
    if not leaves:
        raise UnsupportedModel("a model with no tensor output", "", "return the loss or logits")
    return leaves, spec


def _register_dataclasses(out: Any) -> None:
    """Let pytree see inside dataclass outputs (as Hugging Face's ModelOutput does)."""
    if dataclasses.is_dataclass(out) and not isinstance(out, type):
        cls = type(out)
        if cls not in pytree.SUPPORTED_NODES:
            pytree.register_dataclass(cls)
        for f in dataclasses.fields(out):
            _register_dataclasses(getattr(out, f.name))
    elif isinstance(out, (list, tuple)):
        for x in out:
            _register_dataclasses(x)
    elif isinstance(out, dict):
        for x in out.values():
            _register_dataclasses(x)


class _ModuleScope:
    """Tracks which submodule is running: trace failures name it, and every traced forward
    node records it in `node.meta["custom"]["module"]` (blocks are cut at module boundaries)."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self.stack: list[str] = []
        self.tags: list[Any] = []
        self.handles: list[Any] = []

    def __enter__(self) -> _ModuleScope:
        for name, mod in self.model.named_modules():
            self.handles.append(mod.register_forward_pre_hook(self._push(name)))
            self.handles.append(mod.register_forward_hook(self._pop))
        self.meta = fx_traceback.preserve_node_meta()
        self.meta.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        while self.tags:
            self.tags.pop().__exit__(None, None, None)
        self.meta.__exit__(None, None, None)
        for h in self.handles:
            h.remove()

    def _push(self, name: str):
        def hook(mod, args):
            self.stack.append(name)
            tag = fx_traceback.annotate({"module": name})
            tag.__enter__()
            self.tags.append(tag)

        return hook

    def _pop(self, mod, args, out) -> None:
        if self.stack:
            self.stack.pop()
            self.tags.pop().__exit__(None, None, None)

    @property
    def where(self) -> str:
        if not self.stack:
            return ""
        name = self.stack[-1]
        mod = self.model.get_submodule(name)
        return f"{name} ({type(mod).__name__})" if name else f"{type(mod).__name__} (the root)"


def _guard(scope: _ModuleScope, fn):
    """Run `fn`, turning tracing failures into UnsupportedModel naming op and module (fake
    tensors' own log of a failing shape function is silenced: the error says it)."""
    log = logging.getLogger("torch._subclasses.fake_tensor")
    level = log.level
    log.setLevel(logging.CRITICAL)
    try:
        return fn()
    except UnsupportedModel:
        raise
    except DataDependentOutputException as e:
        raise UnsupportedModel(
            f"data-dependent control flow (op {e.func})",
            scope.where,
            "the graph must not depend on tensor values: replace .item(), bool(tensor) or "
            "`if tensor:` with tensor ops such as torch.where",
        ) from None
    except DynamicOutputShapeException as e:
        raise UnsupportedModel(
            f"an op whose output shape depends on the data ({e.func})",
            scope.where,
            "use fixed-shape ops (masking with torch.where instead of boolean indexing)",
        ) from None
    except UnsupportedOperatorException as e:
        raise UnsupportedModel(
            f"the op {e.func}", scope.where, "it has no fake-tensor implementation"
        ) from None
    except Exception as e:  # noqa: BLE001 - anything the model raises while tracing
        text = str(e).strip().splitlines()[0] if str(e).strip() else ""
        if _raised_in_checkpoint(e):
            raise UnsupportedModel(
                "torch.utils.checkpoint (reentrant) inside the forward pass",
                scope.where,
                "remove the inner checkpoint: the plan decides what to keep and what to "
                "recompute for the whole step and replaces it",
            ) from None
        if "data-dependent" in str(e) or "data dependent" in str(e):
            raise UnsupportedModel(
                "data-dependent control flow",
                scope.where,
                "the graph must not depend on tensor values: replace .item(), bool(tensor) or "
                "`if tensor:` with tensor ops such as torch.where",
            ) from None
        raise UnsupportedModel(
            f"the forward pass ({type(e).__name__}: {text[:300]})",
            scope.where,
            "check that the example inputs match what the model expects; if they do, an op "
            "there may lack a shape (meta) implementation for them in this torch: use another "
            "implementation of that module (e.g. transformers' experts_implementation="
            "'batched_mm' instead of grouped_mm on CPU)",
        ) from None
    finally:
        log.setLevel(level)


def _raised_in_checkpoint(e: BaseException) -> bool:
    """Whether `e` came from inside torch.utils.checkpoint, whose reentrant form fails under
    the fake tensors of the trace."""
    tb = e.__traceback__
    while tb is not None:
        if tb.tb_frame.f_code.co_filename.endswith(("utils/checkpoint.py", "utils\\checkpoint.py")):
            return True
        tb = tb.tb_next
    return False


def _convert(
    gm: torch.fx.GraphModule, roles: list[str]
) -> tuple[list[AtenNode], dict[int, int], list[int], list[int | None], dict[int, torch.Tensor]]:
    """fx graph -> AtenNodes with storages numbered 0..S-1 and their sizes in bytes, and the
    values of lifted constants (get_attr nodes)."""
    graph = gm.graph
    constants: dict[int, torch.Tensor] = {}
    index: dict[torch.fx.Node, int] = {}
    storage_id: dict[int, int] = {}
    storage_bytes: dict[int, int] = {}
    nodes: list[AtenNode] = []
    out_nodes: list[int] = []
    grad_nodes: list[int | None] = []

    def tensors_of(val: Any) -> list[torch.Tensor]:
        if isinstance(val, torch.Tensor):
            return [val]
        if isinstance(val, (list, tuple)):
            return [t for t in val if isinstance(t, torch.Tensor)]
        return []

    placeholders = 0
    for fx_node in graph.nodes:
        if fx_node.op == "output":
            leaves, grads = fx_node.args[0]
            out_nodes = [index[n] for n in leaves]
            grad_nodes = [index[g] if isinstance(g, torch.fx.Node) else None for g in grads]
            continue
        tensors = tensors_of(fx_node.meta.get("val"))
        storages = []
        for t in tensors:
            s = t.untyped_storage()
            sid = storage_id.setdefault(s._cdata, len(storage_id))
            storage_bytes[sid] = int(s.nbytes())
            storages.append(sid)
        i = len(nodes)
        index[fx_node] = i
        node = AtenNode(
            index=i,
            name=fx_node.name,
            role="op",
            specs=tuple(TensorSpec.of(t) for t in tensors),
            storages=tuple(storages),
            strides=tuple(tuple(int(x) for x in t.stride()) for t in tensors),
        )
        if fx_node.op == "placeholder":
            node.role = roles[placeholders]
            placeholders += 1
        elif fx_node.op == "get_attr":
            value = getattr(gm, fx_node.target)
            node.role = "constant"
            constants[i] = value.detach().to(tensors[0].device) if tensors else value.detach()
        elif fx_node.op == "call_function":
            node.target = fx_node.target
            node.args = torch.fx.node.map_arg(fx_node.args, lambda n: Ref(index[n]))
            node.kwargs = dict(torch.fx.node.map_arg(fx_node.kwargs, lambda n: Ref(index[n])))
            node.reads = tuple(index[n] for n in fx_node.all_input_nodes)
            node.writes = _written_args(fx_node, index)
            tags = getattr(fx_node.target, "tags", ())
            node.random = torch.Tag.nondeterministic_seeded in tags
            node.module = (fx_node.meta.get("custom") or {}).get("module")
            node.seq_nr = int(fx_node.meta.get("seq_nr", -1))
            node.source = user_frame(fx_node.meta.get("stack_trace"))
        else:
            raise UnsupportedModel(f"an fx node of kind {fx_node.op}", "", "")
        nodes.append(node)
    return nodes, storage_bytes, out_nodes, grad_nodes, constants


def _storages_of(node: torch.fx.Node) -> set[int]:
    val = node.meta.get("val")
    vals = val if isinstance(val, (list, tuple)) else [val]
    return {t.untyped_storage()._cdata for t in vals if isinstance(t, torch.Tensor)}


def _functionalize_late_writes(graph: torch.fx.Graph) -> None:
    """An in-place op on a tensor another op already read (a router's `w /= w.sum()`, a mask
    compared and then written) becomes its out-of-place form, and every later reader of the
    tensor reads the new result. Values are eager's; the graph's ops then own their storages,
    so each can run and be recomputed as a unit. Runs under the trace's fake mode."""
    fixed = {s for n in graph.nodes if n.op in ("placeholder", "get_attr") for s in _storages_of(n)}
    read: set[int] = set()  # storages an op read without aliasing or writing them
    latest: dict[torch.fx.Node, torch.fx.Node] = {}  # written tensor -> its new version
    retired: set[int] = set()  # storages replaced by a new version
    for node in list(graph.nodes):
        if node.op != "call_function":
            continue
        for old in node.all_input_nodes:
            if old in latest:
                node.replace_input_with(old, latest[old])
        stale = [a for a in node.all_input_nodes if _storages_of(a) & retired]
        if stale:
            raise UnsupportedModel(
                f"a view of a tensor ({stale[0].name}) read after an in-place op changed it",
                _module_path(node),
                "use out-of-place ops (x = x / y instead of x /= y)",
            )
        if _storages_of(node) & retired:  # a view of the new version: its storage is the new one
            args = torch.fx.node.map_arg((node.args, node.kwargs), lambda n: n.meta.get("val"))
            node.meta["val"] = node.target(*args[0], **args[1])
        writes = aliases_schema_write(node.target)
        mine = _storages_of(node)
        written = [node.args[p] for p, _ in writes if p < len(node.args)]
        late = [
            w for w in written if isinstance(w, torch.fx.Node) and (_storages_of(w) & read) - fixed
        ]
        for a in node.all_input_nodes:
            if a not in written and not (_storages_of(a) & mine):
                read.update(_storages_of(a))
        if late:
            new = _out_of_place(graph, node, late[0], len(written))
            latest[late[0]] = latest[node] = new
            retired.update(_storages_of(late[0]))


def _out_of_place(
    graph: torch.fx.Graph, node: torch.fx.Node, target: torch.fx.Node, n_written: int
) -> torch.fx.Node:
    op: Any = node.target  # an OpOverload: only those write in place
    schema = op._schema
    packet = getattr(torch.ops.aten, schema.name.split("::")[-1].rstrip("_"), None)
    overload = getattr(packet, op._overloadname, None) if packet else None
    before = target.meta.get("val")
    if overload is None or n_written != 1 or before is None:
        raise UnsupportedModel(
            f"the in-place op {node.name} ({schema.name}) on a tensor read before it",
            _module_path(node),
            "use the out-of-place form (x = x / y instead of x /= y)",
        )
    fake = torch.fx.node.map_arg((node.args, node.kwargs), lambda n: n.meta.get("val"))
    after = overload(*fake[0], **fake[1])
    if not isinstance(after, torch.Tensor) or (after.shape, after.dtype) != (
        before.shape,
        before.dtype,
    ):
        raise UnsupportedModel(
            f"the in-place op {node.name} ({schema.name}) on a tensor read before it",
            _module_path(node),
            "use the out-of-place form (x = x / y instead of x /= y)",
        )
    with graph.inserting_after(node):
        new = graph.call_function(overload, node.args, node.kwargs)
    new.meta = {**node.meta, "val": after}
    node.replace_all_uses_with(new, delete_user_cb=lambda user: user is not new)
    graph.erase_node(node)
    return new


def _module_path(node: torch.fx.Node) -> str:
    return (node.meta.get("custom") or {}).get("module") or ""


_TORCH_DIR = os.path.dirname(torch.__file__)


def user_frame(stack_trace: str | None) -> str | None:
    """The innermost frame of `stack_trace` outside torch and this file, as
    "file.py:12 in forward: y = self.lin(x)" (None when there is none)."""
    if not stack_trace:
        return None
    frames = re.findall(r'File "([^"]+)", line (\d+), in (\S+)\n\s*(.*)', stack_trace)
    for path, line, func, code in reversed(frames):
        if not path.startswith(_TORCH_DIR) and path != __file__:
            return f"{os.path.basename(path)}:{line} in {func}: {code.strip()}"
    return None


# Ops whose schema does not declare the running statistics they update in training mode.
_UNDECLARED_WRITES = {
    torch.ops.aten.native_batch_norm.default: ((3, "running_mean"), (4, "running_var")),
    torch.ops.aten.cudnn_batch_norm.default: ((3, "running_mean"), (4, "running_var")),
    torch.ops.aten.miopen_batch_norm.default: ((3, "running_mean"), (4, "running_var")),
}


def undeclared_writes(target: Any, args: Sequence[Any]) -> list[tuple[int, str]]:
    """Arguments an op writes although its schema does not say so: batch-norm's running
    statistics in training mode, which it updates but does not read (passing None computes
    the same outputs without updating anything)."""
    training = len(args) > 5 and args[5] is True
    return list(_UNDECLARED_WRITES.get(target, ())) if training else []


def _written_args(fx_node: torch.fx.Node, index: dict[torch.fx.Node, int]) -> tuple[int, ...]:
    writes = aliases_schema_write(fx_node.target) + undeclared_writes(fx_node.target, fx_node.args)
    written = []
    for pos, name in writes:
        arg = fx_node.args[pos] if pos < len(fx_node.args) else fx_node.kwargs.get(name)
        if isinstance(arg, torch.fx.Node):
            written.append(index[arg])
    return tuple(written)
