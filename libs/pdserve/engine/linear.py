"""Dense layers `y = x @ weight.T` in fp32, through oneDNN with the weight reordered once at load.

torch's default CPU GEMM is MKL's, and MKL runs a generic code path on this machine's AMD EPYC: measured here
(torch 2.13, one thread, SmolLM2's layer shapes; `benchmarks/engine.py` prints both GEMM rates each run),
`F.linear` reaches ~90-100 GFLOP/s at 32 or more rows, while oneDNN with the weight reordered into its own
blocked layout (`mkldnn._reorder_linear_weight`, what Inductor's CPU freezing pass does) reaches
170-240 GFLOP/s on the same shapes and results equal to fp32 rounding (max |difference| ~1e-6 relative).
One prepacked weight serves every row count above the GEMV threshold: the batch-size hint (32) only picks
oneDNN's blocking. At 1 or 2 rows (a decode step of one or two sequences: a GEMV, bound by reading the
weights) MKL's `F.linear` on the weight as loaded can be the faster: on an Intel Xeon host a SmolLM2 decode
step measured 75 → 58 ms at one sequence and 82 → 67 ms at two on one thread (44 → 35, 46 → 38 ms on two),
and slower from 4 rows (83 → 104 ms). Which is faster depends on the CPU (MKL takes a generic path on AMD),
so `calibrate_gemv` times both on the model's LM head when the model is built and sets the threshold (0, 1
or 2 rows) for the process; the plain weight is kept beside the packed one for it (the layer's weights twice
in memory: +540 MB for SmolLM2 fp32). Where oneDNN is absent (or for a CUDA tensor) the layer is plain
`F.linear`.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

log = logging.getLogger(__name__)

_BATCH_HINT = 32  # rows oneDNN blocks for; measured equal or better than 1 and 512 at every row count here
_GEMV_ROWS = 2  # at most this many rows go to MKL's F.linear on the plain weight (`calibrate_gemv` sets it)


def _onednn_usable(weight: torch.Tensor) -> bool:
    cpu_fp32 = weight.device.type == "cpu" and weight.dtype == torch.float32
    return cpu_fp32 and torch.backends.mkldnn.is_available()


class Linear:
    """`weight`: [out_features, in_features] fp32 (HF layout, no bias). Calls take `x`: [rows, in_features]
    and return [rows, out_features] in x's dtype; `x` may be a strided view. `weight` (made contiguous) is
    kept for calls of at most `_GEMV_ROWS` rows; on the oneDNN path a prepacked copy serves the others.
    """

    def __init__(self, weight: torch.Tensor) -> None:
        self.out_features, self.in_features = weight.shape
        self.weight = weight.contiguous()
        self._packed = (torch.ops.mkldnn._reorder_linear_weight(self.weight, _BATCH_HINT)
                        if _onednn_usable(weight) else None)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self._packed is not None and x.shape[0] > _GEMV_ROWS:
            return torch.ops.mkldnn._linear_pointwise(x, self._packed, None, "none", [], "")
        return F.linear(x, self.weight)

    def add(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        """`residual + x @ weight.T` (a new tensor), the sum fused into the GEMM's output on oneDNN."""
        if self._packed is not None and x.shape[0] > _GEMV_ROWS:
            return torch.ops.mkldnn._linear_pointwise.binary(x, residual, self._packed, None, "add")
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


def calibrate_gemv(layer: Linear, reps: int = 5) -> int:
    """Set, for this process, how many rows (0, 1 or 2) every Linear sends to MKL's `F.linear` instead of the
    prepacked oneDNN GEMM: both timed on `layer` at 1, then 2 rows (best of `reps`), the threshold the row
    counts at which the plain path won. Give it the LM head: big enough to be read from memory as a decode
    step reads every weight (SmolLM2's: 113 MB; ~0.3 s in all). Returns the threshold; without oneDNN,
    leaves it as it is."""
    global _GEMV_ROWS
    if layer._packed is None:
        return _GEMV_ROWS
    rows, packed_weight, gemm = 0, layer._packed, torch.ops.mkldnn._linear_pointwise
    for m in (1, 2):
        # a generator of its own: the process's torch RNG (sampling seeds) is left as it was
        x = torch.randn(m, layer.in_features, generator=torch.Generator().manual_seed(m))
        plain = best_time_s(lambda x=x: F.linear(x, layer.weight), reps)
        packed = best_time_s(lambda x=x: gemm(x, packed_weight, None, "none", [], ""), reps)
        if plain >= packed:
            break
        rows = m
    _GEMV_ROWS = rows
    log.info("GEMV threshold: %d rows on MKL's F.linear, more on oneDNN's prepacked GEMM", rows)
    return rows
