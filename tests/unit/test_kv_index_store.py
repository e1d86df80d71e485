"""The router's index of the shared store (tier "store"): one set for the cluster, learned from any
worker's KV events, credited to every worker, kept across a worker's restart, bounded."""

from __future__ import annotations

import time

from pdserve.messages import AllBlocksCleared, BlockRemoved, BlockStored, KVEvents
from pdserve.routing.kv_index import KVIndex


def batch(worker: str, seq: int, *events) -> KVEvents:
    return KVEvents(worker_id=worker, seq=seq, events=events, ts=time.time())


def test_a_block_one_worker_published_counts_as_a_store_hit_for_every_worker():
    idx = KVIndex()
    idx.apply(batch("a", 0, AllBlocksCleared(), BlockStored(block_hashes=(1, 2, 3)),
                    BlockStored(block_hashes=(1, 2, 3), tier="store")))
    idx.apply(batch("b", 0, AllBlocksCleared(), BlockStored(block_hashes=(1,))))
    assert idx.overlaps_by_tier([1, 2, 3, 4], "a") == {"pool": 3}  # its pool ranks before the store
    assert idx.overlaps_by_tier([1, 2, 3, 4], "b") == {"pool": 1, "store": 2}
    assert idx.overlaps([1, 2, 3], ["b"]) == {"b": 1}  # the pool-only overlap is unchanged
    assert idx.num_tier_blocks("b", "store") == 3


def test_a_workers_restart_keeps_what_it_published_in_the_store():
    idx = KVIndex()
    idx.apply(batch("a", 0, AllBlocksCleared(), BlockStored(block_hashes=(5, 6), tier="store")))
    idx.apply(batch("a", 0, AllBlocksCleared()))
    assert idx.overlaps_by_tier([5, 6], "a") == {"store": 2}


def test_a_block_dropped_from_the_store_stops_counting_and_the_index_is_bounded():
    idx = KVIndex(store_max_blocks=3)
    idx.apply(batch("a", 0, AllBlocksCleared(), BlockStored(block_hashes=(1, 2, 3), tier="store")))
    idx.apply(batch("a", 1, BlockRemoved(block_hashes=(2,), tier="store")))
    assert idx.overlaps_by_tier([1, 2, 3], "a") == {"store": 1}
    idx.apply(batch("a", 2, BlockStored(block_hashes=(7, 8), tier="store")))  # 1 is the oldest: dropped
    assert idx.num_tier_blocks("a", "store") == 3
    assert idx.overlaps_by_tier([1], "a") == {}
    assert idx.overlaps_by_tier([3, 7], "a") == {"store": 2}
