"""The offload tier: KV blocks in host memory below the paged pool, LRU, checksummed (issue 16, the first
seed's stage 2: "add capacity where you are bound … add native CPU offloading").

On a GPU worker the paged pool is device memory and this tier is the CPU's; on a CPU worker both are host
memory, so what the tier buys is capacity (blocks kept instead of dropped, prefills skipped), not
bandwidth. vLLM's CPU offloading connector and SGLang's HiCache host tier are the same idea.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Sequence
from typing import NamedTuple

import torch

from pdserve.engine.kv_tiers.checksum import block_digest
from pdserve.engine.kv_tiers.tier import KeySpace, TierChange, WriteOn, leading_run


class _Held(NamedTuple):
    block: torch.Tensor
    digest: int


class HostOffloadTier:
    """Up to `capacity_blocks` blocks in host memory, keyed by chained block hash, evicted least recently
    used (a hit or a repeated put makes a block the most recent). Each block is stored as a private copy
    with its xxh3-64 digest; `get_into` verifies the copy it made against that digest. Thread-safe (one
    lock): the tier set's writer thread puts while the engine's thread looks up and reads.

    Memory: capacity_blocks × the block's bytes (num_paged_layers × block_size × row bytes; SmolLM2 fp32:
    16 tokens × 45 KiB = 720 KiB a block). Raises ValueError for a negative capacity; 0 holds nothing.
    State checkpoints (`space="checkpoint"`, `tier.KVTier`) share the capacity: `capacity_blocks` bounds
    blocks and checkpoints together, keyed by (space, hash).
    """

    write_on: WriteOn = "evict"
    holds_checkpoints = True

    def __init__(self, capacity_blocks: int, name: str = "offload") -> None:
        if capacity_blocks < 0:
            raise ValueError(f"capacity_blocks must be >= 0, got {capacity_blocks}")
        self.name = name
        self.capacity_blocks = capacity_blocks
        self._blocks: OrderedDict[tuple[KeySpace, int], _Held] = OrderedDict()  # first = least recent
        self._lock = threading.Lock()
        self._changes: list[TierChange] = []
        self.num_puts = 0
        self.num_evictions = 0
        self.num_hits = 0
        self.num_corrupt = 0

    @property
    def num_blocks(self) -> int:
        """Entries held now (KV blocks and checkpoints), <= capacity_blocks."""
        return len(self._blocks)

    @property
    def num_checkpoints(self) -> int:
        """State checkpoints held now."""
        with self._lock:
            return sum(1 for space, _ in self._blocks if space == "checkpoint")

    def __contains__(self, block_hash: int) -> bool:
        return ("kv", block_hash) in self._blocks

    def lookup(self, block_hashes: Sequence[int], space: KeySpace = "kv") -> int:
        with self._lock:
            return leading_run(block_hashes, self._blocks, space)

    def put(self, block_hash: int, block: torch.Tensor, space: KeySpace = "kv") -> None:
        if self.capacity_blocks == 0:
            return
        key = (space, block_hash)
        with self._lock:
            if key in self._blocks:
                self._blocks.move_to_end(key)
                return
        copy = block.clone(memory_format=torch.contiguous_format)  # outside the lock: the big part
        held = _Held(copy, block_digest(copy))
        with self._lock:
            if key in self._blocks:
                self._blocks.move_to_end(key)
                return
            while len(self._blocks) >= self.capacity_blocks:
                (evicted_space, evicted), _ = self._blocks.popitem(last=False)
                self.num_evictions += 1
                self._changes.append(TierChange(False, evicted, evicted_space))
            self._blocks[key] = held
            self.num_puts += 1
            self._changes.append(TierChange(True, block_hash, space))

    def get_into(self, block_hash: int, out: torch.Tensor, space: KeySpace = "kv") -> bool:
        key = (space, block_hash)
        with self._lock:
            held = self._blocks.get(key)
            if held is None:
                return False
            self._blocks.move_to_end(key)
        try:
            out.copy_(held.block)
            ok = block_digest(out) == held.digest
        except (RuntimeError, ValueError):
            return False
        if not ok:
            with self._lock:
                if self._blocks.get(key) is held:
                    del self._blocks[key]
                    self._changes.append(TierChange(False, block_hash, space))
                self.num_corrupt += 1
            return False
        self.num_hits += 1
        return True

    def take_changes(self) -> list[TierChange]:
        """Blocks stored and removed (LRU evictions, corrupt copies dropped) since the last call, oldest
        first: what the worker's KV events tell the router about this tier."""
        with self._lock:
            changes, self._changes = self._changes, []
        return changes
