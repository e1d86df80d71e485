"""Routing policies and placement decisions (the router's logic without NATS)."""

from __future__ import annotations

import random
import time
from collections import Counter

import pytest
from prometheus_client import REGISTRY

from pdserve.bus import RejectedError
from pdserve.config import RouterSettings
from pdserve.engine.block_hash import hash_blocks
from pdserve.messages import (
    BlockStored,
    CompatibilityDescriptor,
    Heartbeat,
    KVEvents,
    RejectCode,
    Role,
    RouteRequest,
)
from pdserve.routing.cache_model import PrefixCacheModel
from pdserve.routing.policy import (
    Candidate,
    KVCost,
    LeastLoaded,
    Random,
    RoundRobin,
    make_policy,
    softmax_sample,
)
from pdserve.routing.registry import WorkerRegistry
from pdserve.routing.router import Placer
from pdserve.routing.simulate import sim_descriptor

DESC = sim_descriptor(16)  # every simulated worker's descriptor: all compatible


def hb(worker_id: str, role: Role, running: int = 0, descriptor: CompatibilityDescriptor = DESC) -> Heartbeat:
    return Heartbeat(
        worker_id=worker_id,
        role=role,
        descriptor=descriptor,
        num_running=running,
        num_waiting=0,
        kv_capacity_tokens=1000,
        kv_free_tokens=1000,
        ts=time.time(),
    )


def cand(
    wid: str,
    cached: int = 0,
    prefill: int = 0,
    decode: int = 0,
    active: int = 0,
    blocks: int = 10,
    recent: float = 0.0,
):
    return Candidate(
        worker_id=wid,
        role=Role.PREFILL,
        prompt_blocks=blocks,
        cached_blocks=cached,
        active_prefill_blocks=prefill,
        active_decode_blocks=decode,
        active_requests=active,
        kv_usage=0.0,
        recent_requests=recent,
    )


def placer(policy: str = "kv", **kw) -> Placer:
    p = Placer(RouterSettings(policy=policy, seed=0, **kw))
    for h in (hb("p0", Role.PREFILL), hb("p1", Role.PREFILL), hb("p2", Role.PREFILL), hb("d0", Role.DECODE)):
        p.observe_heartbeat(h)
    return p


def req(rid: str, tokens: list[int]) -> RouteRequest:
    return RouteRequest(request_id=rid, num_prompt_tokens=len(tokens), prompt_token_ids=tuple(tokens))


def stored(worker: str, seq: int, tokens: list[int]) -> KVEvents:
    return KVEvents(
        worker_id=worker,
        seq=seq,
        ts=time.time(),
        events=(BlockStored(block_hashes=tuple(hash_blocks(tokens, 16))),),
    )


PROMPT = list(range(1000, 1000 + 160))  # 10 blocks


# ---------------------------------------------------------------- policies


def test_kv_cost_is_weighted_prefill_blocks_plus_decode_blocks():
    policy = KVCost(overlap_score_weight=2.0)
    assert policy.scores([cand("a", cached=4, prefill=3, decode=5)]) == [2.0 * (6 + 3) + 5]


def test_kv_prefers_the_cached_worker_until_its_queue_outweighs_the_hit():
    policy = KVCost()
    assert policy.select([cand("a"), cand("b", cached=8)]) == 1
    assert policy.select([cand("a"), cand("b", cached=8, prefill=8)]) == 1  # equal cost: take the hit
    assert policy.select([cand("a"), cand("b", cached=8, prefill=9)]) == 0


def test_queued_blocks_weighted_below_uncached_keep_a_request_on_its_warm_worker():
    """Dynamo's weight 1 sends the request to the idle cold worker once the warm queue exceeds the hit;
    at 0.25 a queue of 9 blocks costs 2.25, less than the 8 uncached blocks the cold worker computes."""
    warm, cold = cand("a", cached=8, prefill=9), cand("b")
    assert KVCost(active_prefill_weight=1.0).select([warm, cold]) == 1
    assert KVCost(active_prefill_weight=0.25).select([warm, cold]) == 0
    assert KVCost(active_prefill_weight=0.25).select([cand("a", cached=8, prefill=40), cold]) == 1


def test_balance_term_sends_what_the_cache_does_not_decide_to_the_worker_with_least_recent_traffic():
    policy = KVCost(balance_weight=0.25)
    shared = [cand("a", cached=2, recent=40), cand("b", cached=2, recent=10), cand("c", cached=2, recent=20)]
    assert policy.select(shared) == 1
    # A shared system prompt cached only on the busiest worker does not outweigh its share of traffic...
    assert policy.select([cand("a", cached=2, recent=40), cand("b", recent=10), cand("c", recent=20)]) == 1
    # ...while a conversation's own history does: it sticks.
    assert policy.select([cand("a", cached=8, recent=40), cand("b", recent=10), cand("c", recent=20)]) == 0
    assert KVCost().select([cand("a", cached=2, recent=40), cand("b", recent=10)]) == 0  # β = 0: Dynamo


def test_kv_ties_go_to_the_cache_then_load_then_recent_traffic_never_to_list_order():
    policy = KVCost()
    assert policy.select([cand("a", active=2), cand("b", active=1), cand("c", active=3)]) == 1
    assert policy.select([cand("a", active=1, recent=5), cand("b", active=1, recent=2)]) == 1
    assert policy.select([cand("a", recent=1), cand("b", recent=9), cand("c", recent=0.5)]) == 2


def test_imbalance_guard_sends_to_the_least_loaded_whatever_is_cached():
    policy = KVCost(active_prefill_weight=0.0, balance_abs_threshold=4, balance_rel_threshold=1.5)
    assert policy.select([cand("a", cached=9, active=10), cand("b", active=1)]) == 1  # 9 > 4, 10 > 1.5
    assert policy.select([cand("a", cached=9, active=4), cand("b", active=1)]) == 0  # 3 ≤ 4: the cache


def test_kv_with_temperature_samples_cheaper_workers_more_often():
    policy = KVCost(temperature=0.3, seed=1)
    picks = Counter(
        policy.select([cand("a"), cand("b", cached=5), cand("c", cached=10)]) for _ in range(3000)
    )
    assert picks[2] > picks[1] > picks[0] > 0


def test_softmax_sample_is_uniform_when_costs_are_equal():
    rng = random.Random(0)
    picks = Counter(softmax_sample([3.0, 3.0, 3.0], 0.5, rng) for _ in range(3000))
    assert all(900 < picks[i] < 1100 for i in range(3))


def test_round_robin_cycles_whatever_is_cached():
    policy = RoundRobin()
    cands = [cand("a", cached=10), cand("b"), cand("c")]
    assert [policy.select(cands) for _ in range(6)] == [0, 1, 2, 0, 1, 2]


def test_least_loaded_ignores_the_cache():
    assert LeastLoaded().select([cand("a", cached=10, active=3), cand("b", active=1)]) == 1


def test_random_is_seeded_and_covers_every_worker():
    a = [Random(seed=7).select([cand("a"), cand("b"), cand("c")]) for _ in range(1)]
    b = [Random(seed=7).select([cand("a"), cand("b"), cand("c")]) for _ in range(1)]
    policy = Random(seed=7)
    assert a == b and set(policy.select([cand("a"), cand("b"), cand("c")]) for _ in range(100)) == {0, 1, 2}


def test_an_unknown_policy_name_is_an_error():
    with pytest.raises(ValueError, match="round_robin"):
        make_policy("fastest")


# ---------------------------------------------------------------- placement


def test_kv_routes_to_the_worker_holding_the_prefix_and_records_the_ceiling():
    p = placer()
    p.observe_kv_events(stored("p1", 0, PROMPT[:96]))  # 6 blocks
    p.observe_kv_events(stored("p2", 0, PROMPT[:32]))  # 2 blocks
    d = p.route(req("r1", PROMPT))
    assert (d.mode, d.prefill_worker_id, d.decode_worker_id) == ("disaggregated", "p1", "d0")
    assert d.predicted_cached_tokens == d.best_cached_tokens == 96
    assert d.policy == "kv" and d.block_size == 16 and len(d.prompt_block_hashes) == 10
    terms = {c.worker_id: c for c in d.candidates}
    assert (terms["p1"].cached_blocks, terms["p1"].uncached_blocks) == (6, 4)
    assert (terms["p2"].cached_blocks, terms["p0"].cached_blocks) == (2, 0)
    assert terms["p1"].cost < terms["p2"].cost < terms["p0"].cost


def test_round_robin_records_the_ceiling_it_missed():
    p = placer("round_robin")
    p.observe_kv_events(stored("p2", 0, PROMPT))
    d = p.route(req("r1", PROMPT))
    assert d.prefill_worker_id == "p0" and d.predicted_cached_tokens == 0 and d.best_cached_tokens == 144


def test_a_fully_cached_prompt_still_computes_its_last_block():
    p = placer()
    p.observe_kv_events(stored("p0", 0, PROMPT))
    d = p.route(req("r1", PROMPT))
    assert d.predicted_cached_tokens == 144  # 9 of 10 blocks: the last token is always computed


def test_cache_salt_keeps_equal_prompts_apart():
    p = placer()
    p.observe_kv_events(stored("p1", 0, PROMPT))
    salted = RouteRequest(
        request_id="r", num_prompt_tokens=160, prompt_token_ids=tuple(PROMPT), cache_salt="t1"
    )
    assert p.route(salted).best_cached_tokens == 0


def placements(mode: str, reason: str) -> float:
    """`pdserve:router_placements_total{mode, reason}` now (the default registry is process-wide)."""
    labels = {"mode": mode, "reason": reason}
    return REGISTRY.get_sample_value("pdserve:router_placements_total", labels) or 0.0


def test_a_short_uncached_prompt_is_prefilled_locally_when_the_decode_worker_is_idle():
    p = placer(local_prefill_max_tokens=64, local_prefill_max_active_requests=1)
    before = placements("local", "short_prompt"), placements("disaggregated", "policy")
    d = p.route(req("r1", PROMPT[:48]))
    assert (d.mode, d.prefill_worker_id, d.decode_worker_id) == ("local", "d0", "d0")
    d = p.route(req("r2", PROMPT))  # 160 uncached tokens: too long to prefill locally
    assert d.mode == "disaggregated" and d.prefill_worker_id.startswith("p")
    p.route(req("r3", PROMPT[:48]))  # the decode worker now holds two requests: busy
    assert p.route(req("r4", PROMPT[:48])).mode == "disaggregated"
    after = placements("local", "short_prompt"), placements("disaggregated", "policy")
    assert (after[0] - before[0], after[1] - before[1]) == (1, 3)  # r1 local; r2, r3, r4 not


def test_local_prefill_counts_what_the_decode_worker_has_cached():
    p = placer(local_prefill_max_tokens=32)
    p.observe_kv_events(stored("d0", 0, PROMPT))
    assert p.route(req("r1", PROMPT)).mode == "local"  # 16 uncached tokens on d0


def test_incompatible_workers_are_never_paired_and_reported_once():
    """d0 cannot take p0's KV: it is reported (once per descriptor, not per heartbeat) and prefills for
    itself rather than being paired with p0; a compatible peer ends the report."""
    now = [0.0]
    p = Placer(RouterSettings(), clock=lambda: now[0])
    now[0] = 10.0  # past the router's first liveness window: every live worker has been heard
    assert p.observe_heartbeat(hb("p0", Role.PREFILL)) is None  # no decode worker yet: nothing to match
    odd = DESC.model_copy(update={"block_size": 32})
    report = p.observe_heartbeat(hb("d0", Role.DECODE, descriptor=odd))
    assert report is not None and (report.worker_id, report.peers) == ("d0", ("p0",))
    assert report.differences == {"block_size": ("32", "16")}
    assert p.observe_heartbeat(hb("d0", Role.DECODE, descriptor=odd)) is None
    d = p.route(req("r", PROMPT))
    assert (d.mode, d.prefill_worker_id, d.decode_worker_id) == ("local", "d0", "d0")
    assert p.observe_heartbeat(hb("p1", Role.PREFILL, descriptor=odd)) is None  # p1 matches d0
    assert p.observe_heartbeat(hb("d0", Role.DECODE, descriptor=odd)) is None
    assert p.observe_heartbeat(hb("p0", Role.PREFILL)).differences == {"block_size": ("16", "32")}


def test_a_router_just_started_waits_for_prefill_workers_instead_of_prefilling_on_decode():
    """Within its first liveness window a router has maybe not heard every live worker: with only a decode
    worker heard it answers NO_WORKERS (the coordinator retries), not `local`."""
    now = [0.0]
    p = Placer(RouterSettings(heartbeat_timeout_s=3.0), clock=lambda: now[0])
    p.observe_heartbeat(hb("d0", Role.DECODE))
    with pytest.raises(RejectedError) as e:
        p.route(req("r1", PROMPT))
    assert e.value.code is RejectCode.NO_WORKERS
    now[0] = 1.0
    p.observe_heartbeat(hb("p0", Role.PREFILL))  # heard within the window
    assert p.route(req("r2", PROMPT)).mode == "disaggregated"


def test_with_no_live_prefill_worker_the_decode_worker_prefills_itself():
    now = [0.0]
    p = Placer(RouterSettings(heartbeat_timeout_s=3.0), clock=lambda: now[0])
    for h in (hb("p0", Role.PREFILL), hb("d0", Role.DECODE, running=2), hb("d1", Role.DECODE)):
        p.observe_heartbeat(h)
    assert p.route(req("r1", PROMPT)).mode == "disaggregated"
    p.release("r1")
    now[0] = 4.0  # p0 went silent; the decode workers still beat
    p.observe_heartbeat(hb("d0", Role.DECODE, running=2))
    p.observe_heartbeat(hb("d1", Role.DECODE))
    before = placements("local", "no_prefill_worker")
    d = p.route(req("r2", PROMPT))
    assert placements("local", "no_prefill_worker") == before + 1  # what tells an operator it happened
    assert (d.mode, d.prefill_worker_id, d.decode_worker_id) == ("local", "d1", "d1")  # the less loaded
    assert d.best_cached_tokens == 0 and {c.worker_id for c in d.candidates} == {"d0", "d1"}


def test_with_no_decode_or_unified_worker_routing_is_rejected():
    p = Placer(RouterSettings())
    p.observe_heartbeat(hb("p0", Role.PREFILL))
    with pytest.raises(RejectedError) as e:
        p.route(req("r", PROMPT))
    assert e.value.code is RejectCode.NO_WORKERS


def test_only_unified_workers_route_colocated_to_the_least_loaded():
    p = Placer(RouterSettings(policy="least_loaded"))
    p.observe_heartbeat(hb("u0", Role.UNIFIED, 1))
    p.observe_heartbeat(hb("u1", Role.UNIFIED, 0))
    d = p.route(req("r", PROMPT))
    assert (d.mode, d.prefill_worker_id, d.decode_worker_id) == ("colocated", "u1", "u1")


def test_silent_workers_expire():
    reg = WorkerRegistry(timeout_s=0.0)
    reg.observe(hb("p0", Role.PREFILL))
    time.sleep(0.01)
    assert reg.live(Role.PREFILL, Role.DECODE) == []


def test_a_worker_restarted_in_place_is_not_routed_to_for_blocks_it_no_longer_holds():
    p = placer()
    caches = {w: PrefixCacheModel(w, 64) for w in ("p0", "p1", "p2")}
    for c in caches.values():
        p.observe_kv_events(c.start())
    p.observe_kv_events(caches["p1"].prefill(hash_blocks(PROMPT, 16))[1])
    p.observe_kv_events(caches["p2"].prefill(hash_blocks(PROMPT[:64], 16))[1])
    assert p.route(req("r1", PROMPT)).prefill_worker_id == "p1"
    p.release("r1")
    p.observe_kv_events(caches["p1"].start())  # p1 restarts: AllBlocksCleared, seq 0 again
    d = p.route(req("r2", PROMPT))
    assert d.prefill_worker_id == "p2" and d.best_cached_tokens == 64
    assert next(c for c in d.candidates if c.worker_id == "p1").cached_blocks == 0


def test_bookings_spread_a_burst_and_are_released_when_the_request_ends():
    p = placer()
    picks = [p.route(req(f"r{i}", [i] * 160)).prefill_worker_id for i in range(6)]
    assert Counter(picks) == {"p0": 2, "p1": 2, "p2": 2}
    for i in range(6):
        p.prefill_done(f"r{i}")
    assert all(p.load.prefill_blocks(w) == 0 for w in ("p0", "p1", "p2"))
    assert p.load.kv_blocks("d0") == 60
    for i in range(6):
        p.release(f"r{i}")
    assert p.load.kv_blocks("d0") == 0 and len(p.load) == 0
