"""engine/linear.py: every path of a layer — MKL's `F.linear` on the plain weight, the C kernel for a few
rows on its packed copy, oneDNN's GEMM on the prepacked weight — computes x @ weight.T to fp32 rounding,
with and without the residual sum, on every row count either side of the switches; calibration sets a
path per row count."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pdserve.engine import linear
from pdserve.engine.linear import MKL, ONEDNN, SKINNY, Linear, calibrate_paths, fused
from pdserve.kernels.skinny_linear import MAX_ROWS


@pytest.mark.parametrize("path", [MKL, SKINNY, ONEDNN])
@pytest.mark.parametrize("rows", [1, 2, 3, 8, 33])
def test_every_path_and_row_count_equals_f_linear_to_fp32_rounding(rows: int, path: str, monkeypatch) -> None:
    monkeypatch.setattr(linear, "_PATHS", {m: path for m in range(1, MAX_ROWS + 1)})
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


def test_the_c_kernel_path_falls_back_to_onednn_where_it_cannot_take_the_call(monkeypatch) -> None:
    monkeypatch.setattr(linear, "_PATHS", {m: SKINNY for m in range(1, MAX_ROWS + 1)})
    g = torch.Generator().manual_seed(0)
    layer = Linear(torch.randn(32, 64, generator=g))
    column_strided = torch.randn(64, 4, generator=g).T  # rows of x not contiguous
    assert layer._path(column_strided) == ONEDNN and layer._path(column_strided.contiguous()) == SKINNY


def test_fused_is_the_layers_side_by_side() -> None:
    g = torch.Generator().manual_seed(0)
    q, k = torch.randn(32, 16, generator=g), torch.randn(8, 16, generator=g)
    for rows in (1, 5):
        x = torch.randn(rows, 16, generator=g)
        out = fused(q, k)(x)
        torch.testing.assert_close(out[:, :32], F.linear(x, q), rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(out[:, 32:], F.linear(x, k), rtol=1e-5, atol=1e-5)


def test_calibration_sets_a_path_for_each_row_count_and_leaves_the_rng_alone(monkeypatch) -> None:
    monkeypatch.setattr(linear, "_PATHS", {1: MKL, 2: MKL})
    layer = Linear(torch.randn(4096, 256, generator=torch.Generator().manual_seed(0)))
    torch.manual_seed(123)
    want = torch.rand(3)
    torch.manual_seed(123)
    paths = calibrate_paths(layer, reps=2)
    assert torch.equal(torch.rand(3), want)
    assert sorted(paths) == list(range(1, MAX_ROWS + 1)) and set(paths.values()) <= {MKL, SKINNY, ONEDNN}
    assert linear._PATHS == paths
    assert layer._path(torch.zeros(MAX_ROWS + 1, 256)) == ONEDNN  # past the table: always oneDNN
