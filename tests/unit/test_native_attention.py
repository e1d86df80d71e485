"""The C attention kernels (kernels/csrc/paged_decode_attention.c, paged_prefill_attention.c) against the
torch path; their build."""

from __future__ import annotations

import logging

import pytest
import torch

from pdserve.kernels import native
from pdserve.kernels.attention import causal_attention
from pdserve.kernels.kv_pack import token_slots
from pdserve.kernels.paged_attention import (
    K_INDEX,
    V_INDEX,
    attention_metadata,
    gather_sequence_kv,
    native_decode_attention,
    native_decode_kernel,
    native_prefill_attention,
    native_prefill_kernel,
    paged_attention,
    store_kv,
    torch_decode_attention,
)

BLOCK_SIZE, NUM_BLOCKS = 4, 96


def kernel(build=native_decode_kernel):
    fn = build()
    if fn is None:  # a machine with a C compiler (every one pdserve's README sets up) must build it
        pytest.fail(f"{build.__name__} did not build (see the log)")
    return fn


def on_threads(threads: int, fn):
    torch.set_num_threads(threads)
    try:
        return fn()
    finally:
        torch.set_num_threads(1)


def filled_pool(context_lens, num_kv_heads, head_dim, g):
    """A pool with each sequence's KV in shuffled blocks; returns (pool, block tables [seqs, max_blocks])."""
    pool = torch.randn(NUM_BLOCKS, BLOCK_SIZE, 2, num_kv_heads, head_dim, generator=g)
    order = torch.randperm(NUM_BLOCKS, generator=g).tolist()
    width = -(-max(context_lens) // BLOCK_SIZE)
    tables = torch.zeros(len(context_lens), width, dtype=torch.int64)
    for i, n in enumerate(context_lens):
        need = -(-n // BLOCK_SIZE)
        tables[i, :need] = torch.tensor(order[:need])
        order = order[need:]
        k, v = (torch.randn(n, num_kv_heads, head_dim, generator=g) for _ in range(2))
        store_kv(pool, token_slots(tables[i, :need].tolist(), 0, n, BLOCK_SIZE), k, v)
    return pool, tables


@pytest.mark.parametrize(
    "context_lens, num_heads, num_kv_heads, head_dim",
    [
        ([1], 6, 2, 16),
        ([4, 5, 17, 1], 6, 2, 16),  # lengths on, past and inside a block boundary
        ([33, 9], 9, 3, 64),  # SmolLM2's heads
        ([70, 3, 12], 4, 4, 128),  # no grouping (MHA), a Llama-sized head
        ([20], 8, 1, 32),  # one KV head for every query head (MQA)
    ],
)
def test_the_kernel_equals_the_torch_path(context_lens, num_heads, num_kv_heads, head_dim):
    g = torch.Generator().manual_seed(sum(context_lens) + head_dim)
    pool, tables = filled_pool(context_lens, num_kv_heads, head_dim, g)
    meta = attention_metadata(tables, context_lens, [1] * len(context_lens), BLOCK_SIZE)
    # q as the model passes it: the query heads of a [tokens, q + k + v heads, head_dim] projection (strided)
    qkv = torch.randn(len(context_lens), num_heads + 2 * num_kv_heads, head_dim, generator=g)
    q = qkv[:, :num_heads]
    expected = torch_decode_attention(q.contiguous(), pool, meta)
    for threads in (1, 2):
        out = on_threads(threads, lambda: native_decode_attention(kernel(), q, pool, meta))
        torch.testing.assert_close(out, expected, atol=2e-6, rtol=1e-5)


@pytest.mark.parametrize(
    "num_tokens, context_len, num_heads, num_kv_heads, head_dim",
    [
        (2, 2, 6, 2, 16),  # the shortest prompt the prefill path takes
        (16, 16, 9, 3, 64),  # one vector of keys; SmolLM2's heads
        (17, 17, 9, 3, 64),  # a vector of keys and one into the chunk's second
        (32, 32, 9, 3, 64),  # one tile of queries, one chunk of keys
        (33, 33, 9, 3, 64),  # a tile and a token; a chunk and a key
        (40, 75, 9, 3, 64),  # a later chunk of a chunked prefill: 35 past keys, tiles across blocks
        (33, 33, 4, 4, 128),  # no grouping (MHA), a Llama-sized head
        (21, 30, 8, 1, 32),  # one KV head for every query head (MQA)
        (5, 130, 2, 1, 256),  # the largest head, a short chunk after a long past
    ],
)
def test_the_prefill_kernel_equals_causal_attention_over_the_gathered_kv(
    num_tokens, context_len, num_heads, num_kv_heads, head_dim
):
    g = torch.Generator().manual_seed(num_tokens * 1000 + context_len + head_dim)
    pool, tables = filled_pool([context_len], num_kv_heads, head_dim, g)
    qkv = torch.randn(num_tokens, num_heads + 2 * num_kv_heads, head_dim, generator=g)
    q = qkv[:, :num_heads]  # strided rows, as the model passes them
    kv = gather_sequence_kv(pool, tables[0], context_len)
    expected = causal_attention(q, kv[:, K_INDEX], kv[:, V_INDEX])
    for threads in (1, 2):
        out = torch.empty(num_tokens, num_heads, head_dim)
        on_threads(threads, lambda o=out: native_prefill_attention(
            kernel(native_prefill_kernel), q, pool, tables[0], context_len, o))
        torch.testing.assert_close(out, expected, atol=2e-6, rtol=1e-5)


def test_the_prefill_kernel_refuses_more_queries_than_keys():
    g = torch.Generator().manual_seed(4)
    pool, tables = filled_pool([8], 2, 16, g)
    with pytest.raises(ValueError, match="paged_prefill_attention"):
        native_prefill_attention(kernel(native_prefill_kernel), torch.randn(9, 6, 16), pool, tables[0], 8,
                                 torch.empty(9, 6, 16))


def test_a_head_size_the_kernel_does_not_take_runs_the_torch_path():
    g = torch.Generator().manual_seed(3)
    pool, tables = filled_pool([9, 4], 2, 8, g)  # head_dim 8: not a multiple of the kernel's 16
    meta = attention_metadata(tables, [9, 4], [1, 1], BLOCK_SIZE)
    q = torch.randn(2, 6, 8, generator=g)
    kernel()
    with pytest.raises(ValueError, match="head_dim 8"):
        native_decode_attention(kernel(), q, pool, meta)
    torch.testing.assert_close(paged_attention(q, pool, meta), torch_decode_attention(q, pool, meta))


def test_a_mixed_batch_takes_the_kernels_for_its_decode_and_prefill_rows_and_matches_the_torch_path(
    monkeypatch
):
    g = torch.Generator().manual_seed(5)
    context_lens, query_lens = [11, 8, 9, 33], [3, 1, 9, 1]
    pool, tables = filled_pool(context_lens, 2, 16, g)
    meta = attention_metadata(tables, context_lens, query_lens, BLOCK_SIZE)
    q = torch.randn(sum(query_lens), 6, 16, generator=g)
    kernel()
    monkeypatch.setattr(native, "wide_vectors", lambda: True)  # the prefill kernel on any CPU
    with_kernel = paged_attention(q, pool, meta)
    monkeypatch.setattr("pdserve.kernels.paged_attention.native_decode_kernel", lambda: None)
    monkeypatch.setattr("pdserve.kernels.paged_attention.native_prefill_kernel", lambda: None)
    torch.testing.assert_close(with_kernel, paged_attention(q, pool, meta), atol=2e-6, rtol=1e-5)


def test_without_avx512_prefill_rows_take_sdpa_and_decode_rows_the_kernel(monkeypatch):
    g = torch.Generator().manual_seed(6)
    context_lens, query_lens = [11, 9], [3, 1]
    pool, tables = filled_pool(context_lens, 2, 16, g)
    meta = attention_metadata(tables, context_lens, query_lens, BLOCK_SIZE)
    q = torch.randn(sum(query_lens), 6, 16, generator=g)
    decode_calls = []
    decode = native_decode_attention
    monkeypatch.setattr(native, "wide_vectors", lambda: False)
    monkeypatch.setattr("pdserve.kernels.paged_attention.native_prefill_attention",
                        lambda *args: pytest.fail("the prefill kernel ran without AVX-512"))
    monkeypatch.setattr("pdserve.kernels.paged_attention.native_decode_attention",
                        lambda *args: decode_calls.append(1) or decode(*args))
    out = paged_attention(q, pool, meta)
    assert decode_calls == [1]
    kv = gather_sequence_kv(pool, tables[0], context_lens[0])
    torch.testing.assert_close(out[:3], causal_attention(q[:3], kv[:, K_INDEX], kv[:, V_INDEX]))


def test_wide_vectors_reads_avx512f_from_the_cpu_flags(monkeypatch):
    for flags, wide in (("fma avx avx2", False), ("avx2 avx512f avx512dq", True), ("avx512fp16", False)):
        monkeypatch.setattr(native, "_cpu_identity", lambda f=flags: f"model name\t: X\nflags\t\t: {f}")
        assert native.wide_vectors.__wrapped__() is wide, flags  # uncached: this process's answer stays


def test_the_build_is_cached_per_source_and_cpu_and_can_be_switched_off(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    native.load.cache_clear()
    try:
        assert native.load("paged_decode_attention") is not None
        built = list((tmp_path / "pdserve" / "kernels").glob("paged_decode_attention-*.so"))
        assert len(built) == 1
        native.load.cache_clear()
        mtime = built[0].stat().st_mtime_ns
        assert native.load("paged_decode_attention") is not None
        assert built[0].stat().st_mtime_ns == mtime  # loaded from the cache, not rebuilt
        native.load.cache_clear()
        monkeypatch.setenv("PDS_NATIVE_KERNELS", "0")
        assert native.load("paged_decode_attention") is None
    finally:
        native.load.cache_clear()


def test_a_changed_header_builds_the_kernel_anew(tmp_path, monkeypatch):
    source = tmp_path / "csrc"
    source.mkdir()
    (source / "two.h").write_text("#define TWO 2\n")
    (source / "twice.c").write_text('#include "two.h"\nint twice(int x) { return TWO * x; }\n')
    monkeypatch.setattr(native, "SOURCE_DIR", source)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    native.load.cache_clear()
    try:
        assert native.load("twice").twice(21) == 42
        (source / "two.h").write_text("#define TWO 3\n")  # only the header changes
        native.load.cache_clear()
        assert native.load("twice").twice(21) == 63
        assert len(list((tmp_path / "cache" / "pdserve" / "kernels").glob("twice-*.so"))) == 2
    finally:
        native.load.cache_clear()


def test_without_a_compiler_the_kernel_is_absent_and_says_why(tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setenv("CC", "no-such-compiler")
    native.load.cache_clear()
    try:
        with caplog.at_level(logging.WARNING, logger="pdserve.kernels.native"):
            assert native.load("paged_decode_attention") is None
        assert "no C compiler" in caplog.text
    finally:
        native.load.cache_clear()
