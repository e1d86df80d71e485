"""A fresh Submit's route is asked while the coordinator's lease claim is in flight
(`RequestLifecycle.route_ahead`), on a real NATS and lease bucket: a Submit whose claim another coordinator
already won has had its route asked, yet records nothing and runs nothing here. A gateway's Submit (with a
`Receipt`) is accepted once its `RequestReceived` is stored, first among the request's events, once."""

from __future__ import annotations

import asyncio

from nats.errors import NoRespondersError

from pdserve.bus import Bus, BusTimeout, RejectedError
from pdserve.config import CoordinatorSettings
from pdserve.events import Event, RequestFailed, RequestReceived, RequestRouted
from pdserve.ids import new_id
from pdserve.lifecycle.coordinator import Coordinator
from pdserve.lifecycle.journal import request_events
from pdserve.lifecycle.ownership import Ownership
from pdserve.messages import Accepted, Receipt, RejectCode, RouteRequest, SamplingParams, Submit


async def submit_when_served(bus: Bus, submit: Submit) -> Accepted:
    """`submit` from `bus` until a coordinator answers. A request sent from one connection right after
    another one subscribed (and flushed) may still find no responder: measured with bare nats-py on a
    lone nats-server, about 1 in 300; in this file's runs, 1 in 6-10. A Submit is idempotent."""
    for _ in range(40):
        try:
            return await bus.request(bus.subjects.submit, submit, Accepted, timeout_s=5)
        except BusTimeout as e:
            if not isinstance(e.__cause__, NoRespondersError):
                raise
            await asyncio.sleep(0.05)
    raise AssertionError("no coordinator answered the Submit within 2 s")


async def test_a_submit_another_coordinator_owns_is_routed_ahead_then_dropped_unrecorded(settings):
    s = CoordinatorSettings(**{**settings.model_dump(), "events_stream": f"{settings.events_stream}_ra",
                               "worker_id": "coordinator-ra", "placement": "router"})
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
        accepted = await submit_when_served(other_bus, submit)
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


async def test_a_gateway_submit_is_accepted_once_its_request_received_is_stored_first_and_once(settings):
    s = CoordinatorSettings(**{**settings.model_dump(), "events_stream": f"{settings.events_stream}_rr",
                               "subject_prefix": f"{settings.subject_prefix}rr",
                               "worker_id": "coordinator-rr", "route_wait_s": 0.3, "placement": "router"})
    coordinator_bus, gateway_bus, router_bus = [await Bus.connect(s, name) for name in ("c", "g", "r")]
    coordinator = Coordinator(coordinator_bus, s)

    async def router(req: RouteRequest):
        raise RejectedError(RejectCode.NO_WORKERS, "test router")  # the request fails in route

    try:
        await router_bus.serve(router_bus.subjects.route, RouteRequest, router)
        await coordinator.serve()
        rid = new_id()
        receipt = Receipt(event_id=new_id(), endpoint="/v1/completions", stream=True, stop=("###",))
        submit = Submit(request_id=rid, model="m", prompt_token_ids=(1, 2, 3),
                        sampling=SamplingParams(max_tokens=4), received_ts=123.0, receipt=receipt)
        await submit_when_served(gateway_bus, submit)
        stored = [r.event for r in await request_events(gateway_bus, rid)]
        assert [e.type for e in stored] == ["RequestReceived"]  # stored by the time it was accepted
        assert stored[0].event_id == receipt.event_id and stored[0].service == "c"
        assert stored[0].typed_payload() == RequestReceived(
            model="m", endpoint="/v1/completions", num_prompt_tokens=3, max_tokens=4, stream=True,
            prompt_token_ids=[1, 2, 3], sampling=SamplingParams(max_tokens=4), stop=["###"],
            received_ts=123.0)
        # the gateway's refusal path stores it again under the receipt's id: JetStream keeps one
        await gateway_bus.emit_stored(rid, RequestReceived.of(submit), event_id=receipt.event_id)
        for _ in range(100):
            types = [r.event.type for r in await request_events(gateway_bus, rid)]
            if RequestFailed.type in types:
                break
            await asyncio.sleep(0.05)
        assert types == ["RequestReceived", "RequestFailed"]
    finally:
        await coordinator.stop()
        for bus in (coordinator_bus, gateway_bus, router_bus):
            await bus.close()
