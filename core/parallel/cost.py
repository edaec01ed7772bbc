"""Links between devices and what a collective costs on them.

A ring collective over `n` ranks moves each byte `2(n-1)/n` times for an all-reduce and
`(n-1)/n` times for an all-gather or a reduce-scatter (NCCL's bus-bandwidth model, nccl-tests
doc/PERFORMANCE.md), in `2(n-1)` or `n-1` steps that each pay the link's latency.

Link rates are per direction, from the datasheets, derated to 80% as `core.costs` derates
memory bandwidth (what large collectives sustain: NCCL all-reduce on 8 x H100 SXM reaches
~360 GB/s bus bandwidth of the 450 GB/s per direction):
- NVLink 4 (H100 SXM5, NVIDIA H100 datasheet): 900 GB/s total, 450 GB/s each way.
- NVLink 3 (A100 SXM4, NVIDIA A100 datasheet): 600 GB/s total, 300 GB/s each way.
- NVLink 2 (V100 SXM2, NVIDIA V100 datasheet): 300 GB/s total, 150 GB/s each way.
- PCIe 4.0 x16 (PCI-SIG): 31.5 GB/s each way; PCIe 5.0 x16: 63 GB/s each way.
- gloo over loopback on this machine ("cpu"): measured, see docs/parallel.md.
Latency: ~5 us per ring step for NVLink (NCCL's small-message all-reduce latency on one node
is ~10-20 us over a few steps), ~10 us over PCIe; loopback as measured (all-reduces of 1 KiB
and 4 MiB between two gloo processes, no derating).
"""

from __future__ import annotations

from dataclasses import dataclass

_DERATE = 0.8


@dataclass(frozen=True)
class LinkSpec:
    """A device-to-device link: sustained bytes/s per direction and seconds per ring step."""

    name: str
    bandwidth: float
    latency: float

    def all_reduce(self, nbytes: int, ranks: int) -> float:
        """Seconds of a ring all-reduce of `nbytes` on every rank over `ranks` ranks."""
        if ranks <= 1 or nbytes <= 0:
            return 0.0
        steps = 2 * (ranks - 1)
        return steps / ranks * nbytes / self.bandwidth + steps * self.latency

    def all_gather(self, nbytes: int, ranks: int) -> float:
        """Seconds of a ring all-gather (or reduce-scatter) whose full result is `nbytes`."""
        if ranks <= 1 or nbytes <= 0:
            return 0.0
        steps = ranks - 1
        return steps / ranks * nbytes / self.bandwidth + steps * self.latency


LINKS: dict[str, LinkSpec] = {
    "nvlink4": LinkSpec("nvlink4", 450e9 * _DERATE, 5e-6),
    "nvlink3": LinkSpec("nvlink3", 300e9 * _DERATE, 5e-6),
    "nvlink2": LinkSpec("nvlink2", 150e9 * _DERATE, 5e-6),
    "pcie5": LinkSpec("pcie5", 63e9 * _DERATE, 10e-6),
    "pcie4": LinkSpec("pcie4", 31.5e9 * _DERATE, 10e-6),
    # gloo between two processes on this machine (loopback TCP), measured (docs/parallel.md)
    "loopback": LinkSpec("loopback", 0.85e9, 0.44e-3),
}

# The link a device preset's GPUs are joined by in an 8-GPU server of that kind.
DEVICE_LINKS: dict[str, str] = {
    "h100": "nvlink4",
    "a100": "nvlink3",
    "v100": "nvlink2",
    "rtx4090": "pcie4",
    "cpu": "loopback",
}


def link_for(device: str, link: str | None = None) -> LinkSpec:
    """The link named `link`, or the one `device`'s servers use (PCIe 4 if unknown)."""
    name = link or DEVICE_LINKS.get(device, "pcie4")
    if name not in LINKS:
        raise ValueError(f"unknown link {name!r}: choose one of {', '.join(LINKS)}")
    return LINKS[name]
