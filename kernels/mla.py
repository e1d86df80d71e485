"""Multi-head latent attention (MLA) of a mixed batch over a paged cache of latents (fp32, CPU).

MLA (DeepSeek-AI, "DeepSeek-V2", arXiv:2405.04434, §2.1) caches, per token, one low-rank joint KV latent
c_KV (kv_lora_rank, after its RMSNorm) and one key part k_R shared by every head (qk_rope_head_dim) instead
of per-head K and V. Head h's key and value are expanded from the latent by the up-projection
`kv_b_proj` ([heads * (qk_nope_head_dim + v_head_dim), kv_lora_rank]: per head, W_UK rows then W_UV rows):

    k_h = [W_UK_h c_KV ; k_R],   v_h = W_UV_h c_KV,   o_h = softmax(q_h . k_h * scale) v_h

with q_h = [q_nope_h ; q_R_h]. (DeepSeek rotates q_R and k_R with RoPE; Kimi Linear's MLA layers use no
position encoding at all — "NoPE", Kimi Linear report §4 — so the model hands in k_R unrotated. Either way
the kernel sees the final vectors.)

Two ways to compute it, both here:
- prefill chunks (several queries): expand the sequence's latents into per-head K and V with one GEMM and
  run causal attention (SDPA) — cheaper when queries are many (n * N * heads * (nope + rope) multiply-adds
  plus N * kv_lora_rank * heads * (nope + v) for the expansion);
- decode (one query per sequence): the weight-absorbed form (DeepSeek-V2 §2.1.2): q_nope_h W_UK_h is a query
  in latent space, so scores are [q_nope_h W_UK_h ; q_R_h] . [c_KV ; k_R] straight over the cached rows,
  and the output o_h = W_UV_h (sum_j p_j c_KV_j) — no per-head K/V is ever materialized, every decoding
  sequence of a step in one padded, masked batched matmul over its gathered blocks (as
  `paged_attention`'s decode path).

Layout of one MLA layer's pool, `pool`: [num_blocks, block_size, kv_lora_rank + rope_dim], each row
`[c_KV | k_R]`; one block of one layer is one contiguous region, token-major (what a transfer packs,
`kv_pack`). Block tables and decode masks: `paged_attention.PagedAttentionMetadata`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch
import torch.nn.functional as F

from pdserve.kernels.paged_attention import PagedAttentionMetadata


class MLAWeights(NamedTuple):
    """One MLA layer's up-projection, in the two forms the two paths use.

    `up_proj`: latents [N, kv_lora_rank] -> [N, heads * (nope + v)] (kv_b_proj applied; any GEMM);
    `w_uk`: [heads, nope, kv_lora_rank] and `w_uv`: [heads, v, kv_lora_rank], views of kv_b_proj's rows.
    """

    up_proj: Callable[[torch.Tensor], torch.Tensor]
    w_uk: torch.Tensor
    w_uv: torch.Tensor


def split_up_proj(
    kv_b_weight: torch.Tensor, num_heads: int, nope_dim: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """`kv_b_proj.weight` [heads * (nope + v), kv_lora_rank] -> (W_UK [heads, nope, rank],
    W_UV [heads, v, rank]), contiguous copies."""
    per_head = kv_b_weight.view(num_heads, -1, kv_b_weight.shape[-1])
    return per_head[:, :nope_dim].contiguous(), per_head[:, nope_dim:].contiguous()


def store_latent(pool: torch.Tensor, slot_mapping: torch.Tensor, latent: torch.Tensor) -> None:
    """Write `latent` [num_tokens, kv_lora_rank + rope_dim] into slots `slot_mapping` [num_tokens] int64
    (block_id * block_size + offset) of `pool` [num_blocks, block_size, kv_lora_rank + rope_dim], in place."""
    pool.view(-1, pool.shape[-1])[slot_mapping] = latent


def mla_attention(
    q: torch.Tensor, pool: torch.Tensor, meta: PagedAttentionMetadata, weights: MLAWeights,
    nope_dim: int, scale: float,
) -> torch.Tensor:
    """Causal MLA of every sequence's new tokens over its paged latents.

    q: [num_tokens, heads, nope + rope] (each head's [q_nope ; q_R]), the sequences' new tokens back to
    back (sequence i owns meta.query_lens[i] rows, at positions context_lens[i] - query_lens[i] ..
    context_lens[i] - 1); pool: [num_blocks, block_size, kv_lora_rank + rope] with the new tokens' latents
    already stored (`store_latent`). `scale` multiplies the scores (Kimi Linear: (nope + rope) ** -0.5).
    Returns [num_tokens, heads, v_head_dim].
    Raises ValueError when the query lengths do not cover q's rows.
    """
    if sum(meta.query_lens) != q.shape[0]:
        raise ValueError(f"query_lens {meta.query_lens} do not cover the {q.shape[0]} query rows")
    num_heads = q.shape[1]
    v_dim = weights.w_uv.shape[1]
    if meta.decode_seqs is None:
        return _decode(q, pool, meta, weights, nope_dim, scale)
    out = q.new_empty(q.shape[0], num_heads, v_dim)
    start = 0
    for i, n in enumerate(meta.query_lens):
        if n > 1:
            latents = _gather(pool, meta.block_tables[i], meta.context_lens[i])
            out[start : start + n] = _prefill(q[start : start + n], latents, weights, nope_dim, scale)
        start += n
    if meta.decode_seqs:
        out[meta.decode_rows] = _decode(q[meta.decode_rows], pool, meta, weights, nope_dim, scale)
    return out


def _gather(pool: torch.Tensor, block_table: torch.Tensor, num_tokens: int) -> torch.Tensor:
    """One sequence's first `num_tokens` latent rows, contiguous: [num_tokens, kv_lora_rank + rope]."""
    num_blocks = -(-num_tokens // pool.shape[1])
    return pool[block_table[:num_blocks]].flatten(0, 1)[:num_tokens]


def _prefill(
    q: torch.Tensor, latents: torch.Tensor, weights: MLAWeights, nope_dim: int, scale: float
) -> torch.Tensor:
    """n queries of one sequence over its N latents (the last n are the queries' own): expand, attend.

    q: [n, heads, nope + rope]; latents: [N, rank + rope]. Returns [n, heads, v]."""
    num_queries, num_heads, _ = q.shape
    num_keys = latents.shape[0]
    rank = weights.w_uk.shape[-1]
    kv = weights.up_proj(latents[:, :rank]).view(num_keys, num_heads, -1)  # [N, heads, nope + v]
    k_rope = latents[:, None, rank:].expand(num_keys, num_heads, -1)
    k = torch.cat((kv[..., :nope_dim], k_rope), dim=-1)
    v = kv[..., nope_dim:]
    past = num_keys - num_queries
    mask = None
    if past:  # query i sees keys 0..past + i (SDPA's own is_causal aligns the diagonal top-left)
        mask = torch.ones(num_queries, num_keys, dtype=torch.bool, device=q.device).tril_(past)
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1).unsqueeze(0), k.transpose(0, 1).unsqueeze(0), v.transpose(0, 1).unsqueeze(0),
        attn_mask=mask, is_causal=not past, scale=scale,
    )  # [1, heads, n, v]
    return out[0].transpose(0, 1)


def _decode(
    q: torch.Tensor, pool: torch.Tensor, meta: PagedAttentionMetadata, weights: MLAWeights,
    nope_dim: int, scale: float,
) -> torch.Tensor:
    """One query per decoding sequence, weight-absorbed: q [batch, heads, nope + rope] -> [batch, heads, v].

    Keys are the gathered latent rows themselves ([batch, max_blocks * block_size, rank + rope], padding
    masked by meta.decode_mask); values are their first `rank` columns."""
    batch, num_heads, _ = q.shape
    rank = weights.w_uk.shape[-1]
    num_keys = meta.decode_mask.shape[-1]
    latents = pool.index_select(0, meta.decode_blocks).view(batch, num_keys, -1)  # [batch, keys, rank + rope]
    q_latent = torch.bmm(q[..., :nope_dim].transpose(0, 1), weights.w_uk)  # [heads, batch, rank]
    q_full = torch.cat((q_latent.transpose(0, 1), q[..., nope_dim:]), dim=-1)  # [batch, heads, rank + rope]
    scores = torch.bmm(q_full, latents.transpose(1, 2)).mul_(scale).add_(meta.decode_mask.unsqueeze(1))
    probs = torch.softmax(scores, dim=-1)  # [batch, heads, keys]
    o_latent = torch.bmm(probs, latents[..., :rank])  # [batch, heads, rank]
    out = torch.bmm(o_latent.transpose(0, 1), weights.w_uv.transpose(1, 2))  # [heads, batch, v]
    return out.transpose(0, 1)
