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
from pdserve.engine.kv_tiers.tier import TierChange, WriteOn, leading_run


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
    """

    write_on: WriteOn = "evict"

    def __init__(self, capacity_blocks: int, name: str = "offload") -> None:
        if capacity_blocks < 0:
            raise ValueError(f"capacity_blocks must be >= 0, got {capacity_blocks}")
        self.name = name
        self.capacity_blocks = capacity_blocks
        self._blocks: OrderedDict[int, _Held] = OrderedDict()  # first = least recently used
        self._lock = threading.Lock()
        self._changes: list[TierChange] = []
        self.num_puts = 0
        self.num_evictions = 0
        self.num_hits = 0
        self.num_corrupt = 0

    @property
    def num_blocks(self) -> int:
        """Blocks held now, <= capacity_blocks."""
        return len(self._blocks)

    def __contains__(self, block_hash: int) -> bool:
        return block_hash in self._blocks

    def lookup(self, block_hashes: Sequence[int]) -> int:
        with self._lock:
            return leading_run(block_hashes, self._blocks)

    def put(self, block_hash: int, block: torch.Tensor) -> None:
        if self.capacity_blocks == 0:
            return
        with self._lock:
            if block_hash in self._blocks:
                self._blocks.move_to_end(block_hash)
                return
        copy = block.clone(memory_format=torch.contiguous_format)  # outside the lock: the big part
        held = _Held(copy, block_digest(copy))
        with self._lock:
            if block_hash in self._blocks:
                self._blocks.move_to_end(block_hash)
                return
            while len(self._blocks) >= self.capacity_blocks:
                evicted, _ = self._blocks.popitem(last=False)
                self.num_evictions += 1
                self._changes.append(TierChange(False, evicted))
            self._blocks[block_hash] = held
            self.num_puts += 1
            self._changes.append(TierChange(True, block_hash))

    def get_into(self, block_hash: int, out: torch.Tensor) -> bool:
        with self._lock:
            held = self._blocks.get(block_hash)
            if held is None:
                return False
            self._blocks.move_to_end(block_hash)
        try:
            out.copy_(held.block)
            ok = block_digest(out) == held.digest
        except (RuntimeError, ValueError):
            return False
        if not ok:
            with self._lock:
                if self._blocks.get(block_hash) is held:
                    del self._blocks[block_hash]
                    self._changes.append(TierChange(False, block_hash))
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
