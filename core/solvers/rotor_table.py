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

from collections.abc import Callable
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
    """Rotor's table over sub-chains and memory slots, indexed [s, t] (t >= s) then by slots."""

    slot: int  # bytes per slot
    cost: np.ndarray  # [s, t, m]: least time with m slots
    what: np.ndarray  # [s, t, m]: choice, an option index or _LEAF + j (-1: infeasible)
    free_what: np.ndarray  # [s, t, m], input counted: an option or _KEEP_INPUT
    out: list[int]  # slots of each block's output

    def best(self, slots: int) -> float:
        arr = self.cost[0, -1]
        return float(arr[min(slots, len(arr) - 1)]) if slots >= 0 else float("inf")

    @property
    def max_slots(self) -> int:
        return self.cost.shape[2] - 1

    def min_slots(self) -> int | None:
        finite = np.flatnonzero(np.isfinite(self.cost[0, -1]))
        return int(finite[0]) if len(finite) else None


def compute_table(blocks: list[ChainBlock], max_bytes: int, slots: int = SLOTS) -> Table:
    """Fill C(s, t, m) for every sub-chain and m = 0..slots (each slot max_bytes/slots).

    Two tables: `keep` for a sub-chain whose input its caller keeps (outside m), as in
    Rotor, and `free` for one whose input is counted in m and can be dropped as soon as no
    option of the sub-chain still needs it (a ReLU's backward reads its output, not its
    input). A checkpointed sub-chain, or one after an option that does not read its output,
    is solved with `free`.

    The sub-chains of one length are filled at once (arrays over s), each from shorter ones:
    every entry is the same sum, compared in the same order, as one sub-chain at a time.
    """
    slot = max(1, -(-max_bytes // slots))
    n = len(blocks)

    def q(b: int) -> int:
        return -(-b // slot)

    out = [q(b.output) for b in blocks]
    out_arr = np.array(out + [0], dtype=np.int64)
    grad = np.array([q(b.grad) for b in blocks] + [0], dtype=np.int64)
    perm = np.cumsum([0] + [q(b.permanent) for b in blocks])  # P(s..t) = perm[t+1] - perm[s]
    fwd_t = np.cumsum([0.0] + [b.forward_time for b in blocks])
    fwd_peak = np.array([q(b.forward_peak) for b in blocks], dtype=np.int64)
    options = _option_arrays(blocks, q, out)
    m = np.arange(slots + 1)
    width = slots + 1
    # Costs read m - k slots for a shift k (the slots something else holds), infinite below
    # 0: each row starts with `pad` infinite entries, and a shifted row is a window of them.
    shifts = [int(perm[-1]), max(out), *(int(o.kept.max()) for o in options)]
    pad = min(width, max(shifts))
    keep = np.full((n, n, pad + width), np.inf)
    free = np.full((n, n, pad + width), np.inf)
    keep_what = np.full((n, n, width), -1, dtype=np.int64)
    free_what = np.full((n, n, width), -1, dtype=np.int64)
    keep_win = np.lib.stride_tricks.sliding_window_view(keep, width, axis=2)
    free_win = np.lib.stride_tricks.sliding_window_view(free, width, axis=2)

    def start(k: np.ndarray) -> np.ndarray:
        """Window start of rows shifted by k slots (k >= width: all infinite)."""
        return pad - np.minimum(k, pad)

    for d in range(n):
        s = np.arange(n - d)
        t = s + d
        inp = np.where(s > 0, out_arr[s - 1], 0)
        k_best = np.full((n - d, width), np.inf)
        k_what = np.full((n - d, width), -1, dtype=np.int64)
        f_best = np.full((n - d, width), np.inf)
        f_what = np.full((n - d, width), -1, dtype=np.int64)
        after = perm[t + 1] - perm[s + 1]  # gradients blocks s+1..t leave behind
        for i, o in enumerate(options):
            rows = np.flatnonzero(o.present[: n - d])
            if not len(rows):
                continue
            rs, rt = s[rows], t[rows]
            fwd_need = grad[rt + 1] + o.forward_peak[rs]
            bwd_need = grad[rs + 1] + after[rows] + o.kept[rs] + o.backward_peak[rs]
            fwd_time = o.forward_time[rs]
            if d == 0:  # a one-block sub-chain that is not the last may skip its forward
                skip = ~o.needs_forward[rs] & (rs < n - 1)
                fwd_need = np.where(skip, 0, fwd_need)
                fwd_time = np.where(skip, 0.0, fwd_time)
                rest: float | np.ndarray = 0.0
            else:  # the output stays until this backward (kept) or may go once unused (free)
                rest = np.where(
                    o.reads_output[rs, None],
                    keep_win[rs + 1, rt, start(o.kept[rs])],
                    free_win[rs + 1, rt, start(o.kept[rs])],
                )
            val = (fwd_time + o.backward_time[rs])[:, None] + rest
            fits = m >= bwd_need[:, None]
            ok = fits & (m >= fwd_need[:, None])
            _better(k_best, k_what, rows, np.where(ok, val, np.inf), i)
            drops = np.flatnonzero(~o.reads_input[rs])  # the input can go after this forward
            ok = fits[drops] & (m >= (inp[rows] + fwd_need)[drops, None])
            _better(f_best, f_what, rows[drops], np.where(ok, val[drops], np.inf), i)
        if d:  # splits: blocks s..j-1 forward keeping only their outputs, j..t first
            js = s[:, None] + np.arange(1, d + 1)[None, :]
            ran = js - 1  # each block ran runs forward keeping nothing but its output
            before = np.where(ran > s[:, None], out_arr[ran - 1], 0)
            need = np.maximum.accumulate(grad[t + 1, None] + before + fwd_peak[ran], axis=1)
            held = keep_win[s[:, None], ran, start(perm[t + 1, None] - perm[js])]
            val = (fwd_t[js] - fwd_t[s, None])[:, :, None] + free[js, t[:, None], pad:] + held
            val[m[None, None, :] < need[:, :, None]] = np.inf
            first = np.argmin(val, axis=1)  # the first split reaching the least, as in order
            least = np.take_along_axis(val, first[:, None, :], axis=1)[:, 0, :]
            _better(k_best, k_what, s, least, _LEAF + s[:, None] + 1 + first)
        keep[s, t, pad:], keep_what[s, t] = k_best, k_what
        # with its input counted, a sub-chain either drops it early or keeps it throughout
        _better(f_best, f_what, s, keep_win[s, t, start(inp)], _KEEP_INPUT)
        free[s, t, pad:], free_what[s, t] = f_best, f_what
    return Table(slot, keep[:, :, pad:], keep_what, free_what, out)


def _better(best: np.ndarray, what: np.ndarray, rows: np.ndarray, val: np.ndarray, choice) -> None:
    """Where `val` beats `best[rows]` (strictly: on a tie the earlier choice stays), take it."""
    mask = val < best[rows]
    best[rows] = np.where(mask, val, best[rows])
    what[rows] = np.where(mask, choice, what[rows])


@dataclass
class _Options:
    """The i-th option of every block as arrays over blocks (`present`: the block has one;
    absent ones read zeros), memory in slots."""

    present: np.ndarray
    forward_time: np.ndarray
    backward_time: np.ndarray
    forward_peak: np.ndarray
    backward_peak: np.ndarray
    # slots the option holds while the rest of its sub-chain runs: what it keeps, and the
    # block's output when its backward reads it
    kept: np.ndarray
    reads_output: np.ndarray
    reads_input: np.ndarray
    needs_forward: np.ndarray


def _option_arrays(
    blocks: list[ChainBlock], q: Callable[[int], int], out: list[int]
) -> list[_Options]:
    """The blocks' options by index, as arrays over blocks."""
    found = []
    for i in range(max(len(b.options) for b in blocks)):
        opts = [b.options[i] if i < len(b.options) else None for b in blocks]
        found.append(
            _Options(
                present=np.array([o is not None for o in opts]),
                forward_time=_column(opts, lambda j, o: o.forward_time, np.float64),
                backward_time=_column(opts, lambda j, o: o.backward_time, np.float64),
                forward_peak=_column(opts, lambda j, o: q(o.forward_peak), np.int64),
                backward_peak=_column(opts, lambda j, o: q(o.backward_peak), np.int64),
                kept=_column(
                    opts, lambda j, o: q(o.kept) + (out[j] if o.reads_output else 0), np.int64
                ),
                reads_output=_column(opts, lambda j, o: o.reads_output, bool),
                reads_input=_column(opts, lambda j, o: o.reads_input, bool),
                needs_forward=_column(opts, lambda j, o: o.needs_forward, bool),
            )
        )
    return found


def _column(
    opts: list[BlockOption | None], f: Callable[[int, BlockOption], float], dtype: type
) -> np.ndarray:
    """f(block index, option) over blocks, 0 where a block has no such option."""
    return np.array([0 if o is None else f(j, o) for j, o in enumerate(opts)], dtype)


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
