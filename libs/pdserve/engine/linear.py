"""Dense layers `y = x @ weight.T` in fp32, through oneDNN with the weight reordered once at load.

torch's default CPU GEMM is MKL's, and MKL runs a generic code path on this machine's AMD EPYC: measured here
(torch 2.13, one thread, SmolLM2's layer shapes; `benchmarks/engine.py` prints both GEMM rates each run),
`F.linear` reaches ~90-100 GFLOP/s at 32 or more rows, while oneDNN with the weight reordered into its own
blocked layout (`mkldnn._reorder_linear_weight`, what Inductor's CPU freezing pass does) reaches
170-240 GFLOP/s on the same shapes and results equal to fp32 rounding (max |difference| ~1e-6 relative).
One prepacked weight serves every row count: the batch-size hint (32) only picks oneDNN's blocking.
Where oneDNN is absent (or for a CUDA tensor) the layer is plain `F.linear`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

_BATCH_HINT = 32  # rows oneDNN blocks for; measured equal or better than 1 and 512 at every row count here


def _onednn_usable(weight: torch.Tensor) -> bool:
    cpu_fp32 = weight.device.type == "cpu" and weight.dtype == torch.float32
    return cpu_fp32 and torch.backends.mkldnn.is_available()


class Linear:
    """`weight`: [out_features, in_features] fp32 (HF layout, no bias). Calls take `x`: [rows, in_features]
    and return [rows, out_features] in x's dtype; `x` may be a strided view. The weight is copied into the
    prepacked layout; the tensor given is not kept (nor changed) on the oneDNN path.
    """

    def __init__(self, weight: torch.Tensor) -> None:
        self.out_features, self.in_features = weight.shape
        self._onednn = _onednn_usable(weight)
        if self._onednn:
            self.weight = torch.ops.mkldnn._reorder_linear_weight(weight.contiguous(), _BATCH_HINT)
        else:
            self.weight = weight

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self._onednn:
            return torch.ops.mkldnn._linear_pointwise(x, self.weight, None, "none", [], "")
        return F.linear(x, self.weight)

    def add(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        """`residual + x @ weight.T` (a new tensor), the sum fused into the GEMM's output on oneDNN."""
        if self._onednn:
            return torch.ops.mkldnn._linear_pointwise.binary(x, residual, self.weight, None, "add")
        return torch.add(residual, F.linear(x, self.weight))


def fused(*weights: torch.Tensor) -> Linear:
    """One Linear whose output is the given layers' outputs side by side (their weights stacked on dim 0),
    e.g. q, k and v projections as one GEMM: `out[:, :q_out]` is q's, and so on."""
    return Linear(torch.cat(weights, dim=0))
