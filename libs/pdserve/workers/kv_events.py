"""A worker's KV cache events (vLLM's KV events) and digests, published for the KV-aware router. For a
hybrid model the same batches carry its state checkpoints (`CheckpointStored` / `CheckpointRemoved`), so
the router predicts the usable hit: the KV hit and the checkpoint the prefill can resume from."""

from __future__ import annotations

import time
from collections.abc import Callable

from pdserve.bus import Bus
from pdserve.engine.block_manager import BlockManager
from pdserve.messages import AllBlocksCleared, KVDigest, KVEvents
from pdserve.messages.kv_events import KVEvent


class KVEventPublisher:
    """Publishes batches of `BlockManager` events on `pds.kv.<worker_id>` with a `seq` that grows by one
    per batch, and `KVDigest`s (block count + XOR of held hashes) on `pds.kvdigest.<worker_id>`.
    `take_events`: where the events come from (default the block manager's; a worker passes
    `LLMEngine.take_kv_events`, which adds each KV tier's, labelled by tier, and a hybrid's state
    checkpoint events). The digest covers the pool only: what the tiers and checkpoints hold is told by
    their events alone."""

    def __init__(
        self, bus: Bus, worker_id: str, block_manager: BlockManager,
        take_events: Callable[[], list[KVEvent]] | None = None,
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

    async def _publish(self, events: list[KVEvent]) -> None:
        seq, self.next_seq = self.next_seq, self.next_seq + 1
        await self.bus.publish(
            self.bus.subjects.kv_events(self.worker_id),
            KVEvents(worker_id=self.worker_id, seq=seq, events=tuple(events), ts=time.time()),
        )
