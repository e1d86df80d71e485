"""The paged attention reference and the KV pack kernels against plain attention over contiguous KV."""

from __future__ import annotations

import pytest
import torch

from pdserve.kernels.attention import causal_attention
from pdserve.kernels.kv_pack import pack_kv, token_slots, unpack_kv
from pdserve.kernels.paged_attention import attention_metadata, gather_sequence_kv, paged_attention, store_kv

NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE, NUM_BLOCKS = 6, 2, 8, 4, 64


def plain_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Textbook causal GQA: repeat KV heads, softmax(QK^T/sqrt(d) + causal mask) V, one head at a time."""
    num_tokens, num_keys = q.shape[0], k.shape[0]
    group = NUM_HEADS // NUM_KV_HEADS
    out = torch.empty_like(q)
    for h in range(NUM_HEADS):
        scores = q[:, h] @ k[:, h // group].T / HEAD_DIM**0.5
        positions = torch.arange(num_keys - num_tokens, num_keys)[:, None]
        scores[torch.arange(num_keys)[None, :] > positions] = -torch.inf
        out[:, h] = torch.softmax(scores, -1) @ v[:, h // group]
    return out


def scattered_tables(context_lens: list[int], generator: torch.Generator) -> list[list[int]]:
    """Disjoint, shuffled block tables: sequences' blocks interleave anywhere in the pool."""
    order = torch.randperm(NUM_BLOCKS, generator=generator).tolist()
    tables = []
    for n in context_lens:
        need = -(-n // BLOCK_SIZE)
        tables.append(order[:need])
        order = order[need:]
    return tables


@pytest.mark.parametrize(
    "query_lens, context_lens",
    [
        ([1], [1]),
        ([1, 1, 1], [4, 5, 17]),
        ([7], [7]),
        ([3, 1, 9, 1], [11, 8, 9, 33]),
        ([4, 4], [4, 8]),
        ([1, 16, 1], [16, 16, 3]),
    ],
)
def test_paged_attention_of_a_mixed_batch_equals_plain_attention_per_sequence(query_lens, context_lens):
    g = torch.Generator().manual_seed(sum(context_lens))
    kv_layer = torch.zeros(NUM_BLOCKS, BLOCK_SIZE, 2, NUM_KV_HEADS, HEAD_DIM)
    tables = scattered_tables(context_lens, g)
    keys = [torch.randn(n, NUM_KV_HEADS, HEAD_DIM, generator=g) for n in context_lens]
    values = [torch.randn(n, NUM_KV_HEADS, HEAD_DIM, generator=g) for n in context_lens]
    for table, k, v in zip(tables, keys, values, strict=True):
        store_kv(kv_layer, token_slots(table, 0, len(k), BLOCK_SIZE), k, v)
    q = torch.randn(sum(query_lens), NUM_HEADS, HEAD_DIM, generator=g)
    block_tables = torch.zeros(len(tables), max(map(len, tables)), dtype=torch.int64)
    for i, t in enumerate(tables):
        block_tables[i, : len(t)] = torch.tensor(t)
    out = paged_attention(q, kv_layer, attention_metadata(block_tables, context_lens, query_lens, BLOCK_SIZE))
    start = 0
    for n, k, v in zip(query_lens, keys, values, strict=True):
        expected = plain_attention(q[start : start + n], k, v)
        torch.testing.assert_close(out[start : start + n], expected, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(
            causal_attention(q[start : start + n], k, v), expected, atol=1e-5, rtol=1e-5
        )
        start += n


def test_paged_attention_refuses_lengths_that_do_not_match_the_queries():
    kv_layer = torch.zeros(NUM_BLOCKS, BLOCK_SIZE, 2, NUM_KV_HEADS, HEAD_DIM)
    q = torch.zeros(3, NUM_HEADS, HEAD_DIM)
    tables = torch.zeros(1, 2, dtype=torch.int64)
    with pytest.raises(ValueError, match="cover"):
        paged_attention(q, kv_layer, attention_metadata(tables, [5], [2], BLOCK_SIZE))
    with pytest.raises(ValueError, match="exceed"):
        attention_metadata(tables, [2], [3], BLOCK_SIZE)


def test_pack_then_unpack_moves_token_rows_between_differently_placed_blocks():
    g = torch.Generator().manual_seed(3)
    src = torch.randn(NUM_BLOCKS, BLOCK_SIZE, 2, NUM_KV_HEADS, HEAD_DIM, generator=g)
    dst = torch.zeros_like(src)
    src_table, dst_table = [9, 2, 40, 7], [1, 63, 5, 30]
    for start, end in [(0, 16), (3, 13), (4, 8), (15, 16), (0, 1)]:
        packed = pack_kv(src, token_slots(src_table, start, end, BLOCK_SIZE))
        assert packed.is_contiguous() and packed.shape == (end - start, 2, NUM_KV_HEADS, HEAD_DIM)
        unpack_kv(dst, token_slots(dst_table, start, end, BLOCK_SIZE), packed)
        torch.testing.assert_close(
            gather_sequence_kv(dst, torch.tensor(dst_table), end)[start:end],
            gather_sequence_kv(src, torch.tensor(src_table), end)[start:end],
            atol=0,
            rtol=0,
        )


def test_token_slots_name_block_and_offset_and_refuse_a_short_block_table():
    assert token_slots([5, 2], 2, 6, 4).tolist() == [22, 23, 8, 9]
    with pytest.raises(IndexError):
        token_slots([5, 2], 0, 9, 4)
