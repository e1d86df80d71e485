"""kernels/csrc/skinny_linear.c through kernels/skinny_linear.py: the packed copy holds the weight's panels
transposed and zero-padded; x @ weight.T (+ residual) equals the float64 product to fp32 rounding for 1-8
rows (one group of rows, each count its own specialisation), several groups with and without a short last
one (the next panel prefetched, spread over the groups), a last panel cut short (out_features not a
multiple of the panel width, or less than it), any in_features, long rows (1536), strided rows of x and one
or two threads; the gated kernel (SwiGLU in the epilogue) reads gate and up side by side in each panel and
gives, to the bit, `silu_and_mul` of the plain kernel's product; what it cannot take, it says."""

from __future__ import annotations

import pytest
import torch

from pdserve.kernels.activation import silu_and_mul
from pdserve.kernels.skinny_linear import (
    pack,
    pack_gated,
    panel_width,
    skinny_gated_linear,
    skinny_kernel,
    skinny_linear,
    takes_rows,
    takes_weight,
)

pytestmark = pytest.mark.skipif(skinny_kernel() is None, reason="no C compiler: the kernel is not built")


def test_the_packed_copy_is_the_weight_in_panels_transposed_and_zero_padded() -> None:
    width = panel_width()
    assert width in (16, 32)  # two vectors: of 8 floats without AVX-512, of 16 with it
    n, k = 2 * width + 3, 5
    weight = torch.arange(n * k, dtype=torch.float32).reshape(n, k)
    panels = pack(weight)
    assert panels.shape == (3, k, width)
    for p in range(3):
        for j in range(width):
            row = p * width + j
            want = weight[row] if row < n else torch.zeros(k)
            assert torch.equal(panels[p, :, j], want)


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("n, k", [(1, 16), (17, 24), (33, 576), (961, 576), (64, 1536), (40, 7)])
def test_every_row_count_equals_the_float64_product(n: int, k: int, threads: int) -> None:
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        g = torch.Generator().manual_seed(n * k)
        weight = torch.randn(n, k, generator=g)
        assert takes_weight(weight)
        panels = pack(weight)
        for rows in (*range(1, 9), 12, 16, 37, 130):
            x = torch.randn(rows, k + 16, generator=g)[:, :k]  # rows k + 16 floats apart
            residual = torch.randn(rows, n, generator=g)
            assert takes_rows(x)
            want = x.double() @ weight.double().T
            torch.testing.assert_close(skinny_linear(x, panels, n).double(), want, rtol=1e-4, atol=1e-4)
            torch.testing.assert_close(skinny_linear(x, panels, n, residual).double(),
                                       want + residual.double(), rtol=1e-4, atol=1e-4)
    finally:
        torch.set_num_threads(before)


def test_what_the_kernel_cannot_take_it_says() -> None:
    assert not takes_rows(torch.randn(0, 32))  # no rows
    assert not takes_rows(torch.randn(32, 2).T)  # a row of x not contiguous
    assert not takes_rows(torch.randn(2, 32, dtype=torch.float64))  # not fp32
    assert not takes_weight(torch.randn(8, 32, dtype=torch.float64))
    assert not takes_weight(torch.randn(8))  # not a matrix
    panels = pack(torch.randn(40, 32))
    with pytest.raises(ValueError, match="no packed weight"):
        skinny_linear(torch.randn(2, 24), panels, 40)  # in_features not the weight's
    with pytest.raises(ValueError, match="no packed weight"):
        skinny_linear(torch.randn(2, 32), panels, 40 + panel_width() * 2)  # more outputs than the panels hold


def test_a_gated_panel_holds_gate_and_up_of_the_same_features_side_by_side() -> None:
    width = panel_width()
    half = width // 2
    d, k = half + 3, 5
    weight = torch.arange(2 * d * k, dtype=torch.float32).reshape(2 * d, k)
    panels = pack_gated(weight)
    assert panels.shape == (2, k, width)
    for p in range(2):
        for j in range(width):
            feature = p * half + j % half
            want = weight[feature if j < half else d + feature] if feature < d else torch.zeros(k)
            assert torch.equal(panels[p, :, j], want)


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("d, k", [(1, 16), (17, 24), (40, 576), (1536, 64)])  # tails of 1, 1, 8, 0
def test_the_gated_kernel_is_silu_and_mul_of_the_product_to_the_bit(d: int, k: int, threads: int) -> None:
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        g = torch.Generator().manual_seed(d * k)
        weight = torch.randn(2 * d, k, generator=g)
        gated, plain = pack_gated(weight), pack(weight)
        for rows in (*range(1, 9), 16, 37, 130):
            # rows k + 16 floats apart; products past +-88 (silu's e^-g clamped) at k = 576
            x = torch.randn(rows, k + 16, generator=g)[:, :k] * 3
            out = skinny_gated_linear(x, gated, d)
            assert out.shape == (rows, d)
            assert torch.equal(out, silu_and_mul(skinny_linear(x, plain, 2 * d)))
            product = x.double() @ weight.double().T
            want = torch.nn.functional.silu(product[:, :d]) * product[:, d:]
            # |product| up to ~200: fp32 sums of 576 terms are up to ~1e-3 off, and silu(g) * u scales that by
            # |u| (outputs up to ~4e4)
            torch.testing.assert_close(out.double(), want, rtol=1e-4, atol=1e-2)
    finally:
        torch.set_num_threads(before)


def test_what_the_gated_kernel_cannot_take_it_says() -> None:
    with pytest.raises(ValueError, match="even number of rows"):
        pack_gated(torch.randn(7, 32))
    panels = pack_gated(torch.randn(2 * 40, 32))
    with pytest.raises(ValueError, match="no packed gate/up weight"):
        skinny_gated_linear(torch.randn(2, 24), panels, 40)  # in_features not the weight's
    with pytest.raises(ValueError, match="no packed gate/up weight"):
        skinny_gated_linear(torch.randn(2, 32), panels, 40 + panel_width())  # more than the panels hold
