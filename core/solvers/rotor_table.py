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
    """Rotor's table, indexed [t - s][s, m]: sub-chain s..t with m slots free."""

    slot: int  # bytes per slot
    cost: list[np.ndarray]  # least time, the sub-chain's input kept by the caller
    what: list[np.ndarray]  # its choice: an option index or _LEAF + j (-1: infeasible)
    free_what: list[np.ndarray]  # the choice with the input counted: an option or _KEEP_INPUT
    out: list[int]  # slots of each block's output

    def best(self, slots: int) -> float:
        arr = self.cost[-1][0]
        return float(arr[min(slots, len(arr) - 1)]) if slots >= 0 else float("inf")

    @property
    def max_slots(self) -> int:
        return self.cost[0].shape[1] - 1

    def min_slots(self) -> int | None:
        finite = np.flatnonzero(np.isfinite(self.cost[-1][0]))
        return int(finite[0]) if len(finite) else None


def compute_table(blocks: list[ChainBlock], max_bytes: int, slots: int = SLOTS) -> Table:
    """Fill C(s, t, m) for every sub-chain and m = 0..slots (each slot max_bytes/slots).

    Two tables: `keep` for a sub-chain whose input its caller keeps (outside m), as in
    Rotor, and `free` for one whose input is counted in m and can be dropped as soon as no
    option of the sub-chain still needs it (a ReLU's backward reads its output, not its
    input). A checkpointed sub-chain, or one after an option that does not read its output,
    is solved with `free`.

    The sub-chains of one length are filled at once (arrays over s), from shorter ones, one
    split point after another: every entry is the same sum, compared in the same order, as
    when filled one sub-chain at a time.
    """
    if not blocks:
        raise ValueError("Rotor's table needs a chain of at least one block")
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
    width = slots + 1
    m = np.arange(width)
    # Costs are read at m - k slots for a shift k (what something else holds), infinite below
    # 0: each row starts with `pad` infinite entries, and a shifted row is a window of it.
    pad = min(width, max(int(perm[-1]), max(out), *(int(o.kept.max()) for o in options)))
    keep = [np.full((n - d, pad + width), np.inf) for d in range(n)]  # [d][s]: s..s+d
    free = [np.full((n - d, pad + width), np.inf) for d in range(n)]
    keep_what = [np.full((n - d, width), -1, dtype=np.int32) for d in range(n)]
    free_what = [np.full((n - d, width), -1, dtype=np.int32) for d in range(n)]
    keep_win = [np.lib.stride_tricks.sliding_window_view(a, width, axis=1) for a in keep]
    free_win = [np.lib.stride_tricks.sliding_window_view(a, width, axis=1) for a in free]

    def start(k: np.ndarray) -> np.ndarray:
        """Window start of rows shifted by k slots (k >= width: all infinite)."""
        return pad - np.minimum(k, pad)

    for d in range(n):
        s = np.arange(n - d)
        t = s + d
        inp = np.where(s > 0, out_arr[s - 1], 0)
        k_best, k_what = keep[d][:, pad:], keep_what[d]  # views: filled here
        f_best, f_what = free[d][:, pad:], free_what[d]
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
                    keep_win[d - 1][rs + 1, start(o.kept[rs])],
                    free_win[d - 1][rs + 1, start(o.kept[rs])],
                )
            val = (fwd_time + o.backward_time[rs])[:, None] + rest
            fits = m >= bwd_need[:, None]
            ok = fits & (m >= fwd_need[:, None])
            _better(k_best, k_what, rows, np.where(ok, val, np.inf), i)
            drops = np.flatnonzero(~o.reads_input[rs])  # the input can go after this forward
            ok = fits[drops] & (m >= (inp[rows] + fwd_need)[drops, None])
            _better(f_best, f_what, rows[drops], np.where(ok, val[drops], np.inf), i)
        if d:  # splits: blocks s..j-1 forward keeping only their outputs, j..t first
            least = np.full((n - d, width), np.inf)
            first = np.zeros((n - d, width), dtype=np.int64)
            cand, wins = np.empty((n - d, width)), np.empty((n - d, width), dtype=bool)
            # [k - 1, s] for split j = s + k: blocks s..j-1 ran forward keeping nothing but
            # their outputs, the memory that needs; their time; where keep(s, j-1) is read
            ks = np.arange(1, d + 1)[:, None]
            ran = s + ks - 1
            before = np.where(ks > 1, out_arr[ran - 1], 0)
            need = np.maximum.accumulate(grad[t + 1] + before + fwd_peak[ran], axis=0)
            forward = (fwd_t[s + ks] - fwd_t[s])[:, :, None]
            at = start(perm[t + 1] - perm[s + ks])
            for k in range(1, d + 1):  # on a tie the first split stays
                np.add(forward[k - 1], free[d - k][k : k + n - d, pad:], out=cand)  # free(j, t)
                cand += keep_win[k - 1][s, at[k - 1]]  # keep(s, j-1)
                low = int(need[k - 1].max())  # columns where some split's forward does not fit
                if low > 0:
                    np.copyto(cand[:, :low], np.inf, where=m[:low] < need[k - 1, :, None])
                np.less(cand, least, out=wins)
                np.copyto(least, cand, where=wins)
                np.copyto(first, k, where=wins)
            _better(k_best, k_what, s, least, _LEAF + s[:, None] + first)
        # with its input counted, a sub-chain either drops it early or keeps it throughout
        _better(f_best, f_what, s, keep_win[d][s, start(inp)], _KEEP_INPUT)
    return Table(slot, [a[:, pad:] for a in keep], keep_what, free_what, out)


def _better(
    best: np.ndarray, what: np.ndarray, rows: np.ndarray, val: np.ndarray, choice: int | np.ndarray
) -> None:
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
        c = int(table.what[t - s][s, m])
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
        c = int(table.free_what[t - s][s, m])
        if c == _KEEP_INPUT:
            keep(s, t, m - (table.out[s - 1] if s > 0 else 0))
        elif c < 0:
            raise ValueError("infeasible sub-chain")
        else:
            option(s, t, m, c)

    keep(0, len(blocks) - 1, min(slots, table.max_slots))
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
