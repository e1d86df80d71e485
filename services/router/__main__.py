"""Router: live workers from heartbeats, the KV index from their KV events and digests, its own load
bookings and those its peers publish (`pds.router.booked`), released by the lifecycle events; answers
placement requests (`pdserve.routing.router`). Several routers share the `router` queue group."""

from __future__ import annotations

import asyncio
import logging
import secrets

from opentelemetry import trace

from pdserve.bus import Bus
from pdserve.config import RouterSettings
from pdserve.events import TERMINAL_TYPES, Event
from pdserve.messages import Heartbeat, KVDigest, KVEvents, RouteBooked, RouteDecision, RouteRequest
from pdserve.routing.router import Placer
from pdserve.service import run_service
from pdserve.telemetry import metrics

tracer = trace.get_tracer("pdserve.router")
log = logging.getLogger("pdserve.router")


async def setup(bus: Bus, settings: RouterSettings):
    placer = Placer(settings)
    # Unique even where replicas share a name (compose's --scale): peers tell their bookings from its own.
    router_id = f"{settings.worker_id}.{secrets.token_hex(4)}"
    metrics.init_router_series()

    async def on_heartbeat(hb: Heartbeat) -> None:
        if (report := placer.observe_heartbeat(hb)) is not None:
            log.warning(
                "%s worker %s matches no live peer (%s): it is not paired while that lasts; differs in %s",
                report.role.value, report.worker_id, ", ".join(report.peers),
                ", ".join(f"{k} {mine} vs {theirs}" for k, (mine, theirs) in report.differences.items()),
            )
            await bus.publish(bus.subjects.incompatible(hb.worker_id), report)

    async def on_kv_events(batch: KVEvents) -> None:
        placer.observe_kv_events(batch)

    async def on_kv_digest(digest: KVDigest) -> None:
        if not placer.observe_kv_digest(digest):
            log.warning(
                "KV digest of %s disagrees with the index at seq %d: its blocks count as cold "
                "until a digest matches",
                digest.worker_id,
                digest.seq,
            )

    async def on_lifecycle(event: Event) -> None:
        if event.type == "PrefillCompleted":
            placer.prefill_done(event.request_id)
        elif event.type in TERMINAL_TYPES:
            placer.release(event.request_id)

    async def on_booked(booked: RouteBooked) -> None:
        if booked.router_id != router_id:
            placer.observe_booking(booked)

    async def route(req: RouteRequest) -> RouteDecision:
        with tracer.start_as_current_span("router.route") as span:
            span.set_attribute("pdserve.request_id", req.request_id)
            decision = placer.route(req)
            if (booked := placer.booked(req.request_id, router_id)) is not None:
                await bus.publish(bus.subjects.booked, booked)  # before the reply: peers book it first
            span.set_attribute("pdserve.mode", decision.mode)
            span.set_attribute("pdserve.predicted_cached_tokens", decision.predicted_cached_tokens)
            span.set_attribute("pdserve.best_cached_tokens", decision.best_cached_tokens)
            return decision

    async def expire_forever() -> None:
        while True:
            await asyncio.sleep(1.0)
            placer.expire()

    events = bus.subjects.all_events.removesuffix(">")
    subs = [
        await bus.subscribe(bus.subjects.heartbeat(), Heartbeat, on_heartbeat),
        await bus.subscribe(bus.subjects.booked, RouteBooked, on_booked),
        await bus.subscribe(bus.subjects.kv_events(), KVEvents, on_kv_events),
        await bus.subscribe(bus.subjects.kv_digest(), KVDigest, on_kv_digest),
        *[
            await bus.subscribe(f"{events}*.{t}", Event, on_lifecycle)  # type: ignore[type-var]
            for t in ("PrefillCompleted", *sorted(TERMINAL_TYPES))
        ],
    ]
    await bus.serve(bus.subjects.route, RouteRequest, route, queue="router")
    expiry = asyncio.ensure_future(expire_forever())

    async def cleanup() -> None:
        expiry.cancel()
        for sub in subs:
            await sub.unsubscribe()

    return cleanup


def main() -> None:
    settings = RouterSettings()
    run_service("router", settings, lambda bus: setup(bus, settings))


if __name__ == "__main__":
    main()
