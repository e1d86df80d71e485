"""Where a worker's engine runs: the device of its weights, KV pool and every forward's tensors.

`PDS_DEVICE` (`config.DeviceKind`) picks it per worker. The dtype follows the device: fp32 on the CPU
(torch's bf16 GEMM runs ~1 GFLOP/s here against 100-240 in fp32), bf16 on CUDA. The code paths that
differ by device are few and named: `linear.Linear` (oneDNN's prepacked GEMM on the CPU, `F.linear`
elsewhere), `Sampler.sample` (draws on the CPU with the request's seeded generator), and the compatibility
descriptor's `memory` (workers pair only with peers of the same memory type: the KV transports here move
host memory).
"""

from __future__ import annotations

import torch

CPU = torch.device("cpu")


def engine_dtype(device: torch.device) -> torch.dtype:
    """The dtype an engine runs in on `device`: torch.bfloat16 on CUDA, torch.float32 elsewhere."""
    return torch.bfloat16 if device.type == "cuda" else torch.float32
