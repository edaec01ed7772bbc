"""`parallelize`: a layout applied with PyTorch's own mechanisms, no collectives of ours.

Tensor parallelism: `parallelize_module` with `ColwiseParallel` on each pair's column layers
and `RowwiseParallel` on its row layer (DTensor shards the weights and inserts the
all-reduces). Data parallelism over dp ranks: FSDP2's `fully_shard` on every layer of a
repeated kind, then on the root; or `DistributedDataParallel` for a replicated layout.
The rank's remat plan: `core.apply_plan(model, plan, runtime="native")` on the model before it
is sharded, when the plan recomputes anything and was made for this model's shapes (tp 1);
with tp > 1 the rank's plan was made on the sharded replica's trace, which the full-width
model does not match, and the native runtime does not yet bind a plan to a tensor-parallel
model: RematError says so (docs/parallel.md).
"""

from __future__ import annotations

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

from core.parallel.search import Layout, ParallelError, ParallelPlan
from core.runtime import apply_plan


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
    recomputes = remat and layout.plan is not None and layout.plan.recomputed_ops > 0
    if recomputes and layout.tp > 1:
        raise ParallelError(
            f"the rank's remat plan of {layout.name} recomputes ops on a tensor-parallel "
            "model, which the native runtime does not bind yet: pass remat=False (its peak "
            "is then the store-all one), plan with more memory, or use tp=1"
        )
    dp_mesh, tp_mesh = _meshes(mesh, layout)
    step = model
    if recomputes and layout.plan is not None:
        step = apply_plan(model, layout.plan, runtime="native")
    if tp_mesh is not None:
        styles: dict[str, ParallelStyle] = {}
        for pair in layout.pairs:
            styles.update({c: ColwiseParallel() for c in pair.columns})
            styles[pair.row] = RowwiseParallel()
        parallelize_module(model, tp_mesh, styles)
    if dp_mesh is None:
        return step
    if layout.data == "ddp":
        return DistributedDataParallel(step, process_group=dp_mesh.get_group())
    for unit in _units(model, layout):
        fully_shard(unit, mesh=dp_mesh)
    fully_shard(model, mesh=dp_mesh)
    return step


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
