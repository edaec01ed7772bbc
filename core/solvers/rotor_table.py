"""Rotor's table over a chain (Beaumont et al., 2019/2021), with several options per block as
in Rockmate: the chain's data (`ChainBlock`, `BlockOption`), the table, and the schedule it
gives for a number of memory slots.

C(s, t, m) is the least time to run the backward of blocks s..t when the input of block s is
live (and stays so: the caller owns it), the gradient of block t's output is live, and m bytes
are free for everything else. Either block s runs Fe with an option (keeping its activations)
and the rest is solved with what is left, or blocks s..j-1 run forward keeping nothing
(Fck for s, Fn after), j..t is solved with block j's input kept, then s..j-1 with the
gradients j..t left behind. A one-block sub-chain whose option's backward reads nothing its
forward leaves (a Linear's weight gradient reads the input only) skips that forward: it can
only be a recompute, as every block first runs in a sub-chain that ends with the last block.
Memory is counted in slots (sizes rounded up, budgets down).

Like Rotor's, the recurrence is optimal among persistent schedules only: a block output that
a forward reads while it stays live (a checkpoint) is kept until the backward that reads it.
Dropping a used checkpoint and getting it back later from an earlier one can be cheaper (a
4-block case: 11 against the table's 12, pinned in tests/test_solver_properties.py); the
table never claims less time than its schedule takes.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

SLOTS = 1000
_LEAF = 1 << 20
_KEEP_INPUT = -2  # a sub-chain that keeps its input throughout


@dataclass(frozen=True)
class BlockOption:
    """One way to run a block: Fe keeps `kept` bytes (plus its output if `reads_output`)."""

    forward_runs: tuple[int, ...]  # graph op indices
    backward_runs: tuple[int, ...]
    forward_time: float
    forward_peak: int  # bytes above what was live before the forward (output included)
    kept: int  # bytes kept for the backward, the block's output excluded
    reads_output: bool  # the backward reads the block's output: it stays until then
    reads_input: bool  # the backward reads the block's input: else it can go after the forward
    backward_time: float
    backward_peak: int  # bytes above what was live before the backward
    # the backward reads what the forward left (kept values or the output); without it, a
    # recompute that ends with this block need not run its forward again (a Linear's weight
    # gradient reads only the block's input)
    needs_forward: bool = True


@dataclass
class ChainBlock:
    """What Rotor needs of one block."""

    output: int  # bytes of its output (the next block's input); 0 for the last block
    grad: int  # bytes of the gradient its backward hands to the previous block
    permanent: int  # bytes its backward leaves live to the end of the step
    forward_runs: tuple[int, ...]
    forward_time: float
    forward_peak: int  # Fn / Fck: forward keeping nothing but the output
    options: list[BlockOption]
    ilps_limited: int = 0  # block ILPs a limit stopped short of optimal for these options
    search_note: str | None = None  # why the block's option search stopped early, if it did


@dataclass
class Table:
    """Rotor's table over sub-chains and memory slots."""

    slot: int  # bytes per slot
    cost: dict[tuple[int, int], np.ndarray]  # (s, t) -> least time for each number of slots
    what: dict[tuple[int, int], np.ndarray]  # choice: option index, or _LEAF + j
    free_what: dict[tuple[int, int], np.ndarray]  # input counted: option, or _KEEP_INPUT
    out: list[int]  # slots of each block's output

    def best(self, slots: int) -> float:
        n = max(s for s, _ in self.cost) + 1
        arr = self.cost[(0, n - 1)]
        return float(arr[min(slots, len(arr) - 1)]) if slots >= 0 else float("inf")

    @property
    def max_slots(self) -> int:
        n = max(s for s, _ in self.cost) + 1
        return len(self.cost[(0, n - 1)]) - 1

    def min_slots(self) -> int | None:
        n = max(s for s, _ in self.cost) + 1
        finite = np.flatnonzero(np.isfinite(self.cost[(0, n - 1)]))
        return int(finite[0]) if len(finite) else None


def compute_table(blocks: list[ChainBlock], max_bytes: int, slots: int = SLOTS) -> Table:
    """Fill C(s, t, m) for every sub-chain and m = 0..slots (each slot max_bytes/slots).

    Two tables: `keep` for a sub-chain whose input its caller keeps (outside m), as in
    Rotor, and `free` for one whose input is counted in m and can be dropped as soon as no
    option of the sub-chain still needs it (a ReLU's backward reads its output, not its
    input). A checkpointed sub-chain, or one after an option that does not read its output,
    is solved with `free`.
    """
    slot = max(1, -(-max_bytes // slots))
    n = len(blocks)

    def q(b: int) -> int:
        return -(-b // slot)

    out = [q(b.output) for b in blocks]
    grad = [q(b.grad) for b in blocks] + [0]
    perm = np.cumsum([0] + [q(b.permanent) for b in blocks])  # P(s..t) = perm[t+1] - perm[s]
    fwd_t = np.cumsum([0.0] + [b.forward_time for b in blocks])
    out_arr = np.array(out + [0], dtype=np.int64)
    fwd_peak = np.array([q(b.forward_peak) for b in blocks], dtype=np.int64)
    m = np.arange(slots + 1)
    inf = np.inf
    # C(s, t, m) for every sub-chain, as arrays so that a sub-chain's splits are read at once
    keep_arr = np.full((n, n, slots + 1), inf)
    free_arr = np.full((n, n, slots + 1), inf)
    keep_cost: dict[tuple[int, int], np.ndarray] = {}
    keep_what: dict[tuple[int, int], np.ndarray] = {}
    free_cost: dict[tuple[int, int], np.ndarray] = {}
    free_what: dict[tuple[int, int], np.ndarray] = {}

    def shift(arr: np.ndarray, k: int) -> np.ndarray:
        if k <= 0:
            return arr
        res = np.full_like(arr, inf)
        if k < len(arr):
            res[k:] = arr[:-k]
        return res

    def better(best, what, val, choice) -> None:
        mask = val < best
        best[mask] = val[mask]
        what[mask] = choice[mask] if isinstance(choice, np.ndarray) else choice

    for d in range(n):
        for s in range(n - d):
            t = s + d
            inp = out[s - 1] if s > 0 else 0
            k_best, k_what = keep_arr[s, t], np.full(slots + 1, -1, dtype=np.int64)
            f_best, f_what = free_arr[s, t], np.full(slots + 1, -1, dtype=np.int64)
            after = perm[t + 1] - perm[s + 1]  # gradients blocks s+1..t leave behind
            for i, o in enumerate(blocks[s].options):
                kept = q(o.kept) + (out[s] if o.reads_output else 0)
                fwd_need = grad[t + 1] + q(o.forward_peak)
                bwd_need = grad[s + 1] + after + kept + q(o.backward_peak)
                fwd_time = o.forward_time
                if _skips_forward(blocks, s, t, o):
                    fwd_need, fwd_time = 0, 0.0
                rest: float | np.ndarray
                if d == 0:
                    rest = 0.0
                elif o.reads_output:  # the output stays until this backward: keep it
                    rest = shift(keep_cost[(s + 1, t)], out[s] + q(o.kept))
                else:  # the sub-chain may drop the output once it is done with it
                    rest = shift(free_cost[(s + 1, t)], q(o.kept))
                val = fwd_time + o.backward_time + rest
                better(k_best, k_what, np.where((m >= fwd_need) & (m >= bwd_need), val, inf), i)
                if not o.reads_input:  # the input can go once this forward has run
                    ok = (m >= inp + fwd_need) & (m >= bwd_need)
                    better(f_best, f_what, np.where(ok, val, inf), i)
            if d:  # splits: blocks s..j-1 forward keeping only their outputs, j..t first
                js = np.arange(s + 1, t + 1)
                ran = js - 1  # each block ran runs forward keeping nothing but its output
                before = np.where(ran > s, out_arr[ran - 1], 0)
                need = np.maximum.accumulate(grad[t + 1] + before + fwd_peak[ran])
                at = m[None, :] - (perm[t + 1] - perm[js])[:, None]  # shifted keep_cost
                held = np.take_along_axis(keep_arr[s, ran], np.maximum(at, 0), axis=1)
                val = (
                    (fwd_t[js] - fwd_t[s])[:, None] + free_arr[js, t] + np.where(at >= 0, held, inf)
                )
                val = np.where(m[None, :] >= need[:, None], val, inf)
                first = np.argmin(val, axis=0)  # the first split reaching the least, as in order
                better(k_best, k_what, val[first, m], _LEAF + js[first])
            keep_cost[(s, t)], keep_what[(s, t)] = k_best, k_what
            # with its input counted, a sub-chain either drops it early or keeps it throughout
            better(f_best, f_what, shift(k_best, inp), _KEEP_INPUT)
            free_cost[(s, t)], free_what[(s, t)] = f_best, f_what
    return Table(slot, keep_cost, keep_what, free_what, out)


def sequence(blocks: list[ChainBlock], table: Table, slots: int) -> list[tuple]:
    """The schedule for `slots`: ("F", j), ("Fe", j, option), ("B", j, option)."""
    q = lambda b: -(-b // table.slot)  # noqa: E731
    out: list[tuple] = []

    def option(s: int, t: int, m: int, c: int) -> None:
        o = blocks[s].options[c]
        if not _skips_forward(blocks, s, t, o):
            out.append(("Fe", s, c))
        if t > s and o.reads_output:
            keep(s + 1, t, m - q(blocks[s].output) - q(o.kept))
        elif t > s:
            free(s + 1, t, m - q(o.kept))
        out.append(("B", s, c))

    def keep(s: int, t: int, m: int) -> None:
        """Sub-chain s..t whose input the caller keeps (outside m)."""
        c = int(table.what[(s, t)][m])
        if c < 0:
            raise ValueError("infeasible sub-chain")
        if c >= _LEAF:
            j = c - _LEAF
            out.extend(("F", i) for i in range(s, j))
            free(j, t, m)
            perm = sum(q(b.permanent) for b in blocks[j : t + 1])
            keep(s, j - 1, m - perm)
            return
        option(s, t, m, c)

    def free(s: int, t: int, m: int) -> None:
        """Sub-chain s..t whose input is counted in m and may be dropped when unused."""
        c = int(table.free_what[(s, t)][m])
        if c == _KEEP_INPUT:
            keep(s, t, m - (table.out[s - 1] if s > 0 else 0))
        elif c < 0:
            raise ValueError("infeasible sub-chain")
        else:
            option(s, t, m, c)

    keep(0, len(blocks) - 1, min(slots, len(table.what[(0, len(blocks) - 1)]) - 1))
    return out


def _skips_forward(blocks: list[ChainBlock], s: int, t: int, o: BlockOption) -> bool:
    """A sub-chain of one block whose option's backward reads nothing its forward leaves:
    the output is not needed either (the gradient has arrived), so the forward is not rerun.
    Never the last block: its forward's first run is the step's output."""
    return s == t < len(blocks) - 1 and not o.needs_forward


def runs_of(blocks: list[ChainBlock], seq: list[tuple]) -> tuple[list[int], int]:
    """Op runs of a schedule, and how many of them run in the forward pass."""
    runs: list[int] = []
    n_forward = None
    for step in seq:
        if step[0] == "F":
            runs.extend(blocks[step[1]].forward_runs)
        elif step[0] == "Fe":
            runs.extend(blocks[step[1]].options[step[2]].forward_runs)
        else:
            if n_forward is None:
                n_forward = len(runs)
            runs.extend(blocks[step[1]].options[step[2]].backward_runs)
    return runs, len(runs) if n_forward is None else n_forward
