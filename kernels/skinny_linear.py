"""`x @ weight.T (+ residual)` by the C kernel csrc/skinny_linear.c, from a packed copy of the weight (`pack`:
panels of `panel_width()` output features, each [in_features][panel_width]) streamed once per call, the
next panel prefetched while one is read: a decode step's GEMMs (a few rows, bound by reading the weights)
and a short prefill's. engine/linear.py takes it for the row counts where it measured fastest on this
machine (`calibrate_paths`). `pack_gated` and `skinny_gated_linear` are the same kernel on SwiGLU's fused
gate/up weight with the activation in the GEMM's epilogue: `silu(x @ gate.T) * (x @ up.T)`."""

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
def _gated_kernel() -> Callable[..., int] | None:
    i64, ptr = native.I64, native.PTR
    # x, x_stride, panels, d, k, out, rows, num_threads (csrc/skinny_linear.c)
    return native.bind("skinny_linear", [ptr, i64, ptr, i64, i64, ptr, i64, native.INT],
                       symbol="skinny_gated_linear")


@functools.cache
def _pack_gated_kernel() -> Callable[..., int] | None:
    # w, d, k, panels, num_threads (csrc/skinny_linear.c)
    return native.bind("skinny_linear", [native.PTR, native.I64, native.I64, native.PTR, native.INT],
                       symbol="skinny_pack_gated")


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


def pack_gated(weight: torch.Tensor) -> torch.Tensor:
    """The gated kernel's copy of SwiGLU's fused `weight` [2 d, k] (gate's d rows, then up's; where
    `takes_weight`): [ceil(d / half), k, panel_width()] fp32 with half = panel_width() / 2, panel p holding
    gate features p * half onwards in its first half columns and the same up features in the rest,
    transposed, the last zero-padded. On `torch.get_num_threads()` threads. Raises ValueError for an odd
    number of rows."""
    pack_c = _pack_gated_kernel()
    assert pack_c is not None and takes_weight(weight)
    if weight.shape[0] % 2:
        raise ValueError(f"a gate/up weight has an even number of rows, not {weight.shape[0]}")
    (two_d, k), width = weight.shape, panel_width()
    d, half = two_d // 2, width // 2
    weight = weight.contiguous()
    panels = torch.empty(-(-d // half), k, width, dtype=torch.float32)
    pack_c(weight.data_ptr(), d, k, panels.data_ptr(), torch.get_num_threads())
    return panels


def skinny_gated_linear(x: torch.Tensor, panels: torch.Tensor, d: int) -> torch.Tensor:
    """`silu(x @ gate.T) * (x @ up.T)` as a new [rows, d] fp32 tensor, `panels` = `pack_gated` of the
    [2 d, k] gate/up weight: SwiGLU (Shazeer 2020, https://arxiv.org/abs/2002.05202) with the activation in
    the GEMM's epilogue, the same values as `silu_and_mul` of the [rows, 2 d] product. On
    `torch.get_num_threads()` threads. Call only where `takes_rows(x)`; raises ValueError when `panels` is no
    packed gate/up weight of d features over x's k."""
    kernel = _gated_kernel()
    assert kernel is not None
    rows, k = x.shape
    half = panels.shape[2] // 2 if panels.dim() == 3 else 0
    if panels.dim() != 3 or panels.shape[1] != k or not 0 < d <= panels.shape[0] * half:
        raise ValueError(f"panels {tuple(panels.shape)} are no packed gate/up weight of {d} x {k}")
    out = torch.empty(rows, d, dtype=torch.float32)
    status = kernel(x.data_ptr(), x.stride(0), panels.data_ptr(), d, k, out.data_ptr(), rows,
                    torch.get_num_threads())
    if status:
        raise ValueError(f"skinny_gated_linear refused {rows} rows of {k} against {d} outputs")
    return out
