"""The results of `remat bench`: one Row per strategy and model, printed as tables and
written as Markdown, CSV, an HTML chart (plotly) and a PNG chart (matplotlib, from the `bench`
extra; left out with a message when it is not installed)."""

from __future__ import annotations

import csv
import datetime as _dt
import math
import os
import platform
import statistics
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

import sample_models
from bench import MissingExtra
from core import fmt_bytes


@dataclass
class Row:
    """One strategy measured on one model. Bytes, seconds; ratios are against eager."""

    model: str
    key: str  # short id: eager, ckpt, ckpt2, sac, aot-0.5, inductor-0.2, ours:rockmate@50%
    strategy: str
    family: str  # "pytorch" or "ours"
    budget: str  # the budget asked, as text
    peak: float = math.nan  # measured bytes beyond parameters and inputs
    eager_peak: float = math.nan  # eager's peak measured the same way (tracker or profiler)
    time: float = math.nan  # median seconds of forward + backward
    eager_time: float = math.nan
    grad_error: float = math.nan  # max abs difference from eager's gradients
    grads_match: bool = True  # torch.testing.assert_close passed
    peak_source: str = "tracker"  # "tracker" (StorageTracker), "profiler" (allocator events) or
    # "cuda" (torch.cuda.max_memory_allocated)
    predicted_peak: float = math.nan  # ours: the plan's simulated peak
    predicted_overhead: float = math.nan  # ours: predicted time / store-all time
    times: list[float] = field(default_factory=list, repr=False)
    ratios: list[float] = field(default_factory=list, repr=False)  # each against its eager step
    note: str = ""

    @property
    def peak_ratio(self) -> float:
        return self.peak / self.eager_peak if self.eager_peak else math.nan

    @property
    def time_ratio(self) -> float:
        if self.ratios:
            return statistics.median(self.ratios)
        return self.time / self.eager_time if self.eager_time else math.nan

    @property
    def ok(self) -> bool:
        return not self.note.startswith("failed") and not math.isnan(self.peak)


COLUMNS = [
    "strategy",
    "budget asked",
    "measured peak",
    "peak / eager",
    "step time / eager",
    "max grad error vs eager",
]


def _cells(row: Row) -> list[str]:
    if not row.ok:
        return [row.strategy, row.budget, "-", "-", "-", row.note or "failed"]
    err = f"{row.grad_error:.1e}" if row.grad_error else "0"
    if not row.grads_match:
        err += " DIFFERS"
    peak = fmt_bytes(row.peak) + ("*" if row.peak_source == "profiler" else "")
    time_ = f"{row.time_ratio:.2f}x ({row.time * 1e3:.0f} ms)"
    return [row.strategy, row.budget, peak, f"{row.peak_ratio:.2f}", time_, err]


def by_model(rows: Sequence[Row]) -> dict[str, list[Row]]:
    out: dict[str, list[Row]] = {}
    for r in rows:
        out.setdefault(r.model, []).append(r)
    return out


def print_tables(rows: Sequence[Row], console=None) -> None:
    from rich.console import Console
    from rich.table import Table

    console = console or Console()
    for model, group in by_model(rows).items():
        table = Table(title=f"{model}: {sample_models.describe(model)}", title_justify="left")
        for c in COLUMNS:
            table.add_column(c, justify="left" if c in ("strategy", "budget asked") else "right")
        for r in group:
            style = "red" if not r.grads_match else ("cyan" if r.family == "ours" else None)
            table.add_row(*_cells(r), style=style)
        console.print(table)
    for line in headlines(rows):
        console.print(line)


def headlines(rows: Sequence[Row], method: str = "rockmate") -> list[str]:
    """The issue's "must show" figures for each GPT model: `method` at 50% against PyTorch's
    strategies reaching the same peak or lower; the smallest peak at <= 1.20x eager time."""
    out = []
    for model, group in by_model(rows).items():
        # the rows whose peak the storage tracker measures: the interpreter's and native's
        planned = [r for r in group if r.ok and r.key.startswith(("ours:", "native:"))]
        if planned:
            worst = max(planned, key=lambda r: abs(r.peak - r.predicted_peak))
            gap = worst.peak - worst.predicted_peak
            out.append(
                f"{model}: measured vs predicted peak of our plans: worst {gap:+,.0f} bytes "
                f"({gap / worst.predicted_peak:+.1%}, {worst.key})"
            )
        ours = [r for r in group if r.ok and r.key.startswith(f"ours:{method}@")]
        if not ours:
            continue
        at50 = [r for r in ours if r.key == f"ours:{method}@50%"]
        if at50:
            r = at50[0]
            rivals = [
                p
                for p in group
                if p.ok and p.family == "pytorch" and p.key != "eager" and p.peak <= r.peak
            ]
            rival_text = (
                ", ".join(
                    f"{p.key} {p.time_ratio:.2f}x (peak {p.peak_ratio:.2f}"
                    + ("" if p.grads_match else ", grads differ")
                    + ")"
                    for p in rivals
                )
                or "none"
            )
            out.append(
                f"{model}: {method} at 50%: peak {r.peak_ratio:.2f} of eager, step "
                f"{r.time_ratio:.2f}x eager; PyTorch at the same peak or lower: {rival_text}"
            )
        fast = [r for r in ours if r.time_ratio <= 1.20 and r.grads_match]
        if fast:
            best = min(fast, key=lambda r: r.peak)
            out.append(
                f"{model}: smallest {method} peak at <= 1.20x eager time: "
                f"{best.peak_ratio:.1%} of eager ({fmt_bytes(best.peak)}) at "
                f"{best.time_ratio:.2f}x, budget {best.budget}"
            )
    return out


def environment() -> str:
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return (
        f"{_dt.datetime.now():%Y-%m-%d %H:%M}, {cpu}, {os.cpu_count()} cores (bench uses 1 "
        f"thread), torch {torch.__version__}, Python {platform.python_version()}"
    )


def write_markdown(rows: Sequence[Row], path: Path, reps: int | None = None) -> None:
    lines = [
        f"# remat bench\n\n{environment()}"
        + (
            f"; {reps} timed reps, each step right after an eager one; medians of the paired ratios"
            if reps
            else ""
        )
    ]
    lines.append(
        "\nPeak: bytes beyond parameters and inputs, from `core.StorageTracker` around "
        "the real step; `*`: from the allocator profile (inductor), against eager under the "
        "same profile. DIFFERS: gradients fail `torch.testing.assert_close` against eager. "
        "Host memory is not in the peak: `torch save_on_cpu` and `ours offload` park tensors "
        "there. On CPU, host and device are one memory, so `save_on_cpu` is emulated (the same "
        "copies, into storage the tracker does not count, as for our offload plans) and its "
        "copies run at memcpy speed, not at a GPU's host-link speed."
    )
    for model, group in by_model(rows).items():
        lines.append(f"\n## {model}\n\n{sample_models.describe(model)}\n")
        lines.append("| " + " | ".join(COLUMNS) + " |")
        lines.append("|" + "---|" * len(COLUMNS))
        for r in group:
            lines.append("| " + " | ".join(c.replace("|", "/") for c in _cells(r)) + " |")
    heads = headlines(rows)
    if heads:
        lines.append("\n## Headlines\n")
        lines += [f"- {h}" for h in heads]
    path.write_text("\n".join(lines) + "\n")


CSV_FIELDS = [
    "model",
    "key",
    "strategy",
    "family",
    "budget",
    "peak",
    "eager_peak",
    "peak_ratio",
    "time",
    "eager_time",
    "time_ratio",
    "grad_error",
    "grads_match",
    "peak_source",
    "predicted_peak",
    "predicted_overhead",
    "times",
    "ratios",
    "note",
]


def write_csv(rows: Sequence[Row], path: Path) -> None:
    with path.open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=CSV_FIELDS)
        w.writeheader()
        for r in rows:
            d = asdict(r)
            d.update(peak_ratio=r.peak_ratio, time_ratio=r.time_ratio)
            d["times"] = " ".join(f"{t:.5f}" for t in r.times)
            d["ratios"] = " ".join(f"{x:.4f}" for x in r.ratios)
            w.writerow({k: d[k] for k in CSV_FIELDS})


def pareto(points: Sequence[tuple[float, float]]) -> list[int]:
    """Indices of the points no other point beats on both x and y (lower is better), by x."""
    order = sorted(range(len(points)), key=lambda i: (points[i][0], points[i][1]))
    front, best_y = [], math.inf
    for i in order:
        if points[i][1] < best_y:
            front.append(i)
            best_y = points[i][1]
    return front


def _plot_rows(group: Sequence[Row]) -> list[Row]:
    return [r for r in group if r.ok and not math.isnan(r.time_ratio)]


def _marker_label(r: Row) -> str:
    if r.family == "ours":
        return r.key.removeprefix("ours:")
    return r.key


def write_png(rows: Sequence[Row], path: Path) -> None:
    """The HTML chart's scatter as a PNG; MissingExtra when matplotlib is not installed."""
    try:
        import matplotlib
    except ImportError as e:
        raise MissingExtra(
            "the PNG chart needs matplotlib: pip install 'remat-studio[bench]'"
        ) from e

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    groups = by_model(rows)
    n = len(groups)
    cols = min(n, 3)
    nrows = math.ceil(n / cols)
    fig, axes = plt.subplots(nrows, cols, figsize=(6.5 * cols, 5 * nrows), squeeze=False)
    for ax, (model, group) in zip(axes.flat, groups.items()):
        pts = _plot_rows(group)
        for r in pts:
            color = "tab:blue" if r.family == "ours" else "tab:orange"
            ax.scatter(
                r.time_ratio,
                r.peak_ratio,
                marker="o" if r.family == "ours" else "s",
                facecolors=color if r.grads_match else "none",
                edgecolors=color,
                s=40,
            )
            ax.annotate(
                _marker_label(r),
                (r.time_ratio, r.peak_ratio),
                fontsize=6,
                xytext=(3, 3),
                textcoords="offset points",
            )
        exact = [r for r in pts if r.grads_match]
        front = [exact[i] for i in pareto([(r.time_ratio, r.peak_ratio) for r in exact])]
        if front:
            ax.step(
                [r.time_ratio for r in front],
                [r.peak_ratio for r in front],
                where="post",
                color="gray",
                lw=1,
                ls="--",
                label="Pareto front (exact grads)",
            )
        ax.set_title(model)
        ax.set_xlabel("step time / eager")
        ax.set_ylabel("measured peak / eager")
        ax.grid(alpha=0.3)
        ax.scatter([], [], marker="o", color="tab:blue", label="ours")
        ax.scatter([], [], marker="s", color="tab:orange", label="PyTorch")
        ax.scatter([], [], marker="s", facecolors="none", edgecolors="gray", label="grads differ")
        ax.legend(fontsize=7)
    for ax in list(axes.flat)[n:]:
        ax.set_visible(False)
    fig.suptitle(f"remat bench: {environment()}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=130)
    plt.close(fig)


def write_html(rows: Sequence[Row], path: Path) -> None:
    import plotly.graph_objects as go
    from plotly.subplots import make_subplots

    groups = by_model(rows)
    n = len(groups)
    cols = min(n, 3)
    nrows = math.ceil(n / cols)
    fig = make_subplots(rows=nrows, cols=cols, subplot_titles=list(groups))
    for i, (_model, group) in enumerate(groups.items()):
        rr, cc = i // cols + 1, i % cols + 1
        pts = _plot_rows(group)
        for family, color, symbol in (
            ("ours", "#1f77b4", "circle"),
            ("pytorch", "#ff7f0e", "square"),
        ):
            sel = [r for r in pts if r.family == family]
            fig.add_trace(
                go.Scatter(
                    x=[r.time_ratio for r in sel],
                    y=[r.peak_ratio for r in sel],
                    mode="markers+text",
                    text=[_marker_label(r) for r in sel],
                    textposition="top right",
                    textfont={"size": 8},
                    marker={
                        "color": color,
                        "size": 9,
                        "symbol": [symbol if r.grads_match else symbol + "-open" for r in sel],
                    },
                    name="ours" if family == "ours" else "PyTorch",
                    legendgroup=family,
                    showlegend=i == 0,
                    hovertext=[
                        f"{r.strategy}<br>budget {r.budget}<br>peak {fmt_bytes(r.peak)} "
                        f"({r.peak_ratio:.2f})<br>time {r.time * 1e3:.1f} ms "
                        f"({r.time_ratio:.2f}x)<br>grad err {r.grad_error:.1e}"
                        + ("" if r.grads_match else " DIFFERS")
                        for r in sel
                    ],
                    hoverinfo="text",
                ),
                row=rr,
                col=cc,
            )
        exact = [r for r in pts if r.grads_match]
        front = [exact[j] for j in pareto([(r.time_ratio, r.peak_ratio) for r in exact])]
        fig.add_trace(
            go.Scatter(
                x=[r.time_ratio for r in front],
                y=[r.peak_ratio for r in front],
                mode="lines",
                line={"shape": "hv", "dash": "dash", "color": "gray"},
                name="Pareto front (exact grads)",
                legendgroup="front",
                showlegend=i == 0,
                hoverinfo="skip",
            ),
            row=rr,
            col=cc,
        )
        fig.update_xaxes(title_text="step time / eager", row=rr, col=cc)
        fig.update_yaxes(title_text="peak / eager", row=rr, col=cc)
    fig.update_layout(title=f"remat bench: {environment()}", height=420 * nrows, width=520 * cols)
    fig.write_html(str(path), include_plotlyjs="cdn")


def write_results(
    rows: Sequence[Row],
    out: str | Path,
    reps: int | None = None,
    log: Callable[[str], None] = print,
) -> dict[str, Path]:
    """bench.md, bench.csv, bench.html and bench.png in `out` (created): the paths written.
    Without matplotlib the PNG is left out and `log` says why."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    paths = {ext: out / f"bench.{ext}" for ext in ("md", "csv", "html", "png")}
    write_markdown(rows, paths["md"], reps)
    write_csv(rows, paths["csv"])
    write_html(rows, paths["html"])
    try:
        write_png(rows, paths["png"])
    except MissingExtra as e:
        log(f"no {paths.pop('png')}: {e}")
    return paths
