"""The private PyTorch APIs the engine relies on, one entry each with where and why.

A torch upgrade may move or remove any of them without notice. `missing()` resolves every
entry against the installed torch; `tests/core/test_private_api.py` fails naming each one
that is gone, and `docs/architecture.md` lists them for a reader. Public but experimental
APIs (`make_fx`, `create_selective_checkpoint_contexts`) are not listed.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass


@dataclass(frozen=True)
class PrivateAPI:
    """A private name: `module` imported, then `attr` (dotted) looked up on it."""

    module: str
    attr: str
    used_in: str
    why: str

    @property
    def name(self) -> str:
        return f"{self.module}.{self.attr}"

    def resolves(self) -> bool:
        """Whether the installed torch still has it."""
        try:
            obj: object = importlib.import_module(self.module)
        except ImportError:
            return False
        for part in self.attr.split("."):
            if not hasattr(obj, part):
                return False
            obj = getattr(obj, part)
        return True


PRIVATE_APIS: tuple[PrivateAPI, ...] = (
    PrivateAPI(
        "torch.utils.checkpoint",
        "_checkpoint_without_reentrant_generator",
        "core/trace/capture.py, core/native/replay.py",
        "swapped for a pass-through while tracing, so a model's own non-reentrant checkpoints "
        "are traced as plain ops; driven directly to replay a native region",
    ),
    PrivateAPI(
        "torch._C",
        "_SetExcludeDispatchKeyGuard",
        "core/native/replay.py",
        "detaches a stretch's cached op outputs beneath autograd, as selective checkpoint's "
        "caching mode does (views keep their version counter)",
    ),
    PrivateAPI(
        "torch._subclasses.fake_tensor",
        "FakeTensorMode",
        "core/trace, core/problem.py, core/strategies.py",
        "every trace runs on fake tensors: no compute, any size, the meta device",
    ),
    PrivateAPI(
        "torch._subclasses.fake_tensor",
        "unset_fake_temporarily",
        "core/trace/capture.py",
        "saves and restores an in-step optimizer's step counts, which constant propagation "
        "advances for real while tracing",
    ),
    PrivateAPI(
        "torch._functorch._aot_autograd.logging_utils",
        "setup_stacktrace_preservation_hooks",
        "core/trace/capture.py",
        "tags each backward node with the forward op it differentiates (its sequence number)",
    ),
    PrivateAPI(
        "torch.utils._python_dispatch",
        "TorchDispatchMode",
        "core/memory.py, core/interpret.py, core/native",
        "sees every ATen op a step runs: the storage tracker, the interpreter's ops, the "
        "native runtime's op matching",
    ),
    PrivateAPI(
        "torch.utils._python_dispatch",
        "_disable_current_modes",
        "core/memory.py",
        "the storage tracker reads storages without dispatching to itself",
    ),
    PrivateAPI(
        "torch.utils._pytree",
        "treespec_dumps",
        "core/trace/call.py, core/plan_io.py",
        "a plan file records how the model was called as plain JSON text",
    ),
    PrivateAPI(
        "torch.utils._pytree",
        "treespec_loads",
        "core/trace/call.py, core/plan_io.py",
        "reads that call back from a plan file",
    ),
    PrivateAPI(
        "torch.utils._pytree",
        "tree_flatten",
        "core/trace, core/runtime",
        "splits a call's arguments and a model's outputs into tensors and structure",
    ),
    PrivateAPI(
        "torch._C._autograd",
        "_get_current_graph_task_keep_graph",
        "core/runtime/interpreter.py",
        "whether backward(retain_graph=True) asked to keep the graph, so the plan frees "
        "nothing the next backward reads",
    ),
    PrivateAPI(
        "torch._C",
        "_VariableFunctions",
        "core/interpret.py",
        "the interpreter calls ATen ops through torch's own bindings, as eager does",
    ),
    PrivateAPI(
        "torch._C",
        "_get_sdp_priority_order",
        "core/trace/attention.py",
        "the order torch tries attention kernels in, to pick the one a device runs",
    ),
    PrivateAPI(
        "torch._meta_registrations",
        "_meta_grouped_mm_common",
        "core/trace/fake_kernels.py",
        "grouped_mm's output sizes on fake tensors (mixture-of-experts models)",
    ),
    PrivateAPI(
        "torch._functorch.partitioners",
        "get_default_op_list",
        "core/strategies.py",
        "torch.compile's compute-intensive ops, which torchtitan's op policy saves",
    ),
    PrivateAPI(
        "torch.distributed._tools.sac_ilp",
        "sac_milp",
        "core/strategies.py",
        "PyTorch's own auto-SAC ILP, imported as a strategy to compare with",
    ),
    PrivateAPI(
        "torch.distributed._tools.sac_estimator",
        "SACEstimator",
        "core/strategies.py",
        "auto-SAC's per-module statistics",
    ),
    PrivateAPI(
        "torch.distributed._tools.mem_tracker",
        "MemTracker",
        "core/strategies.py",
        "auto-SAC's per-module memory",
    ),
)


def missing() -> list[PrivateAPI]:
    """The entries the installed torch no longer has."""
    return [api for api in PRIVATE_APIS if not api.resolves()]
