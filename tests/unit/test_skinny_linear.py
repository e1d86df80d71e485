"""kernels/csrc/skinny_linear.c through kernels/skinny_linear.py: x @ weight.T (+ residual) for 1-8 rows
equals the float64 product to fp32 rounding, for tiles cut short (out_features not a multiple of 16 or
odd), long rows (in_features 1536), strided rows of x and one or two threads, and reading the weight one
row at a time gives the same bits as two; what it cannot take, it says."""

from __future__ import annotations

import pytest
import torch

from pdserve.kernels.skinny_linear import MAX_ROWS, skinny_kernel, skinny_linear, usable

pytestmark = pytest.mark.skipif(skinny_kernel() is None, reason="no C compiler: the kernel is not built")


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("n, k", [(1, 16), (17, 64), (33, 576), (961, 576), (64, 1536)])
def test_every_row_count_equals_the_float64_product(n: int, k: int, threads: int) -> None:
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        g = torch.Generator().manual_seed(n * k)
        weight = torch.randn(n, k, generator=g)
        for rows in range(1, MAX_ROWS + 1):
            x = torch.randn(rows, k + 16, generator=g)[:, :k]  # rows k + 16 floats apart
            residual = torch.randn(rows, n, generator=g)
            assert usable(x, weight)
            want = x.double() @ weight.double().T
            pairs = skinny_linear(x, weight)
            torch.testing.assert_close(pairs.double(), want, rtol=1e-4, atol=1e-4)
            torch.testing.assert_close(skinny_linear(x, weight, residual).double(), want + residual.double(),
                                       rtol=1e-4, atol=1e-4)
            # one weight row at a time: the same sums in the same order, so the same bits
            assert torch.equal(skinny_linear(x, weight, row_pairs=False), pairs)
            assert torch.equal(skinny_linear(x, weight, residual, row_pairs=False),
                               skinny_linear(x, weight, residual))
    finally:
        torch.set_num_threads(before)


def test_what_the_kernel_cannot_take_is_not_usable() -> None:
    weight = torch.randn(8, 32)
    assert not usable(torch.randn(MAX_ROWS + 1, 32), weight)  # too many rows
    assert not usable(torch.randn(2, 24), torch.randn(8, 24))  # in_features not a multiple of 16
    assert not usable(torch.randn(32, 2).T, weight)  # a row of x not contiguous
    assert not usable(torch.randn(2, 32, dtype=torch.float64), weight.double())  # not fp32
    assert not usable(torch.randn(2, 32), torch.randn(32, 8).T)  # weight not contiguous
