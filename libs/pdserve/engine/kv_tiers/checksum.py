"""Per-block checksums of a KV tier: xxh3-64 over the block's bytes, the same hash the KV transfer verifies
with (`transfer/checksum.py`; the engine sits below that layer so hashes here itself). xxh3-64 hashes at
memory speed (~12 GB/s on this machine) and detects any flipped byte with probability 1 - 2^-64."""

from __future__ import annotations

import torch
import xxhash


def block_digest(block: torch.Tensor) -> int:
    """xxh3-64 of `block`'s bytes, u64. `block`: a contiguous CPU tensor of any dtype (bf16 included).
    Raises ValueError for a non-contiguous or non-CPU tensor."""
    if block.device.type != "cpu" or not block.is_contiguous():
        raise ValueError(f"a tier block must be contiguous on CPU, got device={block.device}")
    return xxhash.xxh3_64_intdigest(block.reshape(-1).view(torch.uint8).numpy())
