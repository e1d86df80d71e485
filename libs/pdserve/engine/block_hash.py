"""Chained block hashes for prefix caching, shared by every worker and the router.

A full block of `block_size` tokens is identified by hash(parent block's hash, its token ids, extra
keys); the first block's parent is derived from the cluster-wide `hash_seed`. Equal hashes therefore
mean equal prefixes (up to 64-bit collisions), the idea of vLLM's prefix caching (vLLM docs, "Automatic
Prefix Caching"). Only full blocks are hashed. `extra_keys` (e.g. `cache_salt`) make otherwise equal
prefixes never share blocks.

Hash: xxh3-64 (the `xxhash` package) over little-endian bytes: parent u64, token ids as int32, then
extra keys UTF-8 — fast, stable across processes and Python versions (unlike `hash()`).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import xxhash


def root_hash(hash_seed: int) -> int:
    """The parent hash of every sequence's first block, u64."""
    return xxhash.xxh3_64_intdigest(int(hash_seed).to_bytes(8, "little", signed=False))


def block_hash(parent: int, token_ids: Sequence[int], extra_keys: str | None = None) -> int:
    """Hash of one full block. `parent` u64; `token_ids` the block's tokens; returns u64."""
    h = xxhash.xxh3_64(parent.to_bytes(8, "little"))
    h.update(np.asarray(token_ids, dtype=np.int32).tobytes())
    if extra_keys:
        h.update(extra_keys.encode())
    return h.intdigest()


def hash_blocks(token_ids: Sequence[int], block_size: int, hash_seed: int = 0,
                extra_keys: str | None = None) -> list[int]:
    """Chained hashes of every full block of `token_ids` (len(token_ids) // block_size of them)."""
    hashes, parent = [], root_hash(hash_seed)
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        parent = block_hash(parent, token_ids[start:start + block_size], extra_keys)
        hashes.append(parent)
    return hashes
