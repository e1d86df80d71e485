"""Where a worker's engine runs: the device of its weights, KV pool and every forward's tensors.

`PDS_DEVICE` picks it per worker. The dtype follows the device: fp32 on the CPU (this machine has no fast
bf16 units: ~1 GFLOP/s against ~100-240 in fp32, measured here), bf16 on CUDA. The code paths that differ
by device are few and named: `linear.Linear` (oneDNN's prepacked GEMM on the CPU, `F.linear` elsewhere),
`Sampler.sample` (draws on the CPU with the request's seeded generator), and the KV transfer's staging
(`workers/kv_transfer.py`: a CUDA pool's rows go through host memory, the transports being host-only here).
"""

from __future__ import annotations

from enum import StrEnum

import torch

CPU = torch.device("cpu")


class DeviceKind(StrEnum):
    CPU = "cpu"
    CUDA = "cuda"


def engine_dtype(device: torch.device) -> torch.dtype:
    """The dtype an engine runs in on `device`: torch.bfloat16 on CUDA, torch.float32 elsewhere."""
    return torch.bfloat16 if device.type == "cuda" else torch.float32
