"""A worker's KV cache events (vLLM's KV events: pds.kv.<id>, `KVEvents`) and their periodic digest
(pds.kvdigest.<id>, `KVDigest`), which the router's KV index is built from. The events themselves
(`BlockStored`, `BlockRemoved`, `AllBlocksCleared`, and a hybrid's `CheckpointStored` / `CheckpointRemoved`)
are the engine's."""

from __future__ import annotations

from typing import Annotated

from pydantic import Field

from pdserve.engine.kv_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    CheckpointRemoved,
    CheckpointStored,
)
from pdserve.messages.common import Message

KVEvent = BlockStored | BlockRemoved | AllBlocksCleared | CheckpointStored | CheckpointRemoved


class KVEvents(Message):
    """A batch of KV cache events of one worker. `seq` increases by one per batch, so a receiver
    detects a lost batch (and then waits for the next `KVDigest` or clears the worker)."""

    worker_id: str
    seq: int = Field(ge=0)
    events: tuple[Annotated[KVEvent, Field(discriminator="kind")], ...]
    ts: float


class KVDigest(Message):
    """Periodic summary of a worker's prefix cache for drift detection: the block count and the XOR of
    every held block hash (order-free, updated in O(1) per event)."""

    worker_id: str
    seq: int = Field(description="The last KVEvents seq this digest includes.")
    num_blocks: int
    xor_hashes: int
    ts: float
