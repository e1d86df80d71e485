"""The interconnect table: every link a KV transfer between a prefill and a decode worker can ride, with its
bandwidth and latency and where each number comes from.

Two bandwidths per link, both in GB/s = 10^9 bytes/s, one direction:

- `line_rate_GB_s`: the published signalling rate (the vendor's datasheet or the standard), after line coding.
- `achievable_GB_s`: what a bulk transfer plans on. For NVLink 4, InfiniBand NDR, RoCE 100G and 25G Ethernet
  these are the planning figures of the disaggregation checklist's transfer table (370 / 50 / 12 / 3 GB/s;
  quoted in docs/advise.md), so `kv_transfer_s` reproduces its 1.7 / 12.8 / 53 / 213 ms for 640 MB. For the
  two links of this machine they are measured (docs/benchmarks/transfer.md, 256 MiB, 32 layers, xxh3 per
  layer). Elsewhere the source says how it was derived.

`latency_s` is the one-way small-message latency a transfer pays once (per message it is hidden by
pipelining); the figures are orders of magnitude from the cited sources, not measurements of this machine.

`rdma_class` marks links that move bytes without the kernel's TCP stack on the path (NVLink, InfiniBand, RoCE,
and UCX over shared memory, which copies process to process with CMA): the checklist's first question
("Do you have RDMA-class interconnect?").
"""

from __future__ import annotations

import math
from typing import Literal

from pydantic import BaseModel, ConfigDict

LinkKind = Literal["nvlink", "pcie", "infiniband", "roce", "ethernet", "loopback"]

GB = 1e9

_CHECKLIST = "the disaggregation checklist's transfer table (docs/advise.md)"


class Link(BaseModel):
    """One interconnect. Bandwidths in GB/s (10^9 B/s) per direction; latency in seconds."""

    model_config = ConfigDict(frozen=True)

    name: str
    kind: LinkKind
    line_rate_GB_s: float
    line_rate_source: str
    achievable_GB_s: float
    achievable_source: str
    latency_s: float
    latency_source: str
    rdma_class: bool

    def transfer_s(self, num_bytes: float) -> float:
        """Seconds to move `num_bytes` as one bulk transfer: latency + bytes / achievable bandwidth."""
        return self.latency_s + num_bytes / (self.achievable_GB_s * GB)


# NVLink 4's planning figure as a fraction of its line rate; NVLink 5 is given the same fraction.
_NVLINK_FRACTION = 370.0 / 450.0

LINKS: tuple[Link, ...] = (
    Link(
        name="NVLink 5",
        kind="nvlink",
        line_rate_GB_s=900.0,
        line_rate_source="NVIDIA Blackwell (B200/GB200) datasheet: NVLink 5 1.8 TB/s per GPU, "
        "both directions",
        achievable_GB_s=round(900.0 * _NVLINK_FRACTION, 1),
        achievable_source="line rate × 370/450, NVLink 4's planning fraction in " + _CHECKLIST,
        latency_s=2e-6,
        latency_source="order of a few µs GPU to GPU through NVSwitch (NCCL small-message latency)",
        rdma_class=True,
    ),
    Link(
        name="NVLink 4",
        kind="nvlink",
        line_rate_GB_s=450.0,
        line_rate_source="NVIDIA H100 SXM datasheet: NVLink 4 900 GB/s per GPU, both directions",
        achievable_GB_s=370.0,
        achievable_source=_CHECKLIST + ": 'NVLink (same node): 370 GB/s'",
        latency_s=2e-6,
        latency_source="order of a few µs GPU to GPU through NVSwitch (NCCL small-message latency)",
        rdma_class=True,
    ),
    Link(
        name="PCIe 5.0 x16",
        kind="pcie",
        line_rate_GB_s=63.0,
        line_rate_source="PCI-SIG PCIe 5.0: 32 GT/s × 16 lanes × 128/130 coding / 8 = 63.0 GB/s",
        achievable_GB_s=63.0,
        achievable_source="line rate (no achieved figure taken: an upper bound)",
        latency_s=1e-6,
        latency_source="order of 1 µs host to device round trip (PCIe TLP + DMA setup)",
        rdma_class=False,
    ),
    Link(
        name="PCIe 4.0 x16",
        kind="pcie",
        line_rate_GB_s=31.5,
        line_rate_source="PCI-SIG PCIe 4.0: 16 GT/s × 16 lanes × 128/130 coding / 8 = 31.5 GB/s",
        achievable_GB_s=31.5,
        achievable_source="line rate (no achieved figure taken: an upper bound)",
        latency_s=1e-6,
        latency_source="order of 1 µs host to device round trip (PCIe TLP + DMA setup)",
        rdma_class=False,
    ),
    Link(
        name="InfiniBand NDR",
        kind="infiniband",
        line_rate_GB_s=50.0,
        line_rate_source="InfiniBand NDR 400 Gb/s per port (NVIDIA ConnectX-7 / Quantum-2) / 8",
        achievable_GB_s=50.0,
        achievable_source=_CHECKLIST + ": 'InfiniBand NDR (400G): 50 GB/s'",
        latency_s=1e-6,
        latency_source="NVIDIA ConnectX-7 product brief: RDMA latency under 1 µs end to end (order of)",
        rdma_class=True,
    ),
    Link(
        name="InfiniBand HDR",
        kind="infiniband",
        line_rate_GB_s=25.0,
        line_rate_source="InfiniBand HDR 200 Gb/s per port (NVIDIA ConnectX-6 / Quantum) / 8",
        achievable_GB_s=25.0,
        achievable_source="line rate, as the checklist plans NDR at its line rate",
        latency_s=1e-6,
        latency_source="NVIDIA ConnectX-6 product brief: sub-600 ns adapter latency; ~1 µs through a switch",
        rdma_class=True,
    ),
    Link(
        name="RoCE 400G",
        kind="roce",
        line_rate_GB_s=50.0,
        line_rate_source="IEEE 802.3bs 400GbE / 8",
        achievable_GB_s=round(50.0 * 12.0 / 12.5, 1),
        achievable_source="line rate × 12/12.5, RoCE 100G's planning fraction in " + _CHECKLIST,
        latency_s=2e-6,
        latency_source="order of 2 µs RoCEv2 one-way through one switch (ConnectX class NICs)",
        rdma_class=True,
    ),
    Link(
        name="RoCE 200G",
        kind="roce",
        line_rate_GB_s=25.0,
        line_rate_source="IEEE 802.3bs 200GbE / 8",
        achievable_GB_s=round(25.0 * 12.0 / 12.5, 1),
        achievable_source="line rate × 12/12.5, RoCE 100G's planning fraction in " + _CHECKLIST,
        latency_s=2e-6,
        latency_source="order of 2 µs RoCEv2 one-way through one switch (ConnectX class NICs)",
        rdma_class=True,
    ),
    Link(
        name="RoCE 100G",
        kind="roce",
        line_rate_GB_s=12.5,
        line_rate_source="IEEE 802.3ba/bj 100GbE / 8",
        achievable_GB_s=12.0,
        achievable_source=_CHECKLIST + ": 'RoCE 100G: 12 GB/s'",
        latency_s=2e-6,
        latency_source="order of 2 µs RoCEv2 one-way through one switch (ConnectX class NICs)",
        rdma_class=True,
    ),
    Link(
        name="Ethernet 100G (TCP)",
        kind="ethernet",
        line_rate_GB_s=12.5,
        line_rate_source="IEEE 802.3ba/bj 100GbE / 8",
        achievable_GB_s=12.0,
        achievable_source="line rate × 12/12.5, the checklist's 100G planning fraction (many TCP streams)",
        latency_s=25e-6,
        latency_source="order of 25 µs through the kernel TCP stack and one switch",
        rdma_class=False,
    ),
    Link(
        name="Ethernet 25G (TCP)",
        kind="ethernet",
        line_rate_GB_s=3.125,
        line_rate_source="IEEE 802.3by 25GbE / 8",
        achievable_GB_s=3.0,
        achievable_source=_CHECKLIST + ": 'Ethernet 25G (no RDMA): 3 GB/s'",
        latency_s=25e-6,
        latency_source="order of 25 µs through the kernel TCP stack and one switch",
        rdma_class=False,
    ),
    Link(
        name="UCX shared memory (this machine)",
        kind="loopback",
        line_rate_GB_s=12.5,
        line_rate_source="numpy memcpy 256 MiB measured in the same run (docs/benchmarks/transfer.md)",
        achievable_GB_s=4.15,
        achievable_source="pdserve's ucxx transport, 256 MiB as 32 checksummed layers "
        "(docs/benchmarks/transfer.md)",
        latency_s=1e-6,
        latency_source="order of 1 µs per message for UCX's shared-memory transports (ucx_perftest)",
        rdma_class=True,
    ),
    Link(
        name="loopback TCP (this machine)",
        kind="loopback",
        line_rate_GB_s=12.5,
        line_rate_source="numpy memcpy 256 MiB measured in the same run (docs/benchmarks/transfer.md)",
        achievable_GB_s=2.82,
        achievable_source="pdserve's asyncio TCP transport, 256 MiB as 32 checksummed layers "
        "(docs/benchmarks/transfer.md)",
        latency_s=10e-6,
        latency_source="order of 10 µs per round trip over the Linux loopback device",
        rdma_class=False,
    ),
)

# The four rows of the checklist's transfer table, in its order.
CHECKLIST_LINKS: tuple[str, ...] = ("NVLink 4", "InfiniBand NDR", "RoCE 100G", "Ethernet 25G (TCP)")


def link(name: str) -> Link:
    """The link called `name` (exact, case-insensitive). Raises KeyError naming the known ones."""
    for candidate in LINKS:
        if candidate.name.lower() == name.lower():
            return candidate
    raise KeyError(f"unknown link {name!r}; known: {', '.join(c.name for c in LINKS)}")


class LinkMatch(BaseModel):
    """A measured bandwidth placed against the table: the nearest link, and the fastest one it reaches."""

    model_config = ConfigDict(frozen=True)

    measured_GB_s: float
    nearest: Link  # smallest |log(measured / achievable)|
    fastest_reached: Link | None  # the fastest link whose achievable bandwidth ≤ measured (None: below all)
    rdma_class: bool  # measured ≥ the slowest RDMA-class fabric link's achievable (RoCE 100G)


def classify(measured_GB_s: float) -> LinkMatch:
    """Place a measured transfer bandwidth (GB/s, > 0) against the fabric links of the table (this machine's
    loopback rows excluded: they are what is being classified). `rdma_class` is True when it reaches RoCE
    100G's 12 GB/s, the slowest RDMA-class fabric in the table. Raises ValueError on a bandwidth ≤ 0."""
    if not measured_GB_s > 0:
        raise ValueError(f"measured bandwidth must be > 0 GB/s, got {measured_GB_s}")
    fabric = [c for c in LINKS if c.kind != "loopback"]
    nearest = min(fabric, key=lambda c: abs(math.log(measured_GB_s / c.achievable_GB_s)))
    reached = [c for c in fabric if c.achievable_GB_s <= measured_GB_s]
    fastest = max(reached, key=lambda c: c.achievable_GB_s) if reached else None
    slowest_rdma = min((c for c in fabric if c.rdma_class), key=lambda c: c.achievable_GB_s)
    return LinkMatch(
        measured_GB_s=measured_GB_s,
        nearest=nearest,
        fastest_reached=fastest,
        rdma_class=measured_GB_s >= slowest_rdma.achievable_GB_s,
    )
