"""Two routers at once (docs/architecture.md §18): each books the other's placements (`RouteBooked`), so
a burst split between them spreads over the workers as one router's would, instead of each router
sending its half to the workers it alone believes idle."""

from __future__ import annotations

from collections import Counter

from pdserve.config import RouterSettings
from pdserve.messages import Role
from pdserve.routing.active_load import ActiveLoad
from pdserve.routing.router import Placer
from tests.unit.test_routing_policy import hb, req


def router() -> Placer:
    p = Placer(RouterSettings(seed=0))
    for h in (hb("p0", Role.PREFILL), hb("p1", Role.PREFILL), hb("d0", Role.DECODE), hb("d1", Role.DECODE)):
        p.observe_heartbeat(h)
    return p


def burst(share: bool) -> tuple[int, int]:
    """Eight cold requests of equal size, routed alternately by router a and b (the queue group), none
    finished yet. Returns the largest imbalance (most − fewest requests placed) among the prefill and
    among the decode workers at any moment of the burst: what the workers really got, from both."""
    a, b = router(), router()
    prefill: Counter[str] = Counter({"p0": 0, "p1": 0})
    decode: Counter[str] = Counter({"d0": 0, "d1": 0})
    worst = [0, 0]
    for i in range(8):
        here, there = (a, b) if i % 2 == 0 else (b, a)
        d = here.route(req(f"r{i}", list(range(i * 1000, i * 1000 + 160))))
        prefill[d.prefill_worker_id] += 1
        decode[d.decode_worker_id] += 1
        worst = [max(worst[0], max(prefill.values()) - min(prefill.values())),
                 max(worst[1], max(decode.values()) - min(decode.values()))]
        if share:
            booked = here.booked(f"r{i}", "router-a" if here is a else "router-b")
            assert booked is not None and there.observe_booking(booked)
    return worst[0], worst[1]


def test_shared_bookings_spread_a_burst_split_between_two_routers_as_one_router_would():
    assert burst(share=True) == (1, 1)


def test_without_sharing_two_routers_send_consecutive_requests_to_the_same_workers():
    assert burst(share=False) == (2, 2)  # each believes the worker the other just used idle


def test_a_peer_booking_heard_after_the_request_ended_is_not_booked():
    load = ActiveLoad()
    load.release("r1")  # its terminal event came first
    assert not load.book_peer("r1", "p0", 4, "d0", 10) and len(load) == 0
    load.prefill_done("r2")  # its PrefillCompleted came first: booked on decode only
    assert load.book_peer("r2", "p0", 4, "d0", 10)
    assert load.prefill_blocks("p0") == 0 and load.kv_blocks("d0") == 10 and load.requests("d0") == 1
    load.release("r2")
    assert len(load) == 0 and load.kv_blocks("d0") == 0
