"""The router service over real NATS: KV events in, placement out, restarts and lifecycle events seen."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

import pytest

from pdserve.bus import Bus, RejectedError
from pdserve.config import CommonSettings, RouterSettings
from pdserve.engine.block_hash import hash_blocks
from pdserve.events import PrefillCompleted
from pdserve.messages import (
    AllBlocksCleared,
    BlockStored,
    Heartbeat,
    KVEvents,
    Role,
    RouteDecision,
    RouteRequest,
    WorkerIncompatible,
)
from pdserve.routing.simulate import sim_descriptor
from pdserve.services.router.__main__ import setup

DESC = sim_descriptor(16)  # every simulated worker's descriptor: all compatible
PROMPT = tuple(range(7, 7 + 128))


async def publish_idle_heartbeat(bus: Bus, worker_id: str, role: Role, descriptor=DESC) -> None:
    """A heartbeat of an idle worker with 4096 free KV tokens, as the router hears it."""
    await bus.publish(
        bus.subjects.heartbeat(worker_id),
        Heartbeat(worker_id=worker_id, role=role, descriptor=descriptor, num_running=0, num_waiting=0,
                  kv_capacity_tokens=4096, kv_free_tokens=4096, ts=time.time()),
    )


@pytest.fixture(scope="module")
async def bus(settings: CommonSettings) -> AsyncIterator[Bus]:
    b = await Bus.connect(
        settings.model_copy(update={"subject_prefix": settings.subject_prefix + "rt",
                                   "events_stream": settings.events_stream + "_rt"}), "test"
    )
    cleanup = await setup(b, RouterSettings(**b.settings.model_dump()))
    for wid, role in (("p0", Role.PREFILL), ("p1", Role.PREFILL), ("d0", Role.DECODE)):
        await publish_idle_heartbeat(b, wid, role)
    yield b
    await cleanup()
    await b.close()


async def route(bus: Bus, rid: str) -> RouteDecision:
    return await bus.request(
        bus.subjects.route,
        RouteRequest(request_id=rid, num_prompt_tokens=len(PROMPT), prompt_token_ids=PROMPT),
        RouteDecision,
        2.0,
    )


async def kv(bus: Bus, worker: str, seq: int, *events) -> None:
    await bus.publish(
        bus.subjects.kv_events(worker), KVEvents(worker_id=worker, seq=seq, events=events, ts=time.time())
    )
    await bus.nc.flush()
    await asyncio.sleep(0.05)


async def test_routes_to_the_worker_whose_kv_events_hold_the_prompt_until_it_restarts(bus):
    await kv(bus, "p1", 0, AllBlocksCleared(), BlockStored(block_hashes=tuple(hash_blocks(PROMPT, 16))))
    d = await route(bus, "r1")
    assert d.prefill_worker_id == "p1" and d.predicted_cached_tokens == 112 and d.policy == "kv"
    await bus.emit(
        "r1",
        PrefillCompleted(
            prefill_worker_id="p1",
            transfer_id="x",
            first_token_id=1,
            num_cached_tokens=112,
            num_computed_tokens=16,
            kv_bytes=1,
            prefill_s=0.1,
        ),
    )
    await kv(bus, "p1", 0, AllBlocksCleared())  # restarted in place
    d = await route(bus, "r2")
    assert d.best_cached_tokens == 0 and d.predicted_cached_tokens == 0


async def test_with_no_live_prefill_worker_the_router_places_the_prefill_on_the_decode_worker(
    settings: CommonSettings,
):
    """A router whose only live worker is a decode worker answers `local` (the decode worker prefills
    itself) instead of rejecting the request with NO_WORKERS — once it has been up a whole liveness
    window, so that no live prefill worker can still be unheard."""
    b = await Bus.connect(
        settings.model_copy(update={"subject_prefix": settings.subject_prefix + "rtlocal"}), "test"
    )
    cleanup = await setup(b, RouterSettings(**b.settings.model_dump(), heartbeat_timeout_s=0.5))
    try:
        await publish_idle_heartbeat(b, "d0", Role.DECODE)
        await b.nc.flush()
        await asyncio.sleep(0.05)
        with pytest.raises(RejectedError):  # just started: a prefill worker may not have been heard yet
            await route(b, "r-early")
        await asyncio.sleep(0.5)
        await publish_idle_heartbeat(b, "d0", Role.DECODE)
        await b.nc.flush()
        await asyncio.sleep(0.05)
        d = await route(b, "r-local")
        assert (d.mode, d.prefill_worker_id, d.decode_worker_id) == ("local", "d0", "d0")
    finally:
        await cleanup()
        await b.close()


async def test_a_decode_worker_that_matches_no_prefill_worker_is_reported(bus):
    reports: list[WorkerIncompatible] = []

    async def on_report(r: WorkerIncompatible) -> None:
        reports.append(r)

    sub = await bus.subscribe(bus.subjects.incompatible(), WorkerIncompatible, on_report)
    try:
        await publish_idle_heartbeat(bus, "p0", Role.PREFILL)
        await publish_idle_heartbeat(bus, "d9", Role.DECODE, DESC.model_copy(update={"hash_seed": 7}))
        await bus.nc.flush()
        for _ in range(50):
            if reports:
                break
            await asyncio.sleep(0.02)
        assert [(r.worker_id, r.differences) for r in reports] == [("d9", {"hash_seed": ("7", "0")})]
    finally:
        await sub.unsubscribe()
