"""engine/linear.py: both of a layer's paths — MKL's GEMV on the plain weight for one or two rows, oneDNN's
GEMM on the prepacked weight from three — compute x @ weight.T to fp32 rounding, with and without the
residual sum, on every row count either side of the switch."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pdserve.engine import linear
from pdserve.engine.linear import Linear, calibrate_gemv, fused


@pytest.mark.parametrize("rows", [1, 2, 3, 8, 33])
def test_every_row_count_equals_f_linear_to_fp32_rounding(rows: int, monkeypatch) -> None:
    monkeypatch.setattr(linear, "_GEMV_ROWS", 2)  # 1-2 rows on F.linear, the others prepacked
    g = torch.Generator().manual_seed(rows)
    weight, x, residual = (torch.randn(s, generator=g) for s in ((96, 64), (rows, 64), (rows, 96)))
    layer = Linear(weight)
    want = x.double() @ weight.double().T
    assert layer(x).shape == (rows, 96) and layer(x).dtype == torch.float32
    torch.testing.assert_close(layer(x).double(), want, rtol=1e-5, atol=1e-5)
    summed = layer.add(x, residual).double()
    torch.testing.assert_close(summed, want + residual.double(), rtol=1e-5, atol=1e-5)
    # a strided view of rows (a slice of a bigger batch) takes the same path as a contiguous one
    wide = torch.randn(rows, 128, generator=g)[:, :64]
    torch.testing.assert_close(layer(wide), F.linear(wide.contiguous(), weight), rtol=1e-5, atol=1e-5)


def test_fused_is_the_layers_side_by_side() -> None:
    g = torch.Generator().manual_seed(0)
    q, k = torch.randn(32, 16, generator=g), torch.randn(8, 16, generator=g)
    for rows in (1, 5):
        x = torch.randn(rows, 16, generator=g)
        out = fused(q, k)(x)
        torch.testing.assert_close(out[:, :32], F.linear(x, q), rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(out[:, 32:], F.linear(x, k), rtol=1e-5, atol=1e-5)


def test_calibration_sets_a_threshold_of_at_most_two_rows_and_leaves_the_rng_alone(monkeypatch) -> None:
    monkeypatch.setattr(linear, "_GEMV_ROWS", 2)
    layer = Linear(torch.randn(4096, 256, generator=torch.Generator().manual_seed(0)))
    torch.manual_seed(123)
    want = torch.rand(3)
    torch.manual_seed(123)
    rows = calibrate_gemv(layer, reps=2)
    assert torch.equal(torch.rand(3), want)
    assert rows in (0, 1, 2) and linear._GEMV_ROWS == rows
