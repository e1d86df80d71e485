"""engine/linear.py: every path of a layer — MKL's `F.linear` on the plain weight, the C kernel on its
packed copy, oneDNN's GEMM on the prepacked weight — computes x @ weight.T to fp32 rounding, with and
without the residual sum, on row counts either side of the calibrated ones, and a gated layer SwiGLU of its
gate and up on each; calibration sets a path per
calibrated row count, a call takes its bucket's, and oneDNN takes what no bucket covers."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from pdserve.engine import linear
from pdserve.engine.linear import (
    CALIBRATED_ROWS,
    MKL,
    ONEDNN,
    SKINNY,
    Linear,
    calibrate_paths,
    fused,
    gated,
    linears_of,
    path_of,
    weights_from_memory,
)


@pytest.mark.parametrize("path", [MKL, SKINNY, ONEDNN])
@pytest.mark.parametrize("rows", [1, 2, 3, 8, 33, 130])
def test_every_path_and_row_count_equals_f_linear_to_fp32_rounding(rows: int, path: str, monkeypatch) -> None:
    monkeypatch.setattr(linear, "_PATHS", dict.fromkeys(CALIBRATED_ROWS, path))
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
    monkeypatch.setattr(linear, "_PATHS", dict.fromkeys(CALIBRATED_ROWS, SKINNY))
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


@pytest.mark.parametrize("path", [MKL, SKINNY, ONEDNN])
@pytest.mark.parametrize("rows", [1, 5, 8, 33, 130])
def test_a_gated_layer_is_swiglu_of_its_gate_and_up_on_every_path(rows: int, path: str, monkeypatch) -> None:
    monkeypatch.setattr(linear, "_PATHS", dict.fromkeys(CALIBRATED_ROWS, path))
    g = torch.Generator().manual_seed(rows)
    gate, up, x = (torch.randn(s, generator=g) for s in ((40, 64), (40, 64), (rows, 64)))
    layer = gated(gate, up)
    assert layer._path(x) == path and layer.out_features == 40
    want = F.silu(x.double() @ gate.double().T) * (x.double() @ up.double().T)
    torch.testing.assert_close(layer(x).double(), want, rtol=1e-4, atol=1e-4)
    with pytest.raises(TypeError, match="nothing is added"):
        layer.add(x, torch.zeros(rows, 40))


def test_calibration_sets_a_path_for_each_row_count_and_leaves_the_rng_alone(monkeypatch) -> None:
    monkeypatch.setattr(linear, "_PATHS", {1: MKL, 2: MKL})
    g = torch.Generator().manual_seed(0)
    layers = [Linear(torch.randn(512, 256, generator=g)), Linear(torch.randn(256, 512, generator=g))]
    torch.manual_seed(123)
    want = torch.rand(3)
    torch.manual_seed(123)
    paths = calibrate_paths(layers, reps=1)
    assert torch.equal(torch.rand(3), want)
    assert sorted(paths) == list(CALIBRATED_ROWS) and set(paths.values()) <= {MKL, SKINNY, ONEDNN}
    assert linear._PATHS == paths
    last = CALIBRATED_ROWS[-1]
    assert layers[0]._path(torch.zeros(2 * last, 256)) == ONEDNN  # past the table: always oneDNN


def test_a_call_takes_the_path_of_the_largest_calibrated_row_count_under_it(monkeypatch) -> None:
    monkeypatch.setattr(linear, "_PATHS", {1: MKL, 4: SKINNY, 16: MKL, 64: SKINNY})
    assert [path_of(rows) for rows in (1, 3, 4, 15, 16, 63, 64, 127, 128, 4096)] == [
        MKL, MKL, SKINNY, SKINNY, MKL, MKL, SKINNY, SKINNY, ONEDNN, ONEDNN]
    monkeypatch.setattr(linear, "_PATHS", {4: SKINNY})
    assert path_of(3) == ONEDNN  # under every calibrated count


def test_the_calibration_set_is_the_first_layers_past_the_size_a_cache_holds() -> None:
    layers = [Linear(torch.zeros(256, 256)) for _ in range(4)]  # 256 KiB each
    nested = [{"mixer": (layers[0], layers[1])}, SimpleNamespace(o=layers[2], down=layers[3])]
    assert linears_of(nested) == layers and linears_of([layers[0], layers[0]]) == [layers[0]]
    assert weights_from_memory(layers, min_bytes=600 << 10) == layers[:3]
    assert weights_from_memory(layers, min_bytes=1 << 30) == layers  # all of them, if less in all
