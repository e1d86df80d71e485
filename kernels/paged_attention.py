"""Attention of a mixed batch (prefill chunks and decode tokens) over a paged KV cache (fp32, CPU).

The paged layout is vLLM's idea (Kwon et al. 2023, "Efficient Memory Management for Large Language Model
Serving with PagedAttention", https://arxiv.org/abs/2309.06180): a sequence's KV lives in fixed-size blocks
anywhere in one pool, found through its block table. This is the torch reference: it gathers each
sequence's blocks into a contiguous view and runs plain attention on it.
"""

from __future__ import annotations

import torch

from pdserve.kernels.attention import causal_attention

K_INDEX, V_INDEX = 0, 1


def store_kv(kv_layer: torch.Tensor, slot_mapping: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    """Write the K and V of `num_tokens` new tokens into their slots of one layer's block pool, in place.

    kv_layer: [num_blocks, block_size, 2, num_kv_heads, head_dim] fp32 (index 2: 0 = K, 1 = V);
    slot_mapping: [num_tokens] int64, slot = block_id * block_size + offset in block;
    k, v: [num_tokens, num_kv_heads, head_dim] fp32.
    """
    rows = kv_layer.view(-1, *kv_layer.shape[2:])  # [num_slots, 2, kv_heads, head_dim]
    rows.index_copy_(0, slot_mapping, torch.stack((k, v), dim=1))


def gather_sequence_kv(kv_layer: torch.Tensor, block_table: torch.Tensor, num_tokens: int) -> torch.Tensor:
    """One sequence's first `num_tokens` rows of KV, contiguous: [num_tokens, 2, num_kv_heads, head_dim].

    block_table: [>= ceil(num_tokens / block_size)] int64 block ids in sequence order.
    """
    block_size = kv_layer.shape[1]
    num_blocks = -(-num_tokens // block_size)
    return kv_layer[block_table[:num_blocks]].flatten(0, 1)[:num_tokens]


def paged_attention(
    q: torch.Tensor,
    kv_layer: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: list[int],
    query_lens: list[int],
) -> torch.Tensor:
    """Causal grouped-query attention of every sequence's new tokens over its paged KV.

    q: [num_tokens, num_heads, head_dim] fp32, the sequences' new tokens back to back (sequence i owns
    query_lens[i] rows); kv_layer: [num_blocks, block_size, 2, num_kv_heads, head_dim] fp32 with the new
    tokens' K/V already stored (`store_kv`); block_tables: [num_seqs, max_blocks] int64 (rows padded with
    any valid block id); context_lens[i]: tokens of sequence i including its new ones, whose positions are
    context_lens[i] - query_lens[i] .. context_lens[i] - 1. Scale 1/sqrt(head_dim); query head h reads KV
    head h // (num_heads // num_kv_heads), as `causal_attention`.
    Returns [num_tokens, num_heads, head_dim] fp32.
    Raises ValueError when the lengths disagree with q or a query length exceeds its context.

    Sequences with one new token (decode) are attended together in one padded, masked batched matmul;
    sequences with several (prefill chunks) one by one through `causal_attention`.
    """
    num_tokens, num_heads, head_dim = q.shape
    if len(context_lens) != len(query_lens) or sum(query_lens) != num_tokens:
        raise ValueError(f"query_lens {query_lens} do not cover the {num_tokens} query rows")
    if any(n > c or n < 1 for n, c in zip(query_lens, context_lens, strict=True)):
        raise ValueError(f"query_lens {query_lens} exceed context_lens {context_lens}")
    out = torch.empty_like(q)
    starts = [0]
    for n in query_lens:
        starts.append(starts[-1] + n)
    decode = [i for i, n in enumerate(query_lens) if n == 1]
    for i, n in enumerate(query_lens):
        if n > 1:
            kv = gather_sequence_kv(kv_layer, block_tables[i], context_lens[i])
            out[starts[i] : starts[i + 1]] = causal_attention(
                q[starts[i] : starts[i + 1]], kv[:, K_INDEX], kv[:, V_INDEX]
            )
    if len(decode) == len(query_lens):  # a pure decode step: no rows to pick out or scatter back
        return _decode_attention(q, kv_layer, block_tables, context_lens)
    if decode:
        rows = torch.tensor([starts[i] for i in decode], dtype=torch.int64)
        out[rows] = _decode_attention(
            q[rows], kv_layer, block_tables[decode], [context_lens[i] for i in decode]
        )
    return out


def _decode_attention(
    q: torch.Tensor, kv_layer: torch.Tensor, block_tables: torch.Tensor, context_lens: list[int]
) -> torch.Tensor:
    """One query per sequence: q [batch, num_heads, head_dim]; returns the same shape.

    The blocks are gathered once (`index_select`, token-major as stored) and then transposed into one
    [2, batch * kv_heads, keys, head_dim] copy, so both matmuls are plain bmm over contiguous operands:
    measured here (torch 2.13, 1 thread; 32 sequences x 80 keys) 1.25 ms a layer, against 3.3 ms for
    matmul over the strided gather, which copies K and V per call inside `matmul`.
    """
    batch, num_heads, head_dim = q.shape
    block_size, num_kv_heads = kv_layer.shape[1], kv_layer.shape[3]
    group = num_heads // num_kv_heads
    max_blocks = -(-max(context_lens) // block_size)
    num_keys = max_blocks * block_size
    gathered = kv_layer.index_select(0, block_tables[:, :max_blocks].reshape(-1))
    kv = gathered.view(batch, num_keys, 2, num_kv_heads, head_dim).permute(2, 0, 3, 1, 4).contiguous()
    k = kv[K_INDEX].view(batch * num_kv_heads, num_keys, head_dim)
    v = kv[V_INDEX].view(batch * num_kv_heads, num_keys, head_dim)
    scores = torch.bmm(q.reshape(batch * num_kv_heads, group, head_dim), k.transpose(1, 2))
    scores = scores.mul_(head_dim**-0.5).view(batch, num_kv_heads, group, num_keys)
    # True = a key slot past this sequence's context (padding of the gather)
    padding = torch.arange(num_keys) >= torch.tensor(context_lens, dtype=torch.int64)[:, None]
    scores.masked_fill_(padding[:, None, None, :], -torch.inf)
    probs = torch.softmax(scores, dim=-1).view(batch * num_kv_heads, group, num_keys)
    return torch.bmm(probs, v).view(batch, num_heads, head_dim)
