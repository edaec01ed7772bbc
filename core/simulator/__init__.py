"""The simulator: the one place that says what a program does to memory, and when.

A program is a list of instructions, plain data: `("run", op)`, `("free", value)`,
`("offload", value)` and `("prefetch", value)`, the forward's before `backward_start`. Every
consumer reads this package: the plan's timeline (`core.schedule`), the exact figures the
solvers rank candidates by (a block or a whole graph as a `Dag`), the app's step-through (live
values and each forward op's fate) and the runtime, which executes the same program.

- `program`: the instruction kinds, `Link` (the host link), `program_from_runs` (a run list
  under free-after-last-read), `store_all_program` and the rules of a traced step.
- `walker`: the one walker, `walk` -> `Walk`, timing compute and the transfer lane; a
  `Recording` keeps what the timeline draws.
- `dag`: ops over values for the solvers (`Dag`, `DagOp`) and run lists walked on them.
- `timeline`: a plan's program walked on its traced step (`simulate` -> `Simulation`),
  `walk_step` for searches, and the host pool's layout.
- `probes`: numpy fast paths (`StepRuns`, `TransferProbe`) for the searches; tests hold them to
  `walk`.
"""

from core.errors import InvalidPlan
from core.simulator.dag import (
    Dag,
    DagOp,
    Simulated,
    graph_dag,
    kept_bytes,
    simulate_runs,
    simulated,
)
from core.simulator.probes import StepRuns, TransferProbe
from core.simulator.program import (
    COLUMNS,
    FREE,
    KINDS,
    OFFLOAD,
    PREFETCH,
    RUN,
    Instruction,
    Link,
    OpLike,
    program_from_runs,
    store_all_program,
)
from core.simulator.timeline import Fate, Simulation, Step, host_layout, simulate, walk_step
from core.simulator.walker import Recording, Transfer, Walk, walk

__all__ = [
    "COLUMNS",
    "FREE",
    "KINDS",
    "OFFLOAD",
    "PREFETCH",
    "RUN",
    "Dag",
    "DagOp",
    "Fate",
    "Instruction",
    "InvalidPlan",
    "Link",
    "OpLike",
    "Recording",
    "Simulated",
    "Simulation",
    "Step",
    "StepRuns",
    "Transfer",
    "TransferProbe",
    "Walk",
    "graph_dag",
    "host_layout",
    "kept_bytes",
    "program_from_runs",
    "simulate",
    "simulate_runs",
    "simulated",
    "store_all_program",
    "walk",
    "walk_step",
]
