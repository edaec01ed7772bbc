"""Beyond one device: data- x tensor-parallel layouts chosen by the planner (`parallel_plan`)
and applied with PyTorch's own DTensor tensor parallelism and FSDP2 (`parallelize`)."""

from core.parallel.apply import parallelize
from core.parallel.cost import LINKS, LinkSpec
from core.parallel.search import (
    Layout,
    Memory,
    ParallelError,
    ParallelPlan,
    StepTime,
    parallel_plan,
)
from core.parallel.sharding import Pair

__all__ = [
    "LINKS",
    "Layout",
    "LinkSpec",
    "Memory",
    "Pair",
    "ParallelError",
    "ParallelPlan",
    "StepTime",
    "parallel_plan",
    "parallelize",
]
