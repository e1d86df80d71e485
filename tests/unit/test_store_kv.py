"""kernels/paged_attention.store_kv: the C kernel (csrc/store_kv.c) writes the same pool as torch's index_put,
for K and V as strided slices of a fused QKV output and as contiguous tensors, touching no other slot; a
slot outside the pool raises IndexError with nothing written."""

from __future__ import annotations

import pytest
import torch

from pdserve.kernels import paged_attention
from pdserve.kernels.paged_attention import K_INDEX, V_INDEX, native_store_kernel, store_kv

pytestmark = pytest.mark.skipif(native_store_kernel() is None,
                                reason="no C compiler: the kernel is not built")

NUM_BLOCKS, BLOCK_SIZE, KV_HEADS, HEAD_DIM = 6, 4, 3, 16


def reference(pool: torch.Tensor, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    rows = pool.clone().view(-1, 2, KV_HEADS, HEAD_DIM)
    rows[slots, K_INDEX] = k
    rows[slots, V_INDEX] = v
    return rows.view(pool.shape)


@pytest.mark.parametrize("fused", [True, False])
def test_the_kernel_writes_what_index_put_writes(fused: bool) -> None:
    g = torch.Generator().manual_seed(1)
    pool = torch.randn(NUM_BLOCKS, BLOCK_SIZE, 2, KV_HEADS, HEAD_DIM, generator=g)
    slots = torch.tensor([5, 6, 7, 8, 21, 0, 13])  # across blocks, out of order
    if fused:  # q (9 heads), k, v side by side in one row, as the model's fused QKV output
        qkv = torch.randn(len(slots), 9 + 2 * KV_HEADS, HEAD_DIM, generator=g)
        k, v = qkv[:, 9 : 9 + KV_HEADS], qkv[:, 9 + KV_HEADS :]
        assert not k.is_contiguous()
    else:
        k, v = (torch.randn(len(slots), KV_HEADS, HEAD_DIM, generator=g) for _ in range(2))
    assert paged_attention._store_native(pool, slots, k, v)
    want = reference(pool, slots, k, v)
    store_kv(pool, slots, k, v)
    assert torch.equal(pool, want)


def test_a_slot_outside_the_pool_is_an_error_and_nothing_is_written() -> None:
    pool = torch.zeros(NUM_BLOCKS, BLOCK_SIZE, 2, KV_HEADS, HEAD_DIM)
    k = v = torch.ones(2, KV_HEADS, HEAD_DIM)
    for bad in (NUM_BLOCKS * BLOCK_SIZE, -1):
        with pytest.raises(IndexError):
            store_kv(pool, torch.tensor([3, bad]), k, v)
        assert not pool.any()
