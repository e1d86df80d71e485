"""`x @ weight.T (+ residual)` for 1-8 rows of x by the C kernel csrc/skinny_linear.c: a decode step's GEMMs,
bound by reading the weights, streamed once from the weight as loaded. engine/linear.py takes it for the
row counts where it measured fastest on this machine (`calibrate_paths`)."""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch

from pdserve.kernels import native

MAX_ROWS = 8


@functools.cache
def skinny_kernel() -> Callable[..., int] | None:
    """The C kernel, built on the first call; None where it cannot be built (kernels/native.py)."""
    i64, ptr = native.I64, native.PTR
    # x, x_stride, w, n, k, residual (or NULL), out, rows, row_pairs, num_threads (csrc/skinny_linear.c)
    return native.bind("skinny_linear", [ptr, i64, ptr, i64, i64, ptr, ptr, i64, native.INT, native.INT])


def takes_weight(weight: torch.Tensor) -> bool:
    """Whether the kernel can take `weight` [n, k] (whatever x): contiguous fp32 on the CPU, k a multiple of
    16, and the kernel built. A layer asks once, at load."""
    return (weight.dim() == 2 and native.cpu_fp32(weight) and weight.is_contiguous()
            and weight.shape[1] % 16 == 0 and skinny_kernel() is not None)


def takes_rows(x: torch.Tensor) -> bool:
    """Whether the kernel can take `x` [rows, k] against a weight it takes: fp32 on the CPU, 1-8 rows, each
    row contiguous (rows may be strided)."""
    return x.dim() == 2 and 1 <= x.shape[0] <= MAX_ROWS and x.stride(1) == 1 and native.cpu_fp32(x)


def usable(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether the kernel can take `x` [rows, k] against `weight` [n, k] (`takes_weight` and `takes_rows`)."""
    return takes_weight(weight) and takes_rows(x)


def skinny_linear(x: torch.Tensor, weight: torch.Tensor, residual: torch.Tensor | None = None,
                  row_pairs: bool = True) -> torch.Tensor:
    """`residual + x @ weight.T` (`residual` [rows, n] contiguous, or None for none) as a new [rows, n] fp32
    tensor, on `torch.get_num_threads()` threads. `row_pairs`: the weight read two rows at a time with a
    software prefetch, else one row at a time as one linear stream (the same sums, in the same order;
    which is faster depends on the CPU: csrc/skinny_linear.c). Call only where `usable(x, weight)`;
    raises ValueError when the kernel refuses the shapes."""
    kernel = skinny_kernel()
    assert kernel is not None
    rows, (n, k) = x.shape[0], weight.shape
    out = torch.empty(rows, n, dtype=torch.float32)
    if residual is not None:
        residual = residual.contiguous()
    status = kernel(x.data_ptr(), x.stride(0), weight.data_ptr(), n, k,
                    residual.data_ptr() if residual is not None else None, out.data_ptr(), rows,
                    int(row_pairs), torch.get_num_threads())
    if status:
        raise ValueError(f"skinny_linear refused {rows} rows of {k} against {n} outputs")
    return out
