"""A model of one worker's prefix cache, for offline replay and the routing benchmark.

LRU of full blocks with a capacity, as vLLM's prefix caching keeps free cached blocks (vLLM docs,
"Automatic Prefix Caching"): a prefill hits the leading run of its chained block hashes that is
cached, then stores every full block of its prompt; when full, the least recently used blocks are
evicted. A chain is touched tail first, so a sequence's last blocks are evicted before its first
ones (vLLM frees a request's blocks in reverse order for the same reason). Every change is reported
as the `KVEvents` a real worker publishes, so the router's index is fed exactly as in production.
No running-request pinning: a prefill worker frees a request's blocks as soon as its KV is sent.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Sequence

from pdserve.messages import AllBlocksCleared, BlockRemoved, BlockStored, KVDigest, KVEvents


class PrefixCacheModel:
    """One worker's prefix cache: `capacity_blocks` full blocks. Call `start()` first (it emits the
    `AllBlocksCleared` a worker sends at start)."""

    def __init__(self, worker_id: str, capacity_blocks: int) -> None:
        if capacity_blocks < 1:
            raise ValueError(f"capacity_blocks must be ≥ 1, got {capacity_blocks}")
        self.worker_id = worker_id
        self.capacity_blocks = capacity_blocks
        self._lru: OrderedDict[int, None] = OrderedDict()  # oldest first
        self._xor = 0
        self._seq = -1

    def _batch(self, events: list) -> KVEvents:
        self._seq += 1
        return KVEvents(worker_id=self.worker_id, seq=self._seq, events=tuple(events), ts=time.time())

    def start(self) -> KVEvents:
        """(Re)start: the cache is empty; returns the batch announcing it."""
        self._lru.clear()
        self._xor = 0
        self._seq = -1
        return self._batch([AllBlocksCleared()])

    def lookup(self, block_hashes: Sequence[int]) -> int:
        """Number of leading blocks of `block_hashes` cached (no recency change)."""
        n = 0
        for h in block_hashes:
            if h not in self._lru:
                break
            n += 1
        return n

    def prefill(
        self, block_hashes: Sequence[int], max_hit_blocks: int | None = None
    ) -> tuple[int, KVEvents | None]:
        """Run a prefill of a prompt whose full blocks hash to `block_hashes`: returns (blocks hit,
        the KV events it caused or None). At most `max_hit_blocks` count as hits (the engine recomputes
        the prompt's last token, so a fully cached prompt still computes its last block)."""
        hit = self.lookup(block_hashes)
        if max_hit_blocks is not None:
            hit = min(hit, max_hit_blocks)
        stored, parent = [], None
        new_start = None
        for i, h in enumerate(block_hashes):
            if h not in self._lru:
                if new_start is None:
                    new_start, parent = i, (block_hashes[i - 1] if i else None)
                stored.append(h)
        for h in reversed(block_hashes):  # tail first: the sequence's first blocks stay longest
            if h in self._lru:
                self._lru.move_to_end(h)
            else:
                self._lru[h] = None
                self._xor ^= h
        removed = []
        while len(self._lru) > self.capacity_blocks:
            h, _ = self._lru.popitem(last=False)
            self._xor ^= h
            removed.append(h)
        events: list = []
        if stored:
            events.append(BlockStored(block_hashes=tuple(stored), parent_block_hash=parent))
        if removed:
            events.append(BlockRemoved(block_hashes=tuple(removed)))
        return hit, (self._batch(events) if events else None)

    def digest(self) -> KVDigest:
        """The periodic digest a worker publishes: block count and XOR of held hashes at the last seq."""
        return KVDigest(
            worker_id=self.worker_id,
            seq=max(self._seq, 0),
            num_blocks=len(self._lru),
            xor_hashes=self._xor,
            ts=time.time(),
        )

    def __len__(self) -> int:
        return len(self._lru)
