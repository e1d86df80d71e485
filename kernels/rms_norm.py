"""RMSNorm (Zhang & Sennrich 2019, https://arxiv.org/abs/1910.07467) as Llama uses it."""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch

from pdserve.kernels import native


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """`weight * x / sqrt(mean(x**2, -1) + eps)` over the last dimension.

    x: [..., hidden] fp32; weight: [hidden] fp32; returns a new contiguous tensor of x's shape. The order of
    operations follows HF's `LlamaRMSNorm` (normalize, then scale) so results agree to rounding. Computed by
    the C kernel (csrc/rms_norm.c) on `torch.get_num_threads()` threads where it is built and x is [rows,
    hidden] with contiguous rows (rows may be strided) or contiguous, both fp32 on the CPU; else by torch.
    """
    kernel = native_kernel()
    rows = _rows(x)
    if kernel is None or rows is None or not (native.cpu_fp32(x, weight) and weight.is_contiguous()):
        variance = x.pow(2).mean(-1, keepdim=True)
        return weight * (x * torch.rsqrt(variance + eps))
    out = torch.empty(x.shape, dtype=x.dtype)
    kernel(rows.data_ptr(), rows.stride(0), weight.data_ptr(), out.data_ptr(), rows.shape[0], rows.shape[1],
           eps, torch.get_num_threads())
    return out


def _rows(x: torch.Tensor) -> torch.Tensor | None:
    """x as [rows, hidden] with each row contiguous, without a copy; None where that takes one."""
    if x.dim() == 2 and x.stride(1) == 1:
        return x
    return x.view(-1, x.shape[-1]) if x.is_contiguous() else None


@functools.cache
def native_kernel() -> Callable[..., int] | None:
    """The C kernel, built on the first call; None where it cannot be built (kernels/native.py)."""
    # x, x_stride, weight, out, rows, dim, eps, num_threads (csrc/rms_norm.c)
    i64, ptr = native.I64, native.PTR
    return native.bind("rms_norm", [ptr, i64, ptr, ptr, i64, i64, native.F32, native.INT])
