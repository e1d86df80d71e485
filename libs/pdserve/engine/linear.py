"""Dense layers `y = x @ weight.T` in fp32, through oneDNN with the weight reordered once at load.

torch's default CPU GEMM is MKL's, and MKL runs a generic code path on this machine's AMD EPYC: measured here
(torch 2.13, one thread, SmolLM2's layer shapes; `benchmarks/engine.py` prints both GEMM rates each run),
`F.linear` reaches ~90-100 GFLOP/s at 32 or more rows, while oneDNN with the weight reordered into its own
blocked layout (`mkldnn._reorder_linear_weight`, what Inductor's CPU freezing pass does) reaches
170-240 GFLOP/s on the same shapes and results equal to fp32 rounding (max |difference| ~1e-6 relative).
One prepacked weight serves every row count from 3 up: the batch-size hint (32) only picks oneDNN's
blocking. At 1 or 2 rows (a decode step of one or two sequences: a GEMV, bound by reading the weights)
MKL's `F.linear` on the weight as loaded is the faster: a SmolLM2 decode step measured 75 → 58 ms at one
sequence and 82 → 67 ms at two on one thread (44 → 35, 46 → 38 ms on two), and slower from 4 rows
(83 → 104 ms), so those rows take the plain weight, kept beside the packed one (the layer's weights twice
in memory: +540 MB for SmolLM2 fp32). Where oneDNN is absent (or for a CUDA tensor) the layer is plain
`F.linear`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

_BATCH_HINT = 32  # rows oneDNN blocks for; measured equal or better than 1 and 512 at every row count here
_GEMV_ROWS = 2  # at most this many rows go to MKL's F.linear on the plain weight (measured above)


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
