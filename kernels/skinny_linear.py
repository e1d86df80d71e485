"""`x @ weight.T (+ residual)` by the C kernel csrc/skinny_linear.c, from a packed copy of the weight (`pack`:
panels of `panel_width()` output features, each [in_features][panel_width]) streamed once per call, the
next panel prefetched while one is read: a decode step's GEMMs (a few rows, bound by reading the weights)
and a short prefill's. engine/linear.py takes it for the row counts where it measured fastest on this
machine (`calibrate_paths`)."""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch

from pdserve.kernels import native


@functools.cache
def skinny_kernel() -> Callable[..., int] | None:
    """The C kernel, built on the first call; None where it cannot be built (kernels/native.py)."""
    i64, ptr = native.I64, native.PTR
    # x, x_stride, panels, n, k, residual (or NULL), out, rows, num_threads (csrc/skinny_linear.c)
    return native.bind("skinny_linear", [ptr, i64, ptr, i64, i64, ptr, ptr, i64, native.INT])


@functools.cache
def _pack_kernel() -> Callable[..., int] | None:
    # w, n, k, panels, num_threads (csrc/skinny_linear.c)
    return native.bind("skinny_linear", [native.PTR, native.I64, native.I64, native.PTR, native.INT],
                       symbol="skinny_pack")


@functools.cache
def panel_width() -> int:
    """Output features per panel of the packed weight: 32 with AVX-512, 16 without (csrc/skinny_linear.c)."""
    width = native.bind("skinny_linear", [], symbol="skinny_panel_width")
    assert width is not None, "call only where skinny_kernel() is built"
    return width()


def takes_weight(weight: torch.Tensor) -> bool:
    """Whether the kernel can take `weight` [n, k] (whatever x): 2-D fp32 on the CPU and the kernel built.
    A layer asks once, at load."""
    return weight.dim() == 2 and native.cpu_fp32(weight) and skinny_kernel() is not None


def takes_rows(x: torch.Tensor) -> bool:
    """Whether the kernel can take `x` [rows, k]: fp32 on the CPU, one row or more, each row contiguous
    (rows may be strided)."""
    return x.dim() == 2 and x.shape[0] >= 1 and x.stride(1) == 1 and native.cpu_fp32(x)


def pack(weight: torch.Tensor) -> torch.Tensor:
    """The kernel's copy of `weight` [n, k] (where `takes_weight`): [ceil(n / panel_width()), k,
    panel_width()] fp32, panel p holding output features p * panel_width() onwards, transposed, the last
    zero-padded. On `torch.get_num_threads()` threads."""
    pack_c = _pack_kernel()
    assert pack_c is not None and takes_weight(weight)
    (n, k), width = weight.shape, panel_width()
    weight = weight.contiguous()
    panels = torch.empty(-(-n // width), k, width, dtype=torch.float32)
    pack_c(weight.data_ptr(), n, k, panels.data_ptr(), torch.get_num_threads())
    return panels


def skinny_linear(x: torch.Tensor, panels: torch.Tensor, n: int,
                  residual: torch.Tensor | None = None) -> torch.Tensor:
    """`residual + x @ weight.T` as a new [rows, n] fp32 tensor, `panels` = `pack(weight)` of the [n, k]
    weight and `residual` [rows, n] (made contiguous) or None for none; on `torch.get_num_threads()`
    threads. Call only where `takes_rows(x)`; raises ValueError when `panels` is not a packed [n, k]
    weight or the kernel refuses the shapes."""
    kernel = skinny_kernel()
    assert kernel is not None
    rows, k = x.shape
    if panels.dim() != 3 or panels.shape[1] != k or not 0 < n <= panels.shape[0] * panels.shape[2]:
        raise ValueError(f"panels {tuple(panels.shape)} are no packed weight of {n} x {k}")
    out = torch.empty(rows, n, dtype=torch.float32)
    if residual is not None:
        residual = residual.contiguous()
    status = kernel(x.data_ptr(), x.stride(0), panels.data_ptr(), n, k,
                    residual.data_ptr() if residual is not None else None, out.data_ptr(), rows,
                    torch.get_num_threads())
    if status:
        raise ValueError(f"skinny_linear refused {rows} rows of {k} against {n} outputs")
    return out
