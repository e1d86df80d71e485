"""KV cache events (vLLM's `BlockStored` / `BlockRemoved` / `AllBlocksCleared`): what a worker's prefix
cache gained or lost, as the block manager records them and the router's index consumes them."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict


class _KVEvent(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class BlockStored(_KVEvent):
    """Full blocks now held in the worker's prefix cache, in chain order (`block_hashes[0]`'s parent is
    `parent_block_hash`; None = the sequence's first block). Hashes: `pdserve.engine.block_hash`.
    `tier`: where they are held — "pool" (the paged pool) or a tier below it (`engine/kv_tiers`: "offload",
    "disk"); a tier's events carry no parent (its blocks are stored one by one, as the pool evicts them)."""

    kind: Literal["BlockStored"] = "BlockStored"
    block_hashes: tuple[int, ...]
    parent_block_hash: int | None = None
    tier: str = "pool"


class BlockRemoved(_KVEvent):
    """Blocks evicted from the worker's prefix cache: from its pool (`tier` "pool", where an offload tier
    may still hold them) or from a tier below it."""

    kind: Literal["BlockRemoved"] = "BlockRemoved"
    block_hashes: tuple[int, ...]
    tier: str = "pool"


class AllBlocksCleared(_KVEvent):
    """Sent at every worker start: whatever an index held for this worker is gone."""

    kind: Literal["AllBlocksCleared"] = "AllBlocksCleared"


class CheckpointStored(_KVEvent):
    """A hybrid model's recurrent state after `num_tokens` tokens is now held, under the chained hash of the
    block ending there (`engine/state_pool.py`): a prefix hit can resume from it. `tier`: where — "pool"
    (a slot of the state pool) or a tier below it ("offload", "disk": `engine/kv_tiers`)."""

    kind: Literal["CheckpointStored"] = "CheckpointStored"
    block_hash: int
    num_tokens: int
    tier: str = "pool"


class CheckpointRemoved(_KVEvent):
    """State checkpoints evicted, by the hash they were stored under, from the state pool (`tier` "pool",
    where a tier below may still hold them) or from a tier below it."""

    kind: Literal["CheckpointRemoved"] = "CheckpointRemoved"
    block_hashes: tuple[int, ...]
    tier: str = "pool"
