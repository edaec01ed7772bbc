"""`parallelize`: a layout applied with PyTorch's own mechanisms, no collectives of ours.

Tensor parallelism: `parallelize_module` with `ColwiseParallel` on each pair's column layers
and `RowwiseParallel` on its row layer (DTensor shards the weights and inserts the
all-reduces). Data parallelism over dp ranks: FSDP2's `fully_shard` on every layer of a
repeated kind, then on the root; or `DistributedDataParallel` for a replicated layout.

The rank's remat plan, when it recomputes anything, runs through the native runtime
(checkpoint with a selective policy on the layers). With tp 1 it is bound to the model by
`core.apply_plan` before any sharding. With tp > 1 the plan was made on one rank's replica
(local shards), so it is installed after `parallelize_module`: the model's parameters, as
local shards, must be the plan's; the policy sees DTensor-level ops, the same ATen ops in
the same order as the replica's trace, with the same local sizes; the layout's own hooks
(from_local, redistribute, to_local) run under `untraced_ops`, recomputed and not counted.
"""

from __future__ import annotations

from typing import Any

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    RowwiseParallel,
    parallelize_module,
)
from torch.nn.parallel import DistributedDataParallel

from core.errors import PlanMismatch
from core.native.runtime import apply_native, untraced_ops
from core.parallel.measure import local
from core.parallel.search import Layout, ParallelError, ParallelPlan
from core.plan import Plan
from core.runtime.module import apply_plan
from core.trace import TensorSpec
from core.validate import check_program


def _untraced(style: type[Any]) -> type[Any]:
    """`style` (ColwiseParallel or RowwiseParallel) whose module hooks' ops run under
    `untraced_ops`: none of them is an op of the rank's trace."""

    class Untraced(style):
        @staticmethod
        def _prepare_input_fn(
            layouts: Any, desired: Any, mod: nn.Module, inputs: Any, device_mesh: DeviceMesh
        ) -> Any:
            # distribute_module counts these parameters: keep them named, not *args
            with untraced_ops():
                return style._prepare_input_fn(layouts, desired, mod, inputs, device_mesh)

        @staticmethod
        def _prepare_output_fn(
            layouts: Any, use_local: bool, mod: nn.Module, outputs: Any, device_mesh: DeviceMesh
        ) -> Any:
            with untraced_ops():
                return style._prepare_output_fn(layouts, use_local, mod, outputs, device_mesh)

    Untraced.__name__ = Untraced.__qualname__ = f"Untraced{style.__name__}"
    return Untraced


_Colwise = _untraced(ColwiseParallel)
_Rowwise = _untraced(RowwiseParallel)


def parallelize(
    model: nn.Module,
    parallel_plan: ParallelPlan | Layout,
    mesh: DeviceMesh,
    remat: bool = True,
) -> nn.Module:
    """Apply a layout (a ParallelPlan's best, or any Layout) to `model` on `mesh`: one
    dimension of dp * tp ranks when either is 1, else two named ("dp", "tp"). Returns the
    module to call: the model itself, or the native runtime's step (a plan with a loss_fn),
    or their DDP wrapper. remat: also install the rank's
    remat plan (native runtime) when it recomputes anything."""
    layout = parallel_plan.best if isinstance(parallel_plan, ParallelPlan) else parallel_plan
    if layout is None:
        raise ParallelError("the parallel plan found no layout that fits: nothing to apply")
    plan = layout.plan if remat and layout.plan and layout.plan.recomputed_ops > 0 else None
    dp_mesh, tp_mesh = _meshes(mesh, layout)
    step = model
    if plan is not None and tp_mesh is None:
        step = apply_plan(model, plan, runtime="native")
    if tp_mesh is not None:
        styles: dict[str, ParallelStyle] = {}
        for pair in layout.pairs:
            styles.update({c: _Colwise() for c in pair.columns})
            styles[pair.row] = _Rowwise()
        parallelize_module(model, tp_mesh, styles)
        if plan is not None:
            step = _apply_rank_plan(model, plan)
    if dp_mesh is None:
        return step
    if layout.data == "ddp":
        return DistributedDataParallel(step, process_group=dp_mesh.get_group())
    for unit in _units(model, layout):
        fully_shard(unit, mesh=dp_mesh)
    fully_shard(model, mesh=dp_mesh)
    return step


def _apply_rank_plan(model: nn.Module, plan: Plan) -> nn.Module:
    """`plan`, made on one rank's replica, installed natively on the tensor-parallel model:
    its parameters' local shards must be the replica's (names, shapes, dtypes); the ops are
    checked as they run (the policy's PlanMismatch)."""
    problem = plan.problem
    params = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    mine = [[n, str(TensorSpec.of(local(p)))] for n, p in params]
    theirs = [list(p) for p in plan.graph_meta.params]
    for (n, a), (m, b) in zip(mine, theirs):
        if (n, a) != (m, b):
            raise PlanMismatch(
                f"parameter {n} holds {a} on this rank, the rank plan has {m} {b}: apply the "
                "layout to the model it was planned for, before any other sharding"
            )
    if len(mine) != len(theirs):
        raise PlanMismatch(
            f"the model has {len(mine)} parameters, the rank plan {len(theirs)}: apply the "
            "layout to the model it was planned for"
        )
    check_program(plan, problem)
    return apply_native(model, plan, problem.loss_fn, problem.graph.trace.call.loss)


def _meshes(mesh: DeviceMesh, layout: Layout) -> tuple[DeviceMesh | None, DeviceMesh | None]:
    """(dp mesh, tp mesh) of `mesh` for the layout; None where that degree is 1."""
    if mesh.size() != layout.dp * layout.tp:
        raise ParallelError(
            f"the mesh has {mesh.size()} ranks, the layout {layout.name} needs "
            f"{layout.dp * layout.tp}: build it with init_device_mesh(device, "
            f"({layout.dp}, {layout.tp}), mesh_dim_names=('dp', 'tp'))"
        )
    if layout.dp > 1 and layout.tp > 1:
        names = mesh.mesh_dim_names or ()
        if mesh.ndim != 2 or set(names) != {"dp", "tp"}:
            raise ParallelError(
                f"{layout.name} needs a 2-D mesh named ('dp', 'tp'), not {mesh.ndim}-D "
                f"{names}: init_device_mesh(device, ({layout.dp}, {layout.tp}), "
                "mesh_dim_names=('dp', 'tp'))"
            )
        return mesh["dp"], mesh["tp"]
    if mesh.ndim == 2:
        mesh = mesh["dp"] if layout.dp > 1 else mesh["tp"]
    return (mesh, None) if layout.dp > 1 else (None, mesh if layout.tp > 1 else None)


def _units(model: nn.Module, layout: Layout) -> list[nn.Module]:
    """FSDP's units: the submodules that run the blocks of a repeated kind (the layers)."""
    modules = dict(model.named_modules())
    missing = [u for u in layout.units if u not in modules]
    if missing:
        raise ParallelError(f"the model has no module {missing[0]!r}: plan this very model")
    return [modules[u] for u in layout.units]
