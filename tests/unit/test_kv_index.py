"""The router's KV index: built from KV events, reconciled with digests, never trusting lost state."""

from __future__ import annotations

import time

from pdserve.messages import AllBlocksCleared, BlockRemoved, BlockStored, KVDigest, KVEvents
from pdserve.routing.cache_model import PrefixCacheModel
from pdserve.routing.kv_index import KVIndex


def batch(worker: str, seq: int, *events) -> KVEvents:
    return KVEvents(worker_id=worker, seq=seq, events=events, ts=time.time())


def digest(worker: str, seq: int, hashes: set[int]) -> KVDigest:
    x = 0
    for h in hashes:
        x ^= h
    return KVDigest(worker_id=worker, seq=seq, num_blocks=len(hashes), xor_hashes=x, ts=time.time())


def test_overlap_counts_only_the_leading_run_each_worker_holds():
    idx = KVIndex()
    idx.apply(batch("a", 0, AllBlocksCleared(), BlockStored(block_hashes=(1, 2, 3))))
    idx.apply(batch("b", 0, AllBlocksCleared(), BlockStored(block_hashes=(1, 5, 3))))
    assert idx.overlaps([1, 2, 3, 4], ["a", "b", "c"]) == {"a": 3, "b": 1, "c": 0}
    idx.apply(batch("a", 1, BlockRemoved(block_hashes=(2,))))
    assert idx.overlaps([1, 2, 3], ["a", "b"]) == {"a": 1, "b": 1}
    assert idx.num_blocks() == 3 and idx.num_blocks("a") == 2


def test_all_blocks_cleared_wipes_only_that_worker():
    idx = KVIndex()
    idx.apply(batch("a", 0, AllBlocksCleared(), BlockStored(block_hashes=(1, 2))))
    idx.apply(batch("b", 0, AllBlocksCleared(), BlockStored(block_hashes=(1, 2))))
    idx.apply(batch("a", 0, AllBlocksCleared()))  # restarted in place: seq starts again
    assert idx.overlaps([1, 2], ["a", "b"]) == {"a": 0, "b": 2}
    assert not idx.is_partial("a")


def test_a_lost_batch_drops_the_workers_entries_and_marks_it_partial():
    idx = KVIndex()
    idx.apply(batch("a", 0, AllBlocksCleared(), BlockStored(block_hashes=(1, 2))))
    idx.apply(batch("a", 2, BlockStored(block_hashes=(7,))))  # seq 1 was lost
    assert idx.gaps == 1 and idx.is_partial("a")
    assert idx.overlaps([1, 2], ["a"]) == {"a": 0}
    assert idx.overlaps([7], ["a"]) == {"a": 1}  # what came after the gap is still known


def test_a_repeated_batch_is_ignored():
    idx = KVIndex()
    idx.apply(batch("a", 0, AllBlocksCleared(), BlockStored(block_hashes=(1,))))
    idx.apply(batch("a", 1, BlockRemoved(block_hashes=(1,))))
    idx.apply(batch("a", 0, BlockStored(block_hashes=(1,))))
    assert idx.overlaps([1], ["a"]) == {"a": 0} and idx.gaps == 0


def test_a_mismatching_digest_treats_the_worker_as_cold_until_a_digest_matches():
    idx = KVIndex()
    idx.apply(batch("a", 0, AllBlocksCleared(), BlockStored(block_hashes=(1, 2, 3))))
    assert idx.check_digest(digest("a", 0, {1, 2, 3}))
    assert not idx.check_digest(digest("a", 0, {1, 2}))  # the worker evicted 3 and we never heard
    assert idx.digest_mismatches == 1 and idx.is_partial("a")
    assert idx.overlaps([1], ["a"]) == {"a": 0}
    idx.apply(batch("a", 1, BlockStored(block_hashes=(9,))))
    idx.apply(batch("a", 2, BlockRemoved(block_hashes=(1, 2))))  # the unknown blocks leave the worker
    assert idx.check_digest(digest("a", 2, {9}))
    assert not idx.is_partial("a") and idx.overlaps([9], ["a"]) == {"a": 1}


def test_a_digest_ahead_of_the_index_waits_one_digest_for_its_batches():
    """Digests and events come on different subscriptions: a digest may overtake its batches."""
    idx = KVIndex()
    idx.apply(batch("a", 0, AllBlocksCleared(), BlockStored(block_hashes=(1,))))
    assert idx.check_digest(digest("a", 2, {1, 4, 5}))  # batches 1 and 2 are still on their way
    idx.apply(batch("a", 1, BlockStored(block_hashes=(4,))))
    idx.apply(batch("a", 2, BlockStored(block_hashes=(5,))))
    assert idx.check_digest(digest("a", 2, {1, 4, 5})) and idx.gaps == 0 and not idx.is_partial("a")
    assert idx.check_digest(digest("a", 4, {1, 4, 5, 6, 7}))  # ahead again...
    assert not idx.check_digest(digest("a", 5, {1, 4, 5, 6, 7, 8}))  # ...and batches 3-5 never came
    assert idx.gaps == 1 and idx.is_partial("a") and idx.overlaps([1], ["a"]) == {"a": 0}
    idx.apply(batch("a", 6, BlockStored(block_hashes=(9,))))  # continues from the digest's seq: no new gap
    assert idx.gaps == 1 and idx.overlaps([9], ["a"]) == {"a": 1}


def test_a_router_started_while_a_worker_holds_blocks_keeps_what_it_hears_since():
    """The worker's digests disagree until the blocks the router never heard of are evicted; what the
    router heard meanwhile stays usable (a restarted router must not route blind)."""
    cache = PrefixCacheModel("a", capacity_blocks=16)
    cache.start()
    cache.prefill(list(range(8)))  # before this router started
    idx = KVIndex()
    assert not idx.check_digest(cache.digest())  # first contact: partial, aligned on the digest's seq
    idx.apply(cache.prefill(list(range(100, 104)))[1])
    assert not idx.check_digest(cache.digest())  # blocks 0-7 are unknown to the index...
    assert idx.overlaps(list(range(100, 104)), ["a"]) == {"a": 4}  # ...what it heard is kept
    for k in range(5):
        idx.apply(cache.prefill(list(range(200 + 10 * k, 204 + 10 * k)))[1])
    assert idx.check_digest(cache.digest()) and not idx.is_partial("a")  # 0-7 evicted: exact again
    assert idx.num_blocks("a") == len(cache) == 16


def test_a_silent_worker_expires_and_a_heartbeat_keeps_it():
    now = [0.0]
    idx = KVIndex(ttl_s=5.0, clock=lambda: now[0])
    idx.apply(batch("a", 0, AllBlocksCleared(), BlockStored(block_hashes=(1,))))
    idx.apply(batch("b", 0, AllBlocksCleared(), BlockStored(block_hashes=(1,))))
    now[0] = 4.0
    idx.touch("b")
    now[0] = 8.0
    assert idx.expire() == ["a"]
    assert idx.overlaps([1], ["a", "b"]) == {"a": 0, "b": 1}
    assert idx.worker_ids == ["b"]


def test_index_fed_by_a_cache_model_agrees_with_its_digest_through_evictions():
    cache, idx = PrefixCacheModel("a", capacity_blocks=8), KVIndex()
    idx.apply(cache.start())
    for start in range(0, 40, 3):
        _, events = cache.prefill(list(range(start, start + 5)))
        if events:
            idx.apply(events)
        assert idx.check_digest(cache.digest())
    assert idx.num_blocks("a") == len(cache) == 8
