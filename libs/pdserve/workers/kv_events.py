"""A worker's KV cache events (vLLM's KV events) and digests, published for the KV-aware router."""

from __future__ import annotations

import time
from collections.abc import Callable

from pdserve.bus import Bus
from pdserve.engine.block_manager import BlockManager
from pdserve.messages import AllBlocksCleared, BlockRemoved, BlockStored, KVDigest, KVEvents


class KVEventPublisher:
    """Publishes batches of `BlockManager` events on `pds.kv.<worker_id>` with a `seq` that grows by one
    per batch, and `KVDigest`s (block count + XOR of held hashes) on `pds.kvdigest.<worker_id>`.
    `take_events`: where the events come from (default the block manager's; a worker with KV tiers passes
    `LLMEngine.take_kv_events`, which adds each tier's, labelled by tier). The digest covers the pool only:
    what the tiers hold is told by their events alone."""

    def __init__(
        self, bus: Bus, worker_id: str, block_manager: BlockManager,
        take_events: Callable[[], list[BlockStored | BlockRemoved]] | None = None,
    ) -> None:
        self.bus = bus
        self.worker_id = worker_id
        self.block_manager = block_manager
        self.take_events = take_events or block_manager.take_events
        self.next_seq = 0

    async def cleared(self) -> None:
        """AllBlocksCleared: sent at every worker start (the cache is empty; forget what this id held)."""
        await self._publish([AllBlocksCleared()])

    async def flush(self) -> None:
        """Publish whatever the block manager recorded since the last flush (nothing if empty)."""
        events = self.take_events()
        if events:
            await self._publish(events)

    async def digest(self) -> None:
        """Flush, then publish the digest covering every batch published so far."""
        await self.flush()
        bm = self.block_manager
        await self.bus.publish(
            self.bus.subjects.kv_digest(self.worker_id),
            KVDigest(
                worker_id=self.worker_id,
                seq=max(self.next_seq - 1, 0),
                num_blocks=len(bm.hash_to_block),
                xor_hashes=bm.xor_hashes,
                ts=time.time(),
            ),
        )

    async def _publish(self, events: list[BlockStored | BlockRemoved | AllBlocksCleared]) -> None:
        seq, self.next_seq = self.next_seq, self.next_seq + 1
        await self.bus.publish(
            self.bus.subjects.kv_events(self.worker_id),
            KVEvents(worker_id=self.worker_id, seq=seq, events=tuple(events), ts=time.time()),
        )
