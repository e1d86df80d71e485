"""A fresh Submit's route is asked while the coordinator's lease claim is in flight
(`RequestLifecycle.route_ahead`), on a real NATS and lease bucket: a Submit whose claim another coordinator
already won has had its route asked, yet records nothing and runs nothing here."""

from __future__ import annotations

import asyncio

from pdserve.bus import Bus, RejectedError
from pdserve.config import CoordinatorSettings
from pdserve.events import Event, RequestRouted
from pdserve.ids import new_id
from pdserve.lifecycle.coordinator import Coordinator
from pdserve.lifecycle.ownership import Ownership
from pdserve.messages import Accepted, RejectCode, RouteRequest, SamplingParams, Submit


async def test_a_submit_another_coordinator_owns_is_routed_ahead_then_dropped_unrecorded(settings):
    s = CoordinatorSettings(**{**settings.model_dump(), "events_stream": f"{settings.events_stream}_ra",
                               "worker_id": "coordinator-ra"})
    coordinator_bus, other_bus, router_bus = [await Bus.connect(s, name) for name in ("c", "o", "r")]
    coordinator = Coordinator(coordinator_bus, s)
    other = Ownership(other_bus, s)
    asked: list[RouteRequest] = []
    routed: list[Event] = []

    async def router(req: RouteRequest):
        asked.append(req)
        await asyncio.sleep(10)  # never answers in time: the question is cancelled, not waited for
        raise RejectedError(RejectCode.NO_WORKERS, "test router")

    async def on_routed(ev: Event) -> None:
        routed.append(ev)

    try:
        await router_bus.serve(router_bus.subjects.route, RouteRequest, router)
        await coordinator.serve()
        await other.start()
        rid = new_id()
        assert await other.claim(rid) is None  # another coordinator owns the request
        await coordinator_bus.subscribe(coordinator_bus.subjects.event(rid, RequestRouted.type), Event,
                                        on_routed)
        submit = Submit(request_id=rid, model="m", prompt_token_ids=(1, 2, 3),
                        sampling=SamplingParams(max_tokens=4), received_ts=0.0)
        accepted = await other_bus.request(other_bus.subjects.submit, submit, Accepted, timeout_s=5)
        assert accepted.request_id == rid
        for _ in range(100):  # the question went out ahead of the claim's answer
            if asked:
                break
            await asyncio.sleep(0.02)
        assert [q.request_id for q in asked] == [rid]
        assert asked[0].prompt_token_ids == (1, 2, 3)
        await asyncio.sleep(0.5)
        assert rid not in coordinator.active and not coordinator.claiming  # nothing runs here
        assert routed == []  # and nothing was recorded: the owner routes and records
    finally:
        if other._renewer is not None:
            other._renewer.cancel()
        await coordinator.stop()
        for bus in (coordinator_bus, other_bus, router_bus):
            await bus.close()
