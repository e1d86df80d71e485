"""Published peak numbers of well-known accelerators, each with the datasheet it comes from.

Dense tensor-core FLOP/s per dtype (without 2:4 structured sparsity, which datasheets often quote as the
headline: it doubles the figure and no dense GEMM reaches it), memory bandwidth and capacity, per GPU.
`pdserve profile` scales these by the efficiency the engine reaches on this machine's own roofline
(`pdserve.sim.roofline`); the simulator never uses a peak unscaled.

Units: FLOP/s, bytes/s (decimal: 1 TB/s = 1e12 B/s, as the datasheets), bytes (decimal GB).
"""

from __future__ import annotations

from dataclasses import dataclass, field

T = 1e12  # tera
G = 1e9


@dataclass(frozen=True)
class Accelerator:
    """One accelerator's published peaks. `flops`: dtype ('fp32', 'tf32', 'bf16', 'fp16', 'fp8') → dense
    FLOP/s; `memory_bytes_per_s`: HBM (or GDDR) bandwidth; `memory_bytes`: capacity; `scale_up_bytes_per_s`:
    the GPU-to-GPU bandwidth a tensor-parallel all-reduce runs over, per direction (half the datasheet's
    bidirectional figure); `source`: the datasheet URL every number is read from; `note`: how it was read
    (variant, which column)."""

    name: str
    flops: dict[str, float]
    memory_bytes_per_s: float
    memory_bytes: float
    source: str
    note: str = ""
    aliases: tuple[str, ...] = field(default=())
    scale_up_bytes_per_s: float = 0.0  # GPU-to-GPU (NVLink / Infinity Fabric / PCIe) per direction

    def peak_flops(self, dtype: str) -> float:
        """Dense FLOP/s in `dtype`. Raises KeyError naming the dtypes the datasheet gives."""
        try:
            return self.flops[dtype]
        except KeyError:
            raise KeyError(
                f"{self.name} has no published {dtype} peak; it lists {sorted(self.flops)}"
            ) from None


ACCELERATORS: dict[str, Accelerator] = {
    a.name: a
    for a in (
        Accelerator(
            "h100-sxm",
            {"fp32": 67 * T, "tf32": 494.5 * T, "bf16": 989.5 * T, "fp16": 989.5 * T, "fp8": 1979 * T},
            3.35 * T,
            80 * G,
            "https://www.nvidia.com/en-us/data-center/h100/",
            "H100 SXM column; the datasheet's tensor figures are with sparsity (TF32 989, BF16 1,979, "
            "FP8 3,958): "
            "halved here; NVLink 900 GB/s bidirectional",
            ("h100",),
            scale_up_bytes_per_s=450 * G,
        ),
        Accelerator(
            "h200",
            {"fp32": 67 * T, "tf32": 494.5 * T, "bf16": 989.5 * T, "fp16": 989.5 * T, "fp8": 1979 * T},
            4.8 * T,
            141 * G,
            "https://www.nvidia.com/en-us/data-center/h200/",
            "H200 SXM column (same GH100 compute as H100 SXM, HBM3e); tensor figures quoted with sparsity, "
            "halved; NVLink 900 GB/s",
            ("h200-sxm",),
            scale_up_bytes_per_s=450 * G,
        ),
        Accelerator(
            "a100-80gb",
            {"fp32": 19.5 * T, "tf32": 156 * T, "bf16": 312 * T, "fp16": 312 * T},
            2.039 * T,
            80 * G,
            "https://www.nvidia.com/en-us/data-center/a100/",
            "A100 80GB SXM column: dense figures (the datasheet gives sparse ones after a slash); no FP8; "
            "NVLink 600 GB/s",
            ("a100",),
            scale_up_bytes_per_s=300 * G,
        ),
        Accelerator(
            "b200",
            {"fp32": 80 * T, "tf32": 1100 * T, "bf16": 2250 * T, "fp16": 2250 * T, "fp8": 4500 * T},
            8.0 * T,
            180 * G,
            "https://www.nvidia.com/en-us/data-center/hgx/",
            "HGX B200 (1,000 W) per GPU: the 8-GPU board's sparse totals (FP8 72 PFLOPS, BF16 36, 1.44 "
            "TB HBM3e, "
            "64 TB/s) divided by 8 and by 2 for dense; NVLink 5 1.8 TB/s",
            ("hgx-b200",),
            scale_up_bytes_per_s=900 * G,
        ),
        Accelerator(
            "mi300x",
            {"fp32": 163.4 * T, "tf32": 653.7 * T, "bf16": 1307.4 * T, "fp16": 1307.4 * T, "fp8": 2614.9 * T},
            5.3 * T,
            192 * G,
            "https://www.amd.com/en/products/accelerators/instinct/mi300/mi300x.html",
            "AMD's dense matrix figures (sparsity doubles them); FP32 is the matrix peak; Infinity "
            "Fabric 896 GB/s "
            "peer aggregate",
            (),
            scale_up_bytes_per_s=448 * G,
        ),
        Accelerator(
            "l40s",
            {"fp32": 91.6 * T, "tf32": 183 * T, "bf16": 362.05 * T, "fp16": 362.05 * T, "fp8": 733 * T},
            0.864 * T,
            48 * G,
            "https://www.nvidia.com/en-us/data-center/l40s/",
            "tensor figures quoted with sparsity (TF32 366, BF16 733, FP8 1,466): halved; GDDR6 with "
            "ECC; no NVLink: PCIe Gen4 x16, 32 GB/s per direction",
            (),
            scale_up_bytes_per_s=32 * G,
        ),
    )
}


def accelerator(name: str) -> Accelerator:
    """The accelerator called `name` (or one of its aliases), case-insensitive. Raises KeyError listing the
    known ones."""
    key = name.lower()
    for acc in ACCELERATORS.values():
        if key == acc.name or key in acc.aliases:
            return acc
    raise KeyError(f"unknown accelerator {name!r}; known: {', '.join(ACCELERATORS)}")
