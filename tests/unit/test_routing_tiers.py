"""The router over KV tiers (issue 16): the index keeps what each worker's offload tier holds beside its
pool (outside the digest), a candidate's cached run is split by the best tier holding each block, and the
kv cost weighs a tier block by 1 − copy cost / prefill cost per token, so pool > offload > store."""

from __future__ import annotations

import time

import pytest

from pdserve.config import RouterSettings
from pdserve.engine.block_hash import hash_blocks
from pdserve.messages import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    Heartbeat,
    KVDigest,
    KVEvents,
    Role,
    RouteRequest,
)
from pdserve.routing.kv_index import KVIndex
from pdserve.routing.policy import Candidate, KVCost, tier_weights
from pdserve.routing.router import Placer
from pdserve.routing.simulate import sim_descriptor


def batch(worker: str, seq: int, *events) -> KVEvents:
    return KVEvents(worker_id=worker, seq=seq, events=events, ts=time.time())


def test_the_index_splits_a_leading_run_by_the_best_tier_holding_each_block():
    idx = KVIndex()
    idx.apply(batch("a", 0, AllBlocksCleared(), BlockStored(block_hashes=(1, 2)),
                    BlockStored(block_hashes=(2, 3, 4), tier="offload")))
    assert idx.overlaps_by_tier([1, 2, 3, 4, 5], "a") == {"pool": 2, "offload": 2}
    assert idx.overlaps_by_tier([3, 1], "a") == {"offload": 1, "pool": 1}
    assert idx.overlaps_by_tier([9, 1], "a") == {}
    assert idx.overlaps_by_tier([1], "nobody") == {}
    assert idx.overlaps([1, 2, 3], ["a"]) == {"a": 2}  # the pool-only lookup is unchanged
    idx.apply(batch("a", 1, BlockRemoved(block_hashes=(1,)), BlockRemoved(block_hashes=(3,), tier="offload")))
    assert idx.overlaps_by_tier([1, 2], "a") == {}
    assert idx.overlaps_by_tier([2, 3, 4], "a") == {"pool": 1}
    assert idx.num_tier_blocks("a", "offload") == 2


def test_tier_blocks_stay_out_of_the_digest_and_go_with_a_gap_or_a_restart():
    idx = KVIndex()
    idx.apply(batch("a", 0, AllBlocksCleared(), BlockStored(block_hashes=(1,)),
                    BlockStored(block_hashes=(7, 8), tier="offload")))
    assert idx.check_digest(KVDigest(worker_id="a", seq=0, num_blocks=1, xor_hashes=1, ts=time.time()))
    assert not idx.is_partial("a") and idx.num_tier_blocks("a", "offload") == 2
    idx.apply(batch("a", 5, BlockStored(block_hashes=(2,))))  # batches 1-4 lost
    assert idx.num_tier_blocks("a", "offload") == 0
    idx.apply(batch("a", 6, BlockStored(block_hashes=(9,), tier="offload")))
    idx.apply(batch("a", 0, AllBlocksCleared()))
    assert idx.num_tier_blocks("a", "offload") == 0


def test_tier_weights_are_one_minus_copy_over_prefill_cost_and_rank_pool_offload_store():
    w = tier_weights(RouterSettings(prefill_s_per_token=1e-3, offload_copy_s_per_token=1e-4,
                                    store_copy_s_per_token=5e-4, disk_copy_s_per_token=2e-3))
    assert w == pytest.approx({"pool": 1.0, "offload": 0.9, "store": 0.5, "disk": 0.0})
    assert w["pool"] > w["offload"] > w["store"]


def cand(wid: str, by_tier: dict[str, int], blocks: int = 10) -> Candidate:
    return Candidate(worker_id=wid, role=Role.PREFILL, prompt_blocks=blocks,
                     cached_blocks=sum(by_tier.values()), active_prefill_blocks=0, active_decode_blocks=0,
                     active_requests=0, kv_usage=0.0, cached_blocks_by_tier=by_tier)


def test_the_kv_cost_prefers_a_pool_hit_to_an_offload_hit_to_a_store_hit_of_equal_length():
    policy = KVCost(tier_weights={"pool": 1.0, "offload": 0.9, "store": 0.5})
    cands = [cand("a-store", {"store": 6}), cand("b-offload", {"offload": 6}), cand("c-pool", {"pool": 6})]
    assert policy.scores(cands) == pytest.approx([7.0, 4.6, 4.0])
    assert cands[policy.select(cands)].worker_id == "c-pool"
    # a longer offload hit beats a shorter pool hit once it saves more prefill
    longer = [cand("a-pool", {"pool": 4}), cand("b-offload", {"offload": 6})]
    assert longer[policy.select(longer)].worker_id == "b-offload"


def test_without_tier_weights_every_cached_block_counts_as_before():
    assert KVCost().scores([cand("a", {"pool": 2, "offload": 3})]) == [5.0]


def test_the_router_places_by_what_each_workers_offload_tier_holds():
    desc = sim_descriptor(16)
    placer = Placer(RouterSettings(policy="kv", seed=0))
    for wid, role in (("p0", Role.PREFILL), ("p1", Role.PREFILL), ("d0", Role.DECODE)):
        placer.observe_heartbeat(Heartbeat(worker_id=wid, role=role, descriptor=desc, num_running=0,
                                           num_waiting=0, kv_capacity_tokens=1000, kv_free_tokens=1000,
                                           ts=time.time()))
    tokens = list(range(1000, 1000 + 160))
    hashes = tuple(hash_blocks(tokens, 16))
    placer.observe_kv_events(
        batch("p1", 0, AllBlocksCleared(), BlockStored(block_hashes=hashes, tier="offload")))
    placer.observe_kv_events(batch("p0", 0, AllBlocksCleared()))
    d = placer.route(
        RouteRequest(request_id="r", num_prompt_tokens=len(tokens), prompt_token_ids=tuple(tokens)))
    assert d.prefill_worker_id == "p1"
    (chosen,) = [c for c in d.candidates if c.worker_id == "p1"]
    assert chosen.cached_blocks_by_tier == {"offload": 9} and chosen.cached_blocks == 9
    assert d.predicted_cached_tokens == 9 * 16
