"""SwiGLU's gate (Shazeer 2020, https://arxiv.org/abs/2002.05202): `silu(gate) * up` from the fused
gate/up GEMM's output, as vLLM's `SiluAndMul`."""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
import torch.nn.functional as F

from pdserve.kernels import native


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """gate_up: [rows, 2 d] fp32, gate in the first d columns, up in the last d; returns `silu(gate) * up`,
    [rows, d], a new contiguous tensor. Computed by the C kernel (csrc/silu_and_mul.c) on
    `torch.get_num_threads()` threads where it is built and gate_up is contiguous fp32 on the CPU; else by
    torch. Raises ValueError when the last dimension is odd."""
    rows, width = gate_up.shape
    if width % 2:
        raise ValueError(f"gate_up has {width} columns: gate and up need an even number")
    d = width // 2
    kernel = native_kernel()
    if kernel is None or not (native.cpu_fp32(gate_up) and gate_up.is_contiguous()):
        return F.silu(gate_up[:, :d]).mul_(gate_up[:, d:])
    out = torch.empty(rows, d, dtype=gate_up.dtype)
    kernel(gate_up.data_ptr(), out.data_ptr(), rows, d, torch.get_num_threads())
    return out


@functools.cache
def native_kernel() -> Callable[..., int] | None:
    """The C kernel, built on the first call; None where it cannot be built (kernels/native.py)."""
    # gate_up, out, rows, d, num_threads (csrc/silu_and_mul.c)
    i64, ptr = native.I64, native.PTR
    return native.bind("silu_and_mul", [ptr, ptr, i64, i64, native.INT])
