"""Dense layers `y = x @ weight.T` in fp32: each row count on the GEMM this machine runs fastest.

torch's default CPU GEMM is MKL's, and MKL runs a generic code path on AMD EPYC: measured there (torch 2.13,
one thread, SmolLM2's layer shapes; `benchmarks/engine.py` prints both GEMM rates each run), `F.linear`
reaches ~90-100 GFLOP/s at 32 or more rows, while oneDNN with the weight reordered into its own blocked
layout (`mkldnn._reorder_linear_weight`, what Inductor's CPU freezing pass does) reaches 170-240 GFLOP/s
on the same shapes and results equal to fp32 rounding (max |difference| ~1e-6 relative). One prepacked
weight serves every row count: the batch-size hint (32) only picks oneDNN's blocking.

A decode step's GEMMs have as many rows as sequences and are bound by reading the weights, and there the
best path depends on the CPU: on an Intel Xeon host (two threads, SmolLM2's 30 layers, weights read from
memory) MKL's `F.linear` streams them at 25 GB/s for one row (oneDNN 19) but 11 GB/s for eight (oneDNN 16).
The C kernel kernels/csrc/skinny_linear.c reads a packed copy of each weight as one stream and keeps
whole outputs in its accumulators: on an AMD EPYC host (AVX-512, two threads, SmolLM2's weights) 28-32
GB/s for 1-8 rows where oneDNN read 22-25 (the kernel's header has the figures). So
`calibrate_paths` times the three on the model's LM head for 1 to 8 rows when the model is built and
keeps, per row count, the fastest; more rows always take oneDNN. The plain weight is kept for MKL and
the kernel's copy beside oneDNN's (the layer's weights three times in memory: +1.08 GB for SmolLM2 fp32).
Where oneDNN is absent (or for a CUDA tensor) the layer is plain `F.linear`.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from pdserve.kernels import skinny_linear as skinny

log = logging.getLogger(__name__)

_BATCH_HINT = 32  # rows oneDNN blocks for; measured equal or better than 1 and 512 at every row count here
# F.linear on the plain weight; the C kernel on its packed copy; oneDNN on its prepacked copy
MKL, SKINNY, ONEDNN = "mkl", "skinny", "onednn"
# The path of each row count up to skinny.MAX_ROWS (more rows: oneDNN); `calibrate_paths` sets it.
_PATHS: dict[int, str] = {1: MKL, 2: MKL}


def _onednn_usable(weight: torch.Tensor) -> bool:
    cpu_fp32 = weight.device.type == "cpu" and weight.dtype == torch.float32
    return cpu_fp32 and torch.backends.mkldnn.is_available()


class Linear:
    """`weight`: [out_features, in_features] fp32 (HF layout, no bias). Calls take `x`: [rows, in_features]
    and return [rows, out_features] in x's dtype; `x` may be a strided view. Each row count takes the path
    `_PATHS` names (oneDNN's on a prepacked copy of `weight` past it); the C kernel, where a row of x is
    not contiguous, falls back to oneDNN.
    """

    def __init__(self, weight: torch.Tensor) -> None:
        self.out_features, self.in_features = weight.shape
        self.weight = weight.contiguous()
        self._packed = (torch.ops.mkldnn._reorder_linear_weight(self.weight, _BATCH_HINT)
                        if _onednn_usable(weight) else None)
        # the C kernel's copy, only beside oneDNN's (without oneDNN every call is F.linear's)
        packable = self._packed is not None and skinny.takes_weight(self.weight)
        self._panels = skinny.pack(self.weight) if packable else None

    def _path(self, x: torch.Tensor) -> str:
        if self._packed is None:
            return MKL
        path = _PATHS.get(x.shape[0], ONEDNN)
        return ONEDNN if path == SKINNY and not (self._panels is not None and skinny.takes_rows(x)) else path

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        path = self._path(x)
        if path == ONEDNN:
            return torch.ops.mkldnn._linear_pointwise(x, self._packed, None, "none", [], "")
        if path == SKINNY:
            return skinny.skinny_linear(x, self._panels, self.out_features)
        return F.linear(x, self.weight)

    def add(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        """`residual + x @ weight.T` (a new tensor), the sum fused into the GEMM's output on oneDNN and in
        the C kernel."""
        path = self._path(x)
        if path == ONEDNN:
            return torch.ops.mkldnn._linear_pointwise.binary(x, residual, self._packed, None, "add")
        if path == SKINNY:
            return skinny.skinny_linear(x, self._panels, self.out_features, residual)
        return torch.add(residual, F.linear(x, self.weight))


def fused(*weights: torch.Tensor) -> Linear:
    """One Linear whose output is the given layers' outputs side by side (their weights stacked on dim 0),
    e.g. q, k and v projections as one GEMM: `out[:, :q_out]` is q's, and so on."""
    return Linear(torch.cat(weights, dim=0))


def best_time_s(fn: Callable[[], object], reps: int) -> float:
    """The fastest of `reps` timed calls of `fn` after one untimed (warm-up) call, seconds."""
    fn()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def fastest(candidates: dict[str, Callable[[], object]], reps: int) -> str:
    """The name of the candidate whose best of `reps` timed calls is the least, after one untimed call of
    each; the calls taken in turn (each candidate once, then again), so a slow spell of a shared machine
    slows them all rather than one."""
    for fn in candidates.values():
        fn()
    best = dict.fromkeys(candidates, float("inf"))
    for _ in range(reps):
        for name, fn in candidates.items():
            t0 = time.perf_counter()
            fn()
            best[name] = min(best[name], time.perf_counter() - t0)
    return min(best, key=best.__getitem__)


def calibrate_paths(layer: Linear, reps: int = 5) -> dict[int, str]:
    """Set, for this process, the path (MKL, SKINNY or ONEDNN) of every Linear's calls of 1 to
    skinny.MAX_ROWS rows: each timed on `layer` (`fastest`: best of `reps`, the paths in turn), the fastest
    kept. Give it the LM head: big enough to be read from memory as a decode step reads every weight
    (SmolLM2's: 113 MB; ~1 s in all). Returns the table; without oneDNN, leaves it as it is."""
    global _PATHS
    if layer._packed is None:
        return dict(_PATHS)
    packed_weight, panels, gemm = layer._packed, layer._panels, torch.ops.mkldnn._linear_pointwise
    paths: dict[int, str] = {}
    for m in range(1, skinny.MAX_ROWS + 1):
        # a generator of its own: the process's torch RNG (sampling seeds) is left as it was
        x = torch.randn(m, layer.in_features, generator=torch.Generator().manual_seed(m))
        candidates: dict[str, Callable[[], object]] = {
            MKL: lambda x=x: F.linear(x, layer.weight),
            ONEDNN: lambda x=x: gemm(x, packed_weight, None, "none", [], ""),
        }
        if panels is not None:
            candidates[SKINNY] = lambda x=x: skinny.skinny_linear(x, panels, layer.out_features)
        paths[m] = fastest(candidates, reps)
    _PATHS = paths
    log.info("GEMM path by rows: %s; more rows: %s", paths, ONEDNN)
    return dict(paths)
