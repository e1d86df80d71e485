"""Attention of a mixed batch (prefill chunks and decode tokens) over a paged KV cache (fp32, CPU).

The paged layout is vLLM's idea (Kwon et al. 2023, "Efficient Memory Management for Large Language Model
Serving with PagedAttention", https://arxiv.org/abs/2309.06180): a sequence's KV lives in fixed-size blocks
anywhere in one pool, found through its block table. This is the torch reference: it gathers each
sequence's blocks into a contiguous view and runs plain attention on it.

Layout of one layer's pool, `kv_layer`: [num_blocks, block_size, 2, num_kv_heads, head_dim] fp32, K at
`K_INDEX` of dim 2 (after rope), V at `V_INDEX`. A block of one layer is one contiguous region, token-major:
what a KV transfer packs (`kv_pack`).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import NamedTuple

import torch

from pdserve.kernels import native
from pdserve.kernels.attention import causal_attention

K_INDEX, V_INDEX = 0, 1
NATIVE_MAX_HEAD_DIM, NATIVE_MAX_HEADS = 256, 128  # MAX_HEAD_DIM, MAX_HEADS of csrc/paged_decode_attention.c


class PagedAttentionMetadata(NamedTuple):
    """Where each sequence of a forward reads its KV, worked out once per forward for every layer.

    `block_tables`: [num_seqs, max_blocks] int64 (rows padded with block 0); `context_lens[i]`: tokens of
    sequence i including its new ones, `query_lens[i]`: its new tokens (rows of q, back to back).
    For the sequences with one new token (decode), attended together in one padded batch:
    `decode_seqs` (their indices; None when every sequence decodes), `decode_rows` [num_decode] int64 (their
    rows of q), `decode_lens` [num_decode] int64 (their context lengths), `decode_blocks`
    [num_decode * decode_max_blocks] int64 (their block ids, flattened, contiguous), `decode_mask`
    [num_decode, decode_max_blocks * block_size] fp32 (0 for a key of the context, -inf for the padding
    past it).
    """

    block_tables: torch.Tensor
    context_lens: list[int]
    query_lens: list[int]
    decode_seqs: list[int] | None
    decode_rows: torch.Tensor
    decode_lens: torch.Tensor
    decode_blocks: torch.Tensor
    decode_mask: torch.Tensor


def attention_metadata(
    block_tables: torch.Tensor, context_lens: list[int], query_lens: list[int], block_size: int,
    dtype: torch.dtype = torch.float32,
) -> PagedAttentionMetadata:
    """The metadata of one forward (see `PagedAttentionMetadata`), on `block_tables`' device; the mask in
    `dtype` (the attention scores'). Raises ValueError when a query length is not in 1..its context
    length."""
    if len(context_lens) != len(query_lens):
        raise ValueError(f"{len(context_lens)} context lengths for {len(query_lens)} query lengths")
    if any(n > c or n < 1 for n, c in zip(query_lens, context_lens, strict=True)):
        raise ValueError(f"query_lens {query_lens} exceed context_lens {context_lens}")
    decode = [i for i, n in enumerate(query_lens) if n == 1]
    device = block_tables.device
    rows = torch.tensor(query_lens, dtype=torch.int64, device=device).cumsum(0) - 1  # each one's last row
    decode_lens = torch.tensor([context_lens[i] for i in decode], dtype=torch.int64, device=device)
    max_blocks = -(-max((context_lens[i] for i in decode), default=0) // block_size)
    tables = block_tables[decode] if len(decode) < len(query_lens) else block_tables
    num_keys = max_blocks * block_size
    mask = torch.zeros(len(decode), num_keys, dtype=dtype, device=device)
    mask.masked_fill_(torch.arange(num_keys, device=device) >= decode_lens[:, None], -torch.inf)
    return PagedAttentionMetadata(
        block_tables=block_tables,
        context_lens=context_lens,
        query_lens=query_lens,
        decode_seqs=None if len(decode) == len(query_lens) else decode,
        decode_rows=rows[decode],
        decode_lens=decode_lens,
        decode_blocks=tables[:, :max_blocks].reshape(-1).contiguous(),
        decode_mask=mask,
    )


def store_kv(kv_layer: torch.Tensor, slot_mapping: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    """Write the K and V of `num_tokens` new tokens into their slots of one layer's block pool, in place.

    kv_layer: [num_blocks, block_size, 2, num_kv_heads, head_dim] fp32; slot_mapping: [num_tokens] int64,
    slot = block_id * block_size + offset in block (vLLM's meaning); k, v: [num_tokens, num_kv_heads,
    head_dim] fp32 (may be strided views). By the C kernel csrc/store_kv.c where it is built and each
    token's heads are contiguous, else by torch's index_put. Raises IndexError for a slot outside the pool.
    """
    kernel = native_store_kernel()
    if kernel is not None and _store_native(kv_layer, slot_mapping, k, v):
        num_slots = kv_layer.shape[0] * kv_layer.shape[1]
        status = kernel(kv_layer.data_ptr(), num_slots, slot_mapping.data_ptr(), slot_mapping.shape[0],
                        k.data_ptr(), k.stride(0), v.data_ptr(), v.stride(0), k.shape[1] * k.shape[2])
        if status:
            raise IndexError(f"a slot of {slot_mapping.tolist()} is outside the pool's {num_slots}")
        return
    rows = kv_layer.view(-1, *kv_layer.shape[2:])  # [num_slots, 2, kv_heads, head_dim]
    rows[slot_mapping, K_INDEX] = k
    rows[slot_mapping, V_INDEX] = v


def _store_native(kv_layer: torch.Tensor, slot_mapping: torch.Tensor, k: torch.Tensor,
                  v: torch.Tensor) -> bool:
    """Whether csrc/store_kv.c can take the call as it is: fp32 on the CPU, the pool and the slots
    contiguous (slots int64), each token's heads of k and v contiguous, as many as a pool row holds."""
    heads = k.shape[1] * k.shape[2]
    return (native.cpu_fp32(kv_layer, k, v) and kv_layer.is_contiguous() and kv_layer.shape[2] == 2
            and kv_layer.shape[3] * kv_layer.shape[4] == heads and slot_mapping.dtype == torch.int64
            and slot_mapping.is_contiguous() and slot_mapping.device.type == "cpu"
            and all(t.stride(2) == 1 and t.stride(1) == t.shape[2] and t.shape[1] * t.shape[2] == heads
                    for t in (k, v)))


@functools.cache
def native_store_kernel() -> Callable[..., int] | None:
    """The C kernel `store_kv` calls (csrc/store_kv.c); None where it cannot be built."""
    # kv, num_slots, slots, num_tokens, k, k_stride, v, v_stride, row (csrc/store_kv.c)
    i64, ptr = native.I64, native.PTR
    return native.bind("store_kv", [ptr, i64, ptr, i64, ptr, i64, ptr, i64, i64])


def gather_sequence_kv(kv_layer: torch.Tensor, block_table: torch.Tensor, num_tokens: int) -> torch.Tensor:
    """One sequence's first `num_tokens` rows of KV, contiguous: [num_tokens, 2, num_kv_heads, head_dim].

    block_table: [>= ceil(num_tokens / block_size)] int64 block ids in sequence order.
    """
    block_size = kv_layer.shape[1]
    num_blocks = -(-num_tokens // block_size)
    return kv_layer[block_table[:num_blocks]].flatten(0, 1)[:num_tokens]


def paged_attention(q: torch.Tensor, kv_layer: torch.Tensor, meta: PagedAttentionMetadata) -> torch.Tensor:
    """Causal grouped-query attention of every sequence's new tokens over its paged KV.

    q: [num_tokens, num_heads, head_dim] fp32, the sequences' new tokens back to back (sequence i owns
    meta.query_lens[i] rows); kv_layer: [num_blocks, block_size, 2, num_kv_heads, head_dim] fp32 with the new
    tokens' K/V already stored (`store_kv`); sequence i's new tokens sit at positions
    context_lens[i] - query_lens[i] .. context_lens[i] - 1. Scale 1/sqrt(head_dim); query head h reads KV
    head h // (num_heads // num_kv_heads), as `causal_attention`.
    Returns [num_tokens, num_heads, head_dim] fp32.

    Sequences with one new token (decode) are attended together: by the C kernel reading the blocks in place
    (csrc/paged_decode_attention.c) where it is built, else in one padded, masked batched matmul over
    gathered blocks (`torch_decode_attention`); sequences with several (prefill chunks) one by one, by the
    C kernel reading the blocks in place (csrc/paged_prefill_attention.c) where it is built and the CPU
    has AVX-512 (`native.wide_vectors`: without it the kernel is 5-9x slower than SDPA), else through
    `causal_attention` over gathered blocks.
    Raises ValueError when the query lengths do not cover q's rows.
    """
    if sum(meta.query_lens) != q.shape[0]:
        raise ValueError(f"query_lens {meta.query_lens} do not cover the {q.shape[0]} query rows")
    if meta.decode_seqs is None:  # a pure decode step: no rows to pick out or scatter back
        return _decode_attention(q, kv_layer, meta)
    out = torch.empty_like(q)
    prefill = native_prefill_kernel() if _native_usable(q, kv_layer) and native.wide_vectors() else None
    start = 0
    for i, n in enumerate(meta.query_lens):
        if n > 1 and prefill is not None:
            native_prefill_attention(prefill, q[start : start + n], kv_layer, meta.block_tables[i],
                                     meta.context_lens[i], out[start : start + n])
        elif n > 1:
            kv = gather_sequence_kv(kv_layer, meta.block_tables[i], meta.context_lens[i])
            out[start : start + n] = causal_attention(q[start : start + n], kv[:, K_INDEX], kv[:, V_INDEX])
        start += n
    if meta.decode_seqs:
        out[meta.decode_rows] = _decode_attention(q[meta.decode_rows], kv_layer, meta)
    return out


def _decode_attention(q: torch.Tensor, kv_layer: torch.Tensor, meta: PagedAttentionMetadata) -> torch.Tensor:
    """One query per decoding sequence: q [batch, num_heads, head_dim]; returns the same shape."""
    kernel = native_decode_kernel() if _native_usable(q, kv_layer) else None
    if kernel is not None and q.shape[1] <= NATIVE_MAX_HEADS:
        return native_decode_attention(kernel, q, kv_layer, meta)
    return torch_decode_attention(q, kv_layer, meta)


def _native_usable(q: torch.Tensor, kv_layer: torch.Tensor) -> bool:
    """Whether the C kernels can read q ([tokens, heads, head_dim]) and `kv_layer` as they are: fp32 on the
    CPU, q's heads contiguous within a row, the pool contiguous, head_dim a multiple of 16 up to 256."""
    head_dim = q.shape[2]
    return (native.cpu_fp32(q, kv_layer) and q.stride(2) == 1 and q.stride(1) == head_dim
            and kv_layer.is_contiguous() and head_dim <= NATIVE_MAX_HEAD_DIM and head_dim % 16 == 0)


@functools.cache
def native_decode_kernel() -> Callable[..., int] | None:
    """The C decode-attention kernel (`native_decode_attention` calls it); None where it cannot be built."""
    # q, q_row_stride, kv, block_tables, table_stride, context_lens, out, batch, num_heads, num_kv_heads,
    # head_dim, block_size, scale, num_threads (csrc/paged_decode_attention.c)
    i64, ptr = native.I64, native.PTR
    return native.bind("paged_decode_attention",
                       [ptr, i64, ptr, ptr, i64, ptr, ptr, i64, i64, i64, i64, i64, native.F32, native.INT])


@functools.cache
def native_prefill_kernel() -> Callable[..., int] | None:
    """The C prefill-attention kernel (`native_prefill_attention` calls it); None where it cannot be built."""
    # q, q_row_stride, kv, block_table, num_tokens, context_len, out, num_heads, num_kv_heads, head_dim,
    # block_size, scale, num_threads (csrc/paged_prefill_attention.c)
    i64, ptr = native.I64, native.PTR
    return native.bind("paged_prefill_attention",
                       [ptr, i64, ptr, ptr, i64, i64, ptr, i64, i64, i64, i64, native.F32, native.INT])


def native_prefill_attention(kernel: Callable[..., int], q: torch.Tensor, kv_layer: torch.Tensor,
                             block_table: torch.Tensor, context_len: int, out: torch.Tensor) -> None:
    """One sequence's causal attention of its `num_tokens` new tokens (q [num_tokens, num_heads, head_dim],
    rows may be strided, heads contiguous) over its `context_len` keys, read in place through
    `block_table` ([>= ceil(context_len / block_size)] int64, contiguous) by the C kernel
    (csrc/paged_prefill_attention.c) on `torch.get_num_threads()` threads, written into `out` (a contiguous
    [num_tokens, num_heads, head_dim] fp32 view). Raises MemoryError when the kernel cannot allocate its
    scratch (-1), ValueError for shapes it does not take (-2)."""
    num_tokens, num_heads, head_dim = q.shape
    status = kernel(
        q.data_ptr(), q.stride(0), kv_layer.data_ptr(), block_table.data_ptr(), num_tokens, context_len,
        out.data_ptr(), num_heads, kv_layer.shape[3], head_dim, kv_layer.shape[1], head_dim**-0.5,
        torch.get_num_threads(),
    )
    _raise_for(status, "prefill", q.shape)


def native_decode_attention(
    kernel: Callable[..., int], q: torch.Tensor, kv_layer: torch.Tensor, meta: PagedAttentionMetadata
) -> torch.Tensor:
    """`_decode_attention` by the C kernel (csrc/paged_decode_attention.c), on `torch.get_num_threads()`
    threads: q's rows may be strided (heads contiguous), `kv_layer` contiguous fp32 on the CPU.
    Raises MemoryError when the kernel cannot allocate its scratch (-1), ValueError for shapes past its
    limits (-2: head_dim not a multiple of 16 or over 256, or more than 128 query heads)."""
    batch, num_heads, head_dim = q.shape
    out = torch.empty(batch, num_heads, head_dim, dtype=q.dtype)
    status = kernel(
        q.data_ptr(), q.stride(0), kv_layer.data_ptr(), meta.decode_blocks.data_ptr(),
        meta.decode_blocks.numel() // batch, meta.decode_lens.data_ptr(), out.data_ptr(), batch, num_heads,
        kv_layer.shape[3], head_dim, kv_layer.shape[1], head_dim**-0.5, torch.get_num_threads(),
    )
    _raise_for(status, "decode", q.shape)
    return out


def _raise_for(status: int, kernel: str, q_shape: torch.Size) -> None:
    """A C attention kernel's status as Python's exception (0: none); q_shape [tokens, heads, head_dim]."""
    if status == -2:
        raise ValueError(f"paged_{kernel}_attention: head_dim {q_shape[2]} or {q_shape[1]} query heads "
                         "outside the kernel's limits")
    if status:
        raise MemoryError(f"paged_{kernel}_attention could not allocate its scratch")


def torch_decode_attention(
    q: torch.Tensor, kv_layer: torch.Tensor, meta: PagedAttentionMetadata
) -> torch.Tensor:
    """`_decode_attention` in torch ops (any device and dtype): the reference the C kernel is tested against.

    The blocks are gathered in one copy straight into a head-major [2, kv_heads, batch * max_blocks,
    block_size, head_dim] layout (`index_select` over a permuted view of the pool), so K and V of each
    (KV head, sequence) are contiguous and both matmuls are plain bmm batched over (KV head, sequence); the
    query heads sharing a KV head are the rows of one matmul. Against gathering token-major and then
    transposing (two copies), measured here interleaved in one process (torch 2.13, 1 thread, 32
    sequences, SmolLM2's 3 KV heads of 64, medians of 60, a loaded machine): 80 keys 0.5-0.9 ms a layer
    either way (within the noise), 300 keys 2.9 against 3.3 ms, 1000 keys 42 against 80 ms.
    """
    batch, num_heads, head_dim = q.shape
    num_kv_heads = kv_layer.shape[3]
    group = num_heads // num_kv_heads
    num_keys = meta.decode_mask.shape[-1]
    kv = kv_layer.permute(2, 3, 0, 1, 4).index_select(2, meta.decode_blocks)  # [2, kv_heads, blocks, bs, d]
    k = kv[K_INDEX].view(num_kv_heads * batch, num_keys, head_dim)
    v = kv[V_INDEX].view(num_kv_heads * batch, num_keys, head_dim)
    grouped = q.view(batch, num_kv_heads, group, head_dim).transpose(0, 1).reshape(-1, group, head_dim)
    scores = torch.bmm(grouped, k.transpose(1, 2)).mul_(head_dim**-0.5)
    scores = scores.view(num_kv_heads, batch, group, num_keys).add_(meta.decode_mask.view(1, batch, 1, -1))
    probs = torch.softmax(scores, dim=-1).view(num_kv_heads * batch, group, num_keys)
    out = torch.bmm(probs, v).view(num_kv_heads, batch, group, head_dim)
    return out.transpose(0, 1).reshape(batch, num_heads, head_dim)
