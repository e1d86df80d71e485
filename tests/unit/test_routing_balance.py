"""Routing under traffic: the router's stable load measure, and how the kv policy spreads a shared
system prompt and new conversations while keeping each conversation on the worker holding its history."""

from __future__ import annotations

import random
from collections import Counter

import pytest

from pdserve.engine.block_hash import hash_blocks
from pdserve.routing.active_load import ActiveLoad
from pdserve.routing.cache_model import PrefixCacheModel
from tests.unit.test_routing_policy import placer, req


def test_recent_requests_is_an_exponentially_weighted_count_of_placements():
    load = ActiveLoad(window=4)  # each placement scales every count by 3/4
    for i, wid in enumerate(["a", "a", "b", "a"]):
        load.book(f"r{i}", wid, 1, "d0", 1)
    assert load.recent_requests("a") == pytest.approx(0.75**3 + 0.75**2 + 1)
    assert load.recent_requests("b") == pytest.approx(0.75) and load.recent_requests("d0") == 0
    for i in range(4):
        load.release(f"r{i}")  # finished requests are still recent traffic
    assert load.recent_requests("a") == pytest.approx(0.75**3 + 0.75**2 + 1) and len(load) == 0
    for i in range(100):
        load.book(f"s{i}", "a", 1, "d0", 1)
    assert load.recent_requests("a") + load.recent_requests("b") <= 4


def test_a_shared_system_prompt_under_load_does_not_send_all_traffic_to_one_worker():
    """Every request starts with the same 512-token system prompt, which only p0 has cached at first;
    requests arrive faster than prefills finish (six in flight). Each worker's prefix cache publishes
    its blocks when a prefill ends."""
    p = placer()
    caches = {w: PrefixCacheModel(w, 256) for w in ("p0", "p1", "p2")}
    for c in caches.values():
        p.observe_kv_events(c.start())
    system = list(range(512))
    p.observe_kv_events(caches["p0"].prefill(hash_blocks(system, 16))[1])
    rng = random.Random(0)
    in_flight: list[tuple[str, str, list[int]]] = []
    picks: Counter[str] = Counter()
    for i in range(60):
        tokens = system + [rng.randrange(49152) for _ in range(128)]
        d = p.route(req(f"r{i}", tokens))
        picks[d.prefill_worker_id] += 1
        in_flight.append((f"r{i}", d.prefill_worker_id, tokens))
        if len(in_flight) > 6:
            rid, wid, done = in_flight.pop(0)
            _, events = caches[wid].prefill(hash_blocks(done, 16))
            if events:
                p.observe_kv_events(events)
            p.prefill_done(rid)
    assert set(picks) == {"p0", "p1", "p2"}
    assert max(picks.values()) <= 0.5 * 60, picks


def test_new_conversations_spread_evenly_over_the_workers_and_then_stick_to_theirs():
    """Every conversation starts with the same 128-token system prompt, cached at first on p0 only; each
    turn's prompt is the whole history; a prefill ends (and its KV events arrive) three decisions after
    it was routed. With Dynamo's cost alone conversations start where the system prompt is cached and
    pile up there; the balance term spreads the starts, and each conversation's own history then keeps
    it on its worker."""
    p = placer()
    caches = {w: PrefixCacheModel(w, 4096) for w in ("p0", "p1", "p2")}
    for c in caches.values():
        p.observe_kv_events(c.start())
    system = list(range(128))
    p.observe_kv_events(caches["p0"].prefill(hash_blocks(system, 16))[1])
    rng = random.Random(0)
    history = {c: list(system) for c in range(24)}
    placed: dict[int, list[str]] = {c: [] for c in range(24)}
    in_flight: list[tuple[str, str, list[int]]] = []
    for turn in range(4):
        for c in range(24):
            history[c] += [rng.randrange(49152) for _ in range(48)]  # the user's message
            rid = f"c{c}-{turn}"
            wid = p.route(req(rid, history[c])).prefill_worker_id
            placed[c].append(wid)
            in_flight.append((rid, wid, list(history[c])))
            if len(in_flight) > 3:
                done, where, tokens = in_flight.pop(0)
                _, events = caches[where].prefill(hash_blocks(tokens, 16))
                if events:
                    p.observe_kv_events(events)
                p.prefill_done(done)
                p.release(done)
            history[c] += [rng.randrange(49152) for _ in range(64)]  # the assistant's reply
    starts = Counter(ws[0] for ws in placed.values())
    requests = Counter(w for ws in placed.values() for w in ws)
    assert len(starts) == 3 and max(starts.values()) <= 1.5 * min(starts.values()), starts
    assert max(requests.values()) <= 1.5 * min(requests.values()), requests
    assert sum(len(set(ws)) > 1 for ws in placed.values()) <= 3, placed  # Dynamo's cost alone: 10 moved
